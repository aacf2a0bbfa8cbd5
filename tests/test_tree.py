"""Exact multi-candidate tree verification (specdec.verify.tree.verify_tree).

Statistical test: many streams decode a sharp first-order Markov target (zeros included) by
repeated tree verification; the committed transitions of each state must follow the target's
row (Pearson chi-square, p > 1e-6 at each state, ~60,000 tokens per configuration). Power: the
negative controls below (mixing the with- and without-replacement rules, or skipping the
residual) fail the same test with p < 1e-6 on the same data sizes.
"""

from __future__ import annotations

import pytest
import torch

from specdec import verify_chain
from specdec.verify.tree import ancestor_mask, depths, verify_tree
from stats import ALPHA, chi_square_pvalue

V = 5
# target: sharp rows with zeros; draft: a different law (also with zeros for "sparse")
P = torch.tensor([
    [0.60, 0.25, 0.10, 0.05, 0.00],
    [0.05, 0.05, 0.70, 0.00, 0.20],
    [0.30, 0.00, 0.10, 0.40, 0.20],
    [0.00, 0.50, 0.00, 0.25, 0.25],
    [0.10, 0.20, 0.30, 0.40, 0.00],
], dtype=torch.float64)
Q_FULL = torch.tensor([
    [0.20, 0.20, 0.30, 0.20, 0.10],
    [0.30, 0.10, 0.20, 0.20, 0.20],
    [0.10, 0.40, 0.10, 0.20, 0.20],
    [0.25, 0.15, 0.20, 0.20, 0.20],
    [0.40, 0.10, 0.10, 0.10, 0.30],
], dtype=torch.float64)
Q_SPARSE = torch.tensor([  # zeros where P is positive and positive where P is zero
    [0.00, 0.50, 0.00, 0.20, 0.30],
    [0.50, 0.00, 0.30, 0.20, 0.00],
    [0.00, 0.60, 0.40, 0.00, 0.00],
    [0.30, 0.30, 0.40, 0.00, 0.00],
    [0.00, 0.00, 0.50, 0.00, 0.50],
], dtype=torch.float64)
SHAPE = [-1, -1, -1, 0, 0, 1, 1, 2, 2]  # 3 children of the root, 2 under each: 9 nodes, depth 2


def _draw_children(q_rows: torch.Tensor, count: int, mode: str, g: torch.Generator) -> torch.Tensor:
    """[S, V] laws -> [S, count] candidate tokens."""
    if mode == "iid":
        return torch.multinomial(q_rows, count, replacement=True, generator=g)
    if mode == "distinct":
        return torch.multinomial(q_rows, count, replacement=False, generator=g)
    return torch.topk(q_rows + 1e-9 * torch.arange(V, 0, -1), count).indices  # deterministic: top-count


