"""A draft whose vocabulary differs from the target's in a few tokens (specdec/text/vocab.py):
it drafts the tokens both have, matched by string, as the target's ids.

The law battery: the target reads 6 strings (a..f); the draft numbers 5 of them otherwise and
lacks "f" (it has two strings of its own instead), so its q is zero at the target's "f", which the
target still emits (and the draft then reads through the fallback). The first three tokens at
T = 0.7, top-k 5 follow the exact target law (chi-square over 10^5 samples, 216 cells). The
negative control is the mistake this map exists to avoid: q left in the draft's numbering (each
column at the draft's id, not the target's); it fails the same test with p < 1e-6. Greedy output
equals plain decoding, through the engine and through the CLI."""

from __future__ import annotations

import json

import torch

from specdec.core.engine import generate
from specdec.proposers.base import Proposal
from specdec.proposers.draft_model import DraftModelProposer
from specdec.text.vocab import MIN_SHARED, VocabMap
from specdec.verify.sampling import SamplingParams
from stats import ALPHA, chi_square_pvalue
from tiny_models import (N_SAMPLES, PARAMS, PROMPT, V_SMALL, char_tokenizer, hf_tiny, law_joint, ours, perturbed,
                         save_hf_dir)

GREEDY = SamplingParams(temperature=0.0)


def _tokenizer(strings: list[str]):
    """A BPE whose id i is ``strings[i]`` (single characters: no merges)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE({s: i for i, s in enumerate(strings)}, [], unk_token=None))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


TARGET_TOK = _tokenizer(list("abcdef"))
DRAFT_TOK = _tokenizer(list("edcbaxy"))  # a..e renumbered, no "f", two strings of its own


def _intersection_proposer(hf_draft, vocab: VocabMap, capacity: int) -> DraftModelProposer:
    draft = ours(hf_draft, "float32")
    rows = hf_draft.lm_head.weight.detach().float()[vocab.draft_rows(vocab.target_ids)]  # [N, E]
    return DraftModelProposer(draft.with_output_rows(rows), capacity, vocab_ids=vocab.target_ids,
                              vocab_size=vocab.target_size, vocab_map=vocab)


def test_the_map():
    vocab = VocabMap.build(TARGET_TOK, DRAFT_TOK, 6, 7)
    assert vocab.target_ids.tolist() == [0, 1, 2, 3, 4] and vocab.draft_ids.tolist() == [4, 3, 2, 1, 0]
    assert vocab.shared == 5 / 6 and not vocab.usable and MIN_SHARED > 5 / 6
    assert vocab.to_draft([0, 5, 4, 1]) == [4, 0, 0, 3]  # "f" has no draft encoding: the draft's token 0
    assert vocab.draft_tokens(torch.tensor([[2], [3]])).tolist() == [[2], [1]]


def _law_counts(monkeypatch=None, draft_numbering=False):
    target = ours(hf_tiny("llama", vocab=V_SMALL, seed=3), "float32")
    vocab = VocabMap.build(TARGET_TOK, DRAFT_TOK, V_SMALL, 7)
    proposer = _intersection_proposer(hf_tiny("llama", vocab=7, seed=4, layers=1), vocab, 16)
    if draft_numbering:  # the wrong verifier input: q's columns at the draft's ids, not the target's
        propose = proposer.propose

        def misnumbered(states, k, tree, sampling):
            out = propose(states, k, tree, sampling)
            if out.probs is None:  # (no drafts this step)
                return out
            q = torch.zeros_like(out.probs)
            q[..., vocab.draft_ids] = out.probs[..., vocab.target_ids]
            return Proposal(out.tokens, q)

        monkeypatch.setattr(proposer, "propose", misnumbered)
    rows = generate(target, [PROMPT] * N_SAMPLES, PARAMS, 3, proposer=proposer, k=2, seed=21)
    tokens = torch.tensor([r.token_ids for r in rows])  # [N, 3]
    assert (tokens == 5).any()  # the target emits the token the draft lacks
    counts = torch.bincount((tokens[:, 0] * V_SMALL + tokens[:, 1]) * V_SMALL + tokens[:, 2], minlength=V_SMALL**3)
    acc = rows[0].batch_metrics.acceptance
    assert 0 < acc.accepted < acc.drafted  # both verifier branches exercised
    return counts, law_joint(target)


def test_intersection_drafts_follow_the_exact_target_law():
    counts, joint = _law_counts()
    assert chi_square_pvalue(counts, joint) > ALPHA


def test_negative_control_q_in_the_drafts_numbering(monkeypatch):
    counts, joint = _law_counts(monkeypatch, draft_numbering=True)
    assert chi_square_pvalue(counts, joint) < 1e-6


def _renumbered(hf, shift: int, vocab: int):
    """``hf`` with the ids of :func:`char_tokenizer`'s strings rotated by ``shift`` (embedding and
    output rows, as ``char_tokenizer(shift)`` numbers them) and rows up to ``vocab``: the same
    model for that tokenizer, with ids of its own past the target's."""
    import copy

    n = len(char_tokenizer().get_vocab())  # its strings (ids 0..n-1; the model has 97 rows)
    out = copy.deepcopy(hf)
    out.resize_token_embeddings(vocab, mean_resizing=False)
    index = (torch.arange(n) - shift) % n  # new id j holds old id j - shift
    with torch.no_grad():
        out.model.embed_tokens.weight[:n].copy_(hf.model.embed_tokens.weight[index])
        out.lm_head.weight[:n].copy_(hf.lm_head.weight[index])
    return out


