"""A draft model with another tokenizer (proposers/text_draft.py): its text becomes deterministic
target drafts. Greedy output equals plain decoding; at T > 0 the first three tokens follow the
exact target law (chi-square over 10^5 samples, 216 cells), and a wrong verifier that treats the
one-hot drafts as if they had been drawn from a (uniform) q fails the same test with p < 1e-6.
(The residual-skipping control for deterministic drafts is tests/test_proposers.py's n-gram one.)"""

from __future__ import annotations

import json

import torch

from specdec.core.engine import generate
from specdec.proposers.base import Proposal
from specdec.proposers.text_draft import TextDraftProposer
from specdec.verify.sampling import SamplingParams
from stats import ALPHA, chi_square_pvalue
from tiny_models import (N_SAMPLES, PARAMS, PROMPT, V_SMALL, char_tokenizer, hf_tiny, law_joint, merging_char_tokenizer,
                         ours, save_hf_dir)

GREEDY = SamplingParams(temperature=0.0)


def _tokenizer(chars: str, merges: list[tuple[str, str]] = (), shift: int = 0):
    """A BPE over ``chars`` (ids in order, rotated by ``shift``) with ``merges``: plain text, no bytes."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: (i + shift) % len(chars) for i, c in enumerate(chars)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, list(merges), unk_token=None))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


# The law tests' target reads 6 characters; the draft's tokenizer numbers them the other way
# round and merges "ab" into one token: the same text, tokenized differently.
TARGET_TOK = _tokenizer("abcdef")
DRAFT_TOK = _tokenizer("fedcba", merges=[("a", "b")])


def _law_counts(monkeypatch=None, uniform_q=False):
    target = ours(hf_tiny("llama", vocab=V_SMALL, seed=3), "int8")
    draft = ours(hf_tiny("llama", vocab=V_SMALL + 1, seed=4, layers=1), "int8")
    proposer = TextDraftProposer(draft, DRAFT_TOK, TARGET_TOK, 16)
    if uniform_q:  # a wrong verifier input: the one-hot drafts claimed to be drawn from a uniform q
        propose = proposer.propose

        def claimed(states, k, tree, sampling):
            out = propose(states, k, tree, sampling)
            return Proposal(out.tokens, torch.full((*out.tokens.shape, V_SMALL), 1.0 / V_SMALL))

        monkeypatch.setattr(proposer, "propose", claimed)
    rows = generate(target, [PROMPT] * N_SAMPLES, PARAMS, 3, proposer=proposer, k=2, seed=21)
    tokens = torch.tensor([r.token_ids for r in rows])  # [N, 3]
    counts = torch.bincount((tokens[:, 0] * V_SMALL + tokens[:, 1]) * V_SMALL + tokens[:, 2], minlength=V_SMALL**3)
    acc = rows[0].batch_metrics.acceptance
    assert 0 < acc.accepted < acc.drafted  # both verifier branches exercised
    return counts, law_joint(target)


def test_text_drafts_follow_the_exact_target_law():
    counts, joint = _law_counts()
    assert chi_square_pvalue(counts, joint) > ALPHA


def test_negative_control_one_hot_drafts_verified_as_if_sampled(monkeypatch):
    counts, joint = _law_counts(monkeypatch, uniform_q=True)
    assert chi_square_pvalue(counts, joint) < 1e-6


def _renumbered(hf, shift: int):
    """``hf`` with its token ids rotated by ``shift`` (embedding and output rows): the same model
    for a tokenizer whose ids are rotated the same way."""
    import copy

    out = copy.deepcopy(hf)
    index = (torch.arange(97) - shift) % 97  # new id j holds old id j - shift
    with torch.no_grad():
        out.model.embed_tokens.weight.copy_(hf.model.embed_tokens.weight[index])
        if not hf.config.tie_word_embeddings:
            out.lm_head.weight.copy_(hf.lm_head.weight[index])
    return out


PROMPTS = ["abcabcabc", "Hello, world. Hello, world.", "def f(x): return x + 1", "zzz"]


def test_greedy_with_a_text_draft_equals_plain_and_drafts_get_accepted():
    """The draft is the target itself behind another tokenizer (ids rotated): its text is the
    target's, so drafts are accepted; output equals plain decoding token for token. At float32
    (an fp32 KV cache): 107 of 210 drafts accepted; the quantized runtimes' fp16 cache took the
    int8 pair to 104 of 220, under this bound (the int8 text draft's greedy identity is checked
    above). Why a self-draft accepts only about half is not yet understood."""
    hf = hf_tiny("llama")
    target = ours(hf, "float32")
    draft = ours(_renumbered(hf, 5), "float32")
    ttok, dtok = char_tokenizer(), char_tokenizer(shift=5)
    prompts = [ttok(p)["input_ids"] for p in PROMPTS]
    plain = generate(target, prompts, GREEDY, 40)
    spec = generate(target, prompts, GREEDY, 40, proposer=TextDraftProposer(draft, dtok, ttok, 128), k=4)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    acc = spec[0].batch_metrics.acceptance
    assert acc.accepted > 0.5 * acc.drafted


def test_generate_and_verify_with_a_draft_of_another_tokenizer(tmp_path, monkeypatch, capsys):
    from conftest import fresh_home
    from specdec.cli import main

    fresh_home(tmp_path, monkeypatch)
    hf = hf_tiny("llama")
    target = save_hf_dir(hf, tmp_path / "target")
    draft = tmp_path / "draft"
    _renumbered(hf, 5).save_pretrained(draft)
    merging_char_tokenizer(shift=5).save_pretrained(draft)
    base = ["generate", "--target", str(target), "--prompt", "abcabcabc", "--max-new-tokens", "16", "--json",
            "--dtype", "int8"]
    assert main(base + ["--proposer", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", str(draft), "--proposer", "draft", "--k", "3"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["token_ids"] == plain["token_ids"]
    assert "has another tokenizer" in captured.err
    assert main(["verify", "--target", str(target), "--draft", str(draft), "--dtype", "int8", "--prompt", "abcabc"]) == 0
    assert "NOT exact" not in capsys.readouterr().out
