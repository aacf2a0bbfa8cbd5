"""Fuzzing ``verify_chain``: random shapes, dtypes and awkward distributions; invariants only.

Fast profile (``make test``): 300 cases. The documented slow profile runs 10^5 cases:

    SPECDEC_FUZZ_EXAMPLES=100000 .venv/bin/python -m pytest -q tests/test_verify_fuzz.py

Invariants checked on every case: no exception for valid input (fp16/bf16 rows included, whose
low-precision sums are not exactly 1), ``0 <= num_accepted <= k``, committed ids in range and
``-1`` padding after them, the committed prefix equals the drafts, every accepted draft and the
final token have target probability > 0, and ``q == p`` accepts every draft.
"""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import verify_chain

EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "300"))
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
KINDS = ["sharp", "sparse", "one_hot", "tiny_mass", "uniform", "random"]


def _row(kind: str, vocab: int, g: torch.Generator) -> torch.Tensor:
    """One distribution in float64."""
    if kind == "one_hot":
        w = torch.zeros(vocab, dtype=torch.float64)
        w[torch.randint(vocab, (1,), generator=g)] = 1.0
    elif kind == "uniform":
        w = torch.ones(vocab, dtype=torch.float64)
    elif kind == "tiny_mass":  # one token holds nearly everything; the rest are barely there
        w = torch.full((vocab,), 1e-7, dtype=torch.float64)
        w[torch.randint(vocab, (1,), generator=g)] = 1.0
    else:
        w = torch.rand(vocab, generator=g, dtype=torch.float64)
        if kind == "sharp":
            w = w**12
        elif kind == "sparse":
            w = w * (torch.rand(vocab, generator=g, dtype=torch.float64) < 0.3)
            if w.sum() == 0:
                w[0] = 1.0
    return w / w.sum()


def _probs(kinds: list[str], shape: tuple[int, int], vocab: int, dtype, g) -> torch.Tensor:
    rows = [_row(kinds[i % len(kinds)], vocab, g) for i in range(shape[0] * shape[1])]
    if not rows:
        return torch.zeros(*shape, vocab, dtype=dtype)
    return torch.stack(rows).view(*shape, vocab).to(dtype)  # each row cast once, not renormalised


@st.composite
def cases(draw):
    batch = draw(st.integers(1, 4))
    k = draw(st.integers(0, 6))
    vocab = draw(st.integers(2, 40))
    dtype = draw(st.sampled_from(DTYPES))
    p_kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3))
    q_mode = draw(st.sampled_from(["sampled", "deterministic", "equal"]))
    q_kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3))
    seed = draw(st.integers(0, 2**31 - 1))
    return batch, k, vocab, dtype, p_kinds, q_mode, q_kinds, seed


@settings(max_examples=EXAMPLES, deadline=None)
@given(cases())
def test_verify_chain_invariants(case):
    batch, k, vocab, dtype, p_kinds, q_mode, q_kinds, seed = case
    g = torch.Generator().manual_seed(seed)
    p = _probs(p_kinds, (batch, k + 1), vocab, dtype, g)  # [B, k+1, V]
    if q_mode == "deterministic":
        q = None
        drafts = torch.randint(vocab, (batch, k), generator=g)
    else:
        q = p[:, :k].clone() if q_mode == "equal" else _probs(q_kinds, (batch, k), vocab, dtype, g)
        if k:
            drafts = torch.multinomial(q.double().reshape(-1, vocab), 1, generator=g).view(batch, k)
        else:
            drafts = torch.zeros(batch, 0, dtype=torch.long)
    result = verify_chain(p, q, drafts, g)

    n = result.num_accepted  # [B]
    assert n.dtype == torch.long and result.tokens.shape == (batch, k + 1)
    assert ((n >= 0) & (n <= k)).all()
    for row in range(batch):
        m = int(n[row])
        committed = result.tokens[row, : m + 1]
        assert ((committed >= 0) & (committed < vocab)).all()
        assert (result.tokens[row, m + 1 :] == -1).all()
        assert torch.equal(committed[:m], drafts[row, :m])
        probs_at = p[row, torch.arange(m + 1), committed].double()
        assert (probs_at > 0).all(), "an accepted or sampled token had target probability 0"
    if q_mode == "equal":
        assert (n == k).all(), "q == p must accept every draft"