PROMPTS = ["abcabcabc", "Hello, world. Hello, world.", "def f(x): return x + 1", "zzz"]


def test_greedy_through_the_intersection_equals_plain_and_drafts_get_accepted():
    """The draft is the target behind another numbering, with 3 ids of its own: output equals
    plain decoding token for token, and on text of the tokenizer's strings most drafts are
    accepted. (The random target also emits id 96, which no string has: the draft reads it as
    its token 0, so on "zzz", all 96s, its drafts fail; the output is plain all the same.)"""
    hf = hf_tiny("llama")
    target = ours(hf, "float32")
    ttok, dtok = char_tokenizer(), char_tokenizer(shift=5)
    vocab = VocabMap.build(ttok, dtok, 97, 100)
    assert vocab.usable and len(vocab.target_ids) == len(ttok.get_vocab())
    prompts = [ttok(p)["input_ids"] for p in PROMPTS]
    plain = generate(target, prompts, GREEDY, 40)
    draft = _renumbered(hf, 5, 100)
    spec = generate(target, prompts, GREEDY, 40, proposer=_intersection_proposer(draft, vocab, 128), k=4)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert 96 in plain[3].token_ids and 96 not in plain[0].token_ids + plain[1].token_ids
    spec = generate(target, prompts[:2], GREEDY, 40, proposer=_intersection_proposer(draft, vocab, 128), k=4)
    acc = spec[0].batch_metrics.acceptance
    assert acc.accepted > 0.8 * acc.drafted


def test_generate_and_verify_with_a_draft_of_another_numbering(tmp_path, monkeypatch, capsys):
    from conftest import fresh_home
    from specdec.cli import main

    fresh_home(tmp_path, monkeypatch)
    hf = hf_tiny("llama")
    target = save_hf_dir(hf, tmp_path / "target")
    draft = tmp_path / "draft"
    perturbed(_renumbered(hf, 5, 100), 0.03, seed=2).save_pretrained(draft)  # right often, not always
    char_tokenizer(shift=5).save_pretrained(draft)
    base = ["generate", "--target", str(target), "--prompt", "abcabcabc", "--max-new-tokens", "16", "--json",
            "--dtype", "int8"]
    assert main(base + ["--proposer", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", str(draft), "--proposer", "draft", "--k", "3", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["token_ids"] == plain["token_ids"]
    assert f"drafts the {len(char_tokenizer().get_vocab())} tokens both have" in captured.err
    assert main(["verify", "--target", str(target), "--draft", str(draft), "--dtype", "int8", "--prompt", "abcabc"]) == 0
    assert "NOT exact" not in capsys.readouterr().out