def _run(q: torch.Tensor | None, mode: str, verify_mode: str = "same", streams: int = 2000, steps: int = 18,
         seed: int = 0, tolerance: float = 1e-6):
    """Transition counts [V, V] of the committed tokens, and (accepted nodes, steps)."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.tensor(SHAPE).expand(streams, -1).clone()
    n = len(SHAPE)
    last = torch.randint(V, (streams,), generator=g)
    counts = torch.zeros(V, V, dtype=torch.float64)
    accepted = 0
    laws = Q_FULL if q is None else q
    for _ in range(steps):
        tokens = torch.empty(streams, n, dtype=torch.long)
        tokens[:, :3] = _draw_children(laws[last], 3, mode, g)
        for j, parent in enumerate([0, 1, 2]):
            tokens[:, 3 + 2 * j : 5 + 2 * j] = _draw_children(laws[tokens[:, parent]], 2, mode, g)
        ctx = torch.cat([last.unsqueeze(1), tokens], 1)  # [S, N+1]: the token each row of probs follows
        target = P[ctx]
        draft = None if q is None else q[ctx]
        without = (mode == "distinct") if verify_mode == "same" else (mode != "distinct")
        result = verify_tree(target, draft, tokens, parents, g, without_replacement=without, residual_tolerance=tolerance)
        for s in range(streams):
            prev = int(last[s])
            for tok in result.committed(s):
                counts[prev, tok] += 1
                prev = tok
            last[s] = prev
        accepted += int(result.num_accepted.sum())
    return counts, accepted / (streams * steps)


def _min_pvalue(counts: torch.Tensor) -> float:
    return min(chi_square_pvalue(counts[s], P[s]) for s in range(V))


@pytest.mark.parametrize("q, mode", [(Q_FULL, "iid"), (Q_SPARSE, "iid"), (Q_FULL, "distinct"), (None, "topk")])
def test_tree_decoding_follows_the_target_chain(q, mode):
    counts, accepted_per_step = _run(q, mode)
    assert counts.sum() > 50_000  # ~2000 streams x 18 steps x 1.5-2.9 tokens
    assert 0.3 < accepted_per_step < 1.9  # acceptance and rejection both exercised
    assert _min_pvalue(counts) > ALPHA


def test_negative_control_distinct_siblings_verified_as_independent_are_biased():
    counts, _ = _run(Q_FULL, "distinct", verify_mode="swapped")
    assert _min_pvalue(counts) < ALPHA


def test_independent_siblings_verified_as_distinct_are_caught():
    """The without-replacement rule zeroes a rejected token in q: an iid duplicate of it then
    has q = 0, which no proposer could have drawn, and verification refuses it."""
    with pytest.raises(ValueError, match="zero probability under draft_probs"):
        _run(Q_FULL, "iid", verify_mode="swapped", steps=3)


def test_negative_control_without_the_residual_is_biased():
    counts, _ = _run(Q_FULL, "iid", tolerance=float("inf"))
    assert _min_pvalue(counts) < ALPHA


def test_a_path_is_exactly_a_chain():
    g = torch.Generator().manual_seed(0)
    batch, k = 300, 4
    p = torch.softmax(torch.randn(batch, k + 1, 7, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(batch, k + 1, 7, generator=g) * 2, -1)
    drafts = torch.multinomial(q[:, :k].reshape(-1, 7), 1, generator=g).view(batch, k)
    parents = torch.arange(-1, k - 1).expand(batch, k).clone()
    for draft_probs in (q, None):
        chain = verify_chain(p, None if draft_probs is None else draft_probs[:, :k], drafts, torch.Generator().manual_seed(3))
        tree = verify_tree(p, draft_probs, drafts, parents, torch.Generator().manual_seed(3))
        assert torch.equal(chain.tokens, tree.tokens) and torch.equal(chain.num_accepted, tree.num_accepted)
        n = tree.num_accepted
        assert (tree.path[torch.arange(k).expand(batch, k) < n.unsqueeze(1)] >= 0).all()


def test_greedy_descends_while_a_child_is_the_argmax():
    p = torch.zeros(1, 6, 4)
    p[0, 0, 2] = 1.0  # root: argmax 2
    p[0, 2, 1] = 1.0  # after node 1 (token 2): argmax 1
    p[0, 4, 3] = 1.0  # after node 3 (token 1): argmax 3 (bonus)
    p[0, 1, 0] = p[0, 3, 0] = p[0, 5, 0] = 1.0
    tokens = torch.tensor([[0, 2, 3, 1, 0]])  # root -> {0, 2}; node 1 (2) -> {3 (node 2), 1 (node 3)}; node 3 -> {0}
    parents = torch.tensor([[-1, -1, 1, 1, 3]])
    result = verify_tree(p, None, tokens, parents, torch.Generator().manual_seed(0))
    assert result.path.tolist() == [[1, 3, -1]]
    assert result.tokens.tolist() == [[2, 1, 3, -1]]  # node 4 (token 0) rejected: argmax 3 instead


def test_padding_nodes_are_skipped_in_ragged_batches():
    p = torch.full((2, 4, 3), 1 / 3, dtype=torch.float64)
    tokens = torch.tensor([[0, 1, 2], [1, -1, -1]])
    parents = torch.tensor([[-1, 0, 1], [-1, -1, -1]])
    result = verify_tree(p, p, tokens, parents, torch.Generator().manual_seed(0))
    assert result.tokens.shape == (2, 4) and result.path.shape == (2, 3)
    assert result.num_accepted.tolist() == [3, 1]  # p == q: every tried candidate is accepted
    assert result.tokens[1, 2:].tolist() == [-1, -1]


def test_masks_and_depths():
    parents = torch.tensor([[-1, 0, 0, 1]])
    assert ancestor_mask(parents)[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert depths(torch.tensor([[-1, 0, 0, 1, -1]]), torch.tensor([[1, 2, 3, 4, -1]])).tolist() == [[1, 2, 2, 3, 0]]


@pytest.mark.parametrize(
    "tokens, parents, message",
    [
        ([[0, 1]], [[-1, 1]], "parents"),  # a node is its own parent
        ([[0, 1]], [[-1, 2]], "parents"),
        ([[-1, 1]], [[-1, 0]], "padding node"),
        ([[0, 9]], [[-1, 0]], "ids in"),
    ],
)
def test_malformed_trees_are_clear_errors(tokens, parents, message):
    p = torch.full((1, 3, 4), 0.25)
    with pytest.raises(ValueError, match=message):
        verify_tree(p, None, torch.tensor(tokens), torch.tensor(parents))


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_scoring_a_tree_then_keeping_the_accepted_branch_equals_the_chain(arch):
    """The target scores a whole tree in one forward (ancestor mask, position = prefix + depth);
    the cache then keeps only the accepted branch (compacted into place) and decoding continues
    exactly as if that branch had been decoded as a chain (int8: bit-identical logits)."""
    from tiny_models import hf_tiny, ours

    model = ours(hf_tiny(arch), "int8")
    prefix = torch.tensor([[5, 9, 14, 2, 7, 31]])
    root = 40
    tokens = torch.tensor([[11, 12, 13, 21, 22, 23]])  # root -> {11, 12, 13}; 12 -> {21, 22}; 22 -> {23}
    parents = torch.tensor([[-1, -1, -1, 1, 1, 4]])
    path = torch.tensor([[1, 4, 5]])  # accept 12 -> 22 -> 23: nodes out of place, so K/V must move
    n = torch.tensor([3])

    cache = model.new_cache(1, 32)
    model(prefix, cache)
    before = cache.lengths.clone()
    mask = torch.ones(1, 7, 7, dtype=torch.bool).tril()
    mask[:, 1:, 1:] = ancestor_mask(parents)
    mask[:, 1:, 0] = True
    positions = before.unsqueeze(1) + torch.cat([torch.zeros(1, 1, dtype=torch.long), depths(parents, tokens)], 1)
    model(torch.cat([torch.tensor([[root]]), tokens], 1), cache, tree_mask=mask, positions=positions)
    cache.keep_path(before, path, n)
    after_tree = model(torch.tensor([[50]]), cache)

    chain = model.new_cache(1, 32)
    model(torch.cat([prefix, torch.tensor([[root, 12, 22, 23]])], 1), chain)
    after_chain = model(torch.tensor([[50]]), chain)
    assert torch.equal(after_tree, after_chain)
