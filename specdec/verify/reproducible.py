"""Reproducible sampling: a request's seed fixes its output whatever else runs.

With rejection sampling (:mod:`specdec.verify`), a sampled answer depends on what was drafted:
the uniforms a step consumes, and the tokens they are compared with, change with ``k``, with the
proposer and, in a batch, with the other rows (one ``k`` per step, shared random streams). A
server cannot promise "same seed, same answer" that way.

Here each output position ``t`` of a request owns ONE uniform ``u_t``, the ``t``-th draw of the
request's own ``torch.Generator``, and the token committed at ``t`` is always
``F_p^{-1}(u_t)`` (:func:`specdec.verify.sampling.sample_at`, the inverse CDF of the target's processed
distribution ``p`` at ``t``) — exactly what plain decoding with that generator commits.

* Exact: ``u_t`` is drawn independently of everything before position ``t`` (the prefix depends
  on ``u_0 .. u_{t-1}`` only), so the token at ``t`` given its prefix is distributed as ``p``.
* Verification compares: a draft (chain token, or a tree node at depth ``d``) is accepted iff it
  equals ``F_p^{-1}(u)`` at its position, under the ``p`` its own path gives. The first position
  without a matching draft commits ``F_p^{-1}(u)`` itself (the replacement, or the bonus).
* Hence the committed tokens do not depend on the drafts, ``k``, the tree, the batch or the
  timing: a seeded request's answer equals plain decoding with the same seed, token for token.
* Greedy rows are the limit case: ``p`` is one-hot, the draw is the argmax whatever ``u``, and
  rejection sampling would commit the same tokens; the engine verifies them this way without
  computing probabilities at all (:func:`verify_chain_drawn` with the argmax).
* Cost: a draft is accepted with probability ``P(F_p^{-1}(u) = d)``. For a deterministic draft
  that is ``p(d)``, the same as rejection sampling. For a draft sampled from ``q`` with its own
  randomness it is ``sum_x p(x) q(x)``, below rejection sampling's ``sum_x min(p, q)``: seeded
  requests trade some acceptance of sampled drafts for reproducibility.
"""

from __future__ import annotations

import torch

from specdec.verify.sampling import sample_at
from specdec.verify.tree import TreeVerification
from specdec.verify.chain import ChainVerification

__all__ = ["PositionUniforms", "verify_chain_at", "verify_chain_drawn", "verify_tree_at", "verify_tree_drawn"]


class PositionUniforms:
    """One request's uniforms, one per output position, drawn from its own generator in order
    (positions a step looks at but does not commit are kept for the next step)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._drawn = torch.empty(0, dtype=torch.float64)

    def take(self, start: int, count: int) -> torch.Tensor:
        """``[count]`` float64: the uniforms of output positions ``start .. start + count - 1``."""
        need = start + count - self._drawn.shape[0]
        if need > 0:
            more = torch.rand(max(need, 16), generator=self.generator, dtype=torch.float64)
            self._drawn = torch.cat([self._drawn, more])
        return self._drawn[start : start + count]


def verify_chain_at(target_probs: torch.Tensor, draft_tokens: torch.Tensor, uniforms: torch.Tensor) -> ChainVerification:
    """``target_probs`` ``[B, k+1, V]``, ``draft_tokens`` ``[B, k]``, ``uniforms`` ``[B, k+1]``
    (the rows' uniforms at the block's k+1 output positions) -> the committed tokens: the drafts
    up to the first one that differs from the target's own draw, then that draw."""
    return verify_chain_drawn(sample_at(target_probs, uniforms), draft_tokens)


def verify_chain_drawn(drawn: torch.Tensor, draft_tokens: torch.Tensor) -> ChainVerification:
    """The same, from the target's draws ``[B, k+1]`` at each position: ``F_p^{-1}(u)``, or for a
    greedy row the argmax (the only token a one-hot ``p`` can give: greedy rows need no
    probabilities at all, and rejection sampling would commit the same tokens)."""
    k = draft_tokens.shape[1]
    match = drawn[:, :k] == draft_tokens  # [B, k]
    num_accepted = match.long().cumprod(-1).sum(-1)  # [B]
    positions = torch.arange(k + 1).unsqueeze(0)  # [1, k+1]
    tokens = torch.where(positions <= num_accepted.unsqueeze(1), drawn, -1)  # accepted drafts == drawn
    return ChainVerification(num_accepted=num_accepted, tokens=tokens)


def verify_tree_at(target_probs: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                   uniforms: torch.Tensor) -> TreeVerification:
    """``target_probs`` ``[B, N+1, V]`` (slot 0: the root), ``tokens`` / ``parents`` / ``depths``
    ``[B, N]`` (padding: token -1), ``uniforms`` ``[B, D+1]`` with ``D`` the deepest node: every
    slot at depth ``d`` draws with ``u_d`` (siblings share their position)."""
    slot_depth = torch.cat([torch.zeros(tokens.shape[0], 1, dtype=torch.long), depths], 1)  # [B, N+1]
    return verify_tree_drawn(sample_at(target_probs, uniforms.gather(1, slot_depth)), tokens, parents, depths)


def verify_tree_drawn(drawn: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                      depths: torch.Tensor) -> TreeVerification:
    """From the target's draw at every slot ``[B, N+1]``: walk down from the root, each time to
    a child whose token equals the current slot's draw; commit the draw where none does."""
    batch, n = tokens.shape
    max_depth = int(depths.max()) if n else 0
    rows = torch.arange(batch)
    node = torch.full((batch,), -1, dtype=torch.long)  # current node (-1: the root)
    walking = torch.ones(batch, dtype=torch.bool)
    path = torch.full((batch, max_depth), -1, dtype=torch.long)
    num_accepted = torch.zeros(batch, dtype=torch.long)
    for d in range(max_depth):
        want = drawn[rows, node + 1]  # [B] the target's draw at the current slot
        is_child = (parents == node.unsqueeze(1)) & (tokens == want.unsqueeze(1)) & (tokens >= 0)  # [B, N]
        found = is_child.any(1) & walking
        if not bool(found.any()):
            break
        child = is_child.long().argmax(1)  # first matching child
        path[found, d] = child[found]
        num_accepted += found.long()
        node = torch.where(found, child, node)
        walking = found
    out = torch.full((batch, max_depth + 1), -1, dtype=torch.long)
    if max_depth:
        out[:, :max_depth] = torch.where(path >= 0, tokens.gather(1, path.clamp(min=0)), -1)
    out[rows, num_accepted] = drawn[rows, node + 1]  # the draw after the accepted path
    return TreeVerification(num_accepted=num_accepted, tokens=out, path=path)
