"""Verification blocks: a step's drafts as the engine sees them, a chain or a tree.

A block knows its inputs (:attr:`proposal`), how the target scores it in ONE call
(:meth:`score`), how each kind of row verifies it (:meth:`verify_sampled` for rejection sampling,
:meth:`verify_drawn` from the target's own draws, with :meth:`slot_uniforms` placing a seeded
row's uniforms), how the KV cache keeps what was accepted (:meth:`commit_kv`), and its depth per
row (:attr:`depth`, :attr:`scored`). The engine calls these and never asks which shape it holds:
:func:`block_of` is the one place a proposal's shape is read.

Row kinds (:class:`RowKind`) are the three ways a row commits tokens; each is exact:
greedy rows commit the target's argmax, rows with a seed the target's inverse-CDF draws at their
own uniforms (:mod:`specdec.verify.reproducible`), the others rejection sampling from the engine's
stream (:mod:`specdec.verify`, :mod:`specdec.verify.tree`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from specdec.proposers.base import Proposal
from specdec.verify.reproducible import verify_chain_drawn, verify_tree_drawn
from specdec.verify.tree import TreeVerification, ancestor_mask, verify_tree_unchecked
from specdec.verify.chain import ChainVerification


class RowKind(Enum):
    GREEDY = "greedy"  # the target's argmax (a one-hot p: no probabilities needed)
    REPRODUCIBLE = "reproducible"  # the target's inverse-CDF draws at the request's own uniforms
    REJECTION = "rejection"  # rejection sampling from the engine's stream (the best acceptance)


def row_kind(greedy: bool, seeded: bool) -> RowKind:
    return RowKind.GREEDY if greedy else RowKind.REPRODUCIBLE if seeded else RowKind.REJECTION


@dataclass(frozen=True)
class ChainBlock:
    """``[last committed token, d_1..d_k]``: position i scores d_{i+1}, position k the bonus."""

    proposal: Proposal
    trees = False

    @property
    def depth(self) -> list[int]:
        """The draft positions each row offered."""
        return [self.proposal.size] * self.proposal.tokens.shape[0]

    @property
    def scored(self) -> list[int]:
        """The draft tokens the target scored per row."""
        return self.depth

    def rows(self, index: torch.Tensor) -> "ChainBlock":
        return ChainBlock(self.proposal.rows(index))

    def fit(self, max_depth: int, controller) -> "ChainBlock":
        return self  # a chain is already at most k <= max_depth long

    def score(self, target, cache, last: torch.Tensor, want_hidden: bool):
        """One target call -> logits ``[B, k+1, V]`` (and features ``[B, k+1, E]`` when
        ``want_hidden``, else None)."""
        block = torch.cat([last.unsqueeze(1), self.proposal.tokens], 1)  # [B, k+1]
        out = target(block, cache, return_hidden=want_hidden)
        return out if want_hidden else (out, None)

    def verify_sampled(self, probs: torch.Tensor, generator: torch.Generator, verifier) -> ChainVerification:
        """Rejection sampling of the chain (``verifier``: :func:`~specdec.verify.chain.verify_chain`'s
        signature; only exactness checks pass another one)."""
        return verifier(probs, self.proposal.probs, self.proposal.tokens, generator)

    def draw_width(self, rows: list[int]) -> int:
        """Uniforms each of ``rows`` (seeded rows) uses this step: one per position."""
        return self.proposal.size + 1

    def slot_uniforms(self, u: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``u`` ``[S, width]`` of ``rows`` -> the uniform of each slot: position i draws with u_i."""
        return u

    def verify_drawn(self, drawn: torch.Tensor) -> ChainVerification:
        return verify_chain_drawn(drawn, self.proposal.tokens)

    def put_rows(self, into: ChainVerification, rows: torch.Tensor, part: ChainVerification) -> None:
        """Write the verification of a subset of the rows (``rows`` ``[R]``) into the batch's, in place."""
        into.num_accepted[rows] = part.num_accepted
        into.tokens[rows] = -1
        into.tokens[rows, : part.tokens.shape[1]] = part.tokens

    def commit_kv(self, cache, before: torch.Tensor, result: ChainVerification, hidden: torch.Tensor | None):
        """Keep the KV of the fed token and the accepted drafts (O(1): truncate)."""
        cache.truncate(before + 1 + result.num_accepted)
        return _last_committed(result), hidden


@dataclass(frozen=True)
class TreeBlock:
    """``[root, node_0..node_{N-1}]``: each node attends to the committed slots, the root and its
    ancestors, at position prefix + depth — so its logits are exactly those the same path would
    get as a chain. Padding nodes (token -1) score a dummy token, unused."""

    proposal: Proposal
    trees = True

    @property
    def depth(self) -> list[int]:
        if self.proposal.size == 0:
            return [0] * self.proposal.tokens.shape[0]
        return self.proposal.node_depths.max(1).values.tolist()

    @property
    def scored(self) -> list[int]:
        return (self.proposal.tokens >= 0).sum(1).tolist()

    def rows(self, index: torch.Tensor) -> "TreeBlock":
        return TreeBlock(self.proposal.rows(index))

    def fit(self, max_depth: int, controller) -> "TreeBlock":
        """Cut to ``max_depth`` levels, then pruned to the node budget of ``controller`` (adaptive k)."""
        proposal = self.proposal.cut_depth(max_depth)
        if controller is not None:
            proposal = proposal.prune(controller.nodes(proposal))
        return TreeBlock(proposal)

    def score(self, target, cache, last: torch.Tensor, want_hidden: bool):
        tokens, parents = self.proposal.tokens, self.proposal.parents  # [B, N]
        batch, n = tokens.shape
        mask = torch.zeros(batch, n + 1, n + 1, dtype=torch.bool)  # [B, N+1, N+1]
        mask[:, :, 0] = True
        mask[:, 1:, 1:] = ancestor_mask(parents)
        depth = torch.cat([torch.zeros(batch, 1, dtype=torch.long), self.proposal.node_depths], 1)  # [B, N+1]
        block = torch.cat([last.unsqueeze(1), tokens.clamp(min=0)], 1)  # [B, N+1]
        out = target(block, cache, tree_mask=mask, positions=cache.lengths.unsqueeze(1) + depth,
                     return_hidden=want_hidden)
        return out if want_hidden else (out, None)

    def verify_sampled(self, probs: torch.Tensor, generator: torch.Generator, verifier) -> TreeVerification:
        """SpecInfer's multi-step rule (recursive rejection sampling for siblings drawn without
        replacement); ``verifier`` is a chain's and does not apply."""
        p = self.proposal
        return verify_tree_unchecked(probs, p.probs, p.tokens, p.parents, generator,
                                     without_replacement=p.without_replacement)

    def draw_width(self, rows: list[int]) -> int:
        """One uniform per depth of ``rows``' trees, the root's included."""
        return (int(self.proposal.node_depths[rows].max()) if self.proposal.size else 0) + 1

    def slot_uniforms(self, u: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Every slot at depth d draws with u_d (siblings share their position)."""
        depth = self.proposal.node_depths[rows]  # [S, N]
        return u.gather(1, torch.cat([torch.zeros(len(rows), 1, dtype=torch.long), depth], 1))

    def verify_drawn(self, drawn: torch.Tensor) -> TreeVerification:
        p = self.proposal
        return verify_tree_drawn(drawn, p.tokens, p.parents, p.node_depths)

    def put_rows(self, into: TreeVerification, rows: torch.Tensor, part: TreeVerification) -> None:
        """The same for trees; a subset's tree may be shallower than the batch's: the rest stays -1."""
        ChainBlock.put_rows(self, into, rows, part)
        into.path[rows] = -1
        into.path[rows, : part.path.shape[1]] = part.path

    def commit_kv(self, cache, before: torch.Tensor, result: TreeVerification, hidden: torch.Tensor | None):
        """Keep the accepted branch (compacted into place: O(accepted)); the features of the root
        and the accepted path's nodes in order (-1 padding reads the root)."""
        cache.keep_path(before, result.path, result.num_accepted)
        if hidden is not None:
            root = torch.zeros(result.path.shape[0], 1, dtype=torch.long)  # (also when the tree is empty: path [B, 0])
            index = torch.cat([root, result.path + 1], 1).clamp(min=0)
            hidden = hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        return _last_committed(result), hidden


Block = ChainBlock | TreeBlock


def block_of(proposal: Proposal) -> Block:
    """The block of a proposal: the one place its shape (``parents`` set or not) is read."""
    return TreeBlock(proposal) if proposal.is_tree else ChainBlock(proposal)


def _last_committed(result) -> torch.Tensor:
    """``[B]`` each row's last committed token (replacement or bonus; its KV is written next step)."""
    return result.tokens.gather(1, result.num_accepted.unsqueeze(1)).squeeze(1)
