"""The Proposer protocol: suggest up to k tokens per row, then learn what was committed.

A proposer keeps each row's state (an n-gram index, unfed tokens) in an object of its own that
the row carries, and its batched state (a draft model's KV cache) itself; it keeps both in step
with the committed text through ``feed`` and ``observe``. The engine never looks into either.
Rows join (``add``) and leave (``retain``) between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal, Protocol

import torch

from specdec.runtime import elementwise
from specdec.verify.sampling import SamplingMetadata, probs_per_row, sample


def draft_token(logits: torch.Tensor, sampling: SamplingMetadata, vocab_ids: torch.Tensor | None, vocab_size: int,
                who: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row from a model's ``logits`` ``[B, N]`` over ``vocab_ids`` (full-vocabulary
    ids, sorted; ``None``: the N logits are the whole vocabulary of ``vocab_size``), drawn from
    ``sampling.generator``. Returns ``(token [B, 1], q [B, V] or None)``.

    Greedy rows never read q (the engine commits the target's argmax), so when every row is greedy
    the argmax is drafted as a deterministic candidate and no q is built. Otherwise q is processed
    over the N ids alone — the same distribution as over the full vocabulary with -inf outside
    them — and sampled there: with sorted ids the subset's CDF is the full q's with its empty steps
    left out, so the same uniform picks the same token, over fewer ids. ``who`` names the model
    in the error for non-finite logits."""
    if sampling.all_greedy:
        best = elementwise.argmax(logits)  # [B]
        return (best if vocab_ids is None else vocab_ids[best]).unsqueeze(1), None
    if not elementwise.all_finite(logits):
        raise ValueError(f"the {who} produced non-finite logits")
    sub = probs_per_row(logits, sampling.params)  # [B, N]
    picked = sample(sub, sampling.generator)  # [B]
    if vocab_ids is None:
        return picked.unsqueeze(1), sub
    q = sub.new_zeros(sub.shape[0], vocab_size)  # [B, V]: zero outside the subset
    q[:, vocab_ids] = sub
    return vocab_ids[picked].unsqueeze(1), q


def no_drafts(batch: int, tree: bool = False) -> Proposal:
    """The empty proposal of ``batch`` rows (k = 0): a chain, or an empty tree."""
    empty = torch.zeros(batch, 0, dtype=torch.long)
    if tree:
        return Proposal(empty, None, parents=empty.clone(), scores=torch.zeros(batch, 0))
    return Proposal(empty, None)


@dataclass
class Proposal:
    """A chain (``parents is None``): ``tokens[b, i]`` follows ``tokens[b, i-1]``. Or a candidate
    tree (see :mod:`specdec.verify.tree`): node ``i`` hangs from node ``parents[b, i]`` (``-1``: the
    last committed token), ``tokens == -1`` marks padding.

    ``scores`` (trees): the proposer's estimate that each node lies on the accepted path (e.g.
    the product of draft probabilities along it); non-increasing from parent to child and from
    a sibling to the next, so that :meth:`prune` keeps a valid tree. ``without_replacement``:
    siblings were drawn from ``probs`` without replacement (see :func:`specdec.verify_tree`).
    """

    tokens: torch.Tensor  # [B, k] long (a tree: [B, N], -1 padded)
    probs: torch.Tensor | None  # chain [B, k, V] / tree [B, N+1, V]: what the tokens were drawn from; None = deterministic
    parents: torch.Tensor | None = None  # [B, N] long: a tree; None: a chain
    scores: torch.Tensor | None = None  # [B, N] float (trees)
    without_replacement: bool = False
    # The proposer also fed tokens it had skipped earlier (k was 0, or the other side of a hybrid
    # drafted): this step's draft time is then not a per-draft cost (see AdaptiveK.observe).
    caught_up: bool = False
    # A chain that ended before k because the proposer judged its next position not worth
    # drafting (HeadProposer's confidence cut): adaptive k counts that position as a rejected
    # draft, so its estimates describe what a step asking for k drafts yields.
    declined: bool = False

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def size(self) -> int:
        """Draft tokens the target scores (chain length or tree nodes, padding included)."""
        return self.tokens.shape[1]

    @cached_property
    def node_depths(self) -> torch.Tensor:
        """``[B, N]`` each tree node's depth (1 for the root's children), 0 for padding; computed
        once per proposal for the engine and the tree budget."""
        from specdec.verify.tree import depths

        return depths(self.parents, self.tokens)

    def rows(self, index: torch.Tensor) -> "Proposal":
        """The proposal of the rows ``index`` ``[R]`` only."""
        def pick(t):
            return None if t is None else t[index]

        return replace(self, tokens=self.tokens[index], probs=pick(self.probs), parents=pick(self.parents),
                       scores=pick(self.scores))

    def cut_depth(self, max_depth: int) -> "Proposal":
        """This tree without the nodes deeper than ``max_depth`` (they become padding)."""
        deep = self.node_depths > max_depth  # [B, N]
        if not bool(deep.any()):
            return self
        return replace(self, tokens=self.tokens.masked_fill(deep, -1), parents=self.parents.masked_fill(deep, -1),
                       scores=self.scores.masked_fill(deep, 0.0))

    def prune(self, nodes: int) -> "Proposal":
        """A tree of the ``nodes`` best-scoring nodes of each row (ties: earlier node first),
        renumbered in their original order. The scores make the choice closed under parents and
        earlier siblings, so the result is a valid tree.

        Deterministic candidates only: a sampled candidate kept or dropped by a choice that reads
        its own value (its score, or later scores that depend on it) is no longer distributed as
        ``probs`` says, and verifying it as if it were would bias the output."""
        if not self.is_tree or nodes >= self.size:
            return self
        if self.probs is not None:
            raise ValueError("sampled candidates cannot be pruned by their scores (it would bias verification)")
        batch = self.tokens.shape[0]
        if nodes <= 0:
            empty = torch.zeros(batch, 0, dtype=torch.long)
            return Proposal(empty, None, empty.clone(), torch.zeros(batch, 0), caught_up=self.caught_up)
        score = torch.where(self.tokens >= 0, self.scores, float("-inf"))
        order = torch.sort(torch.argsort(-score, dim=1, stable=True)[:, :nodes], dim=1).values  # [B, n] kept, in order
        new_index = torch.full((batch, self.size + 1), -1, dtype=torch.long)  # old node -> new index (slot 0: -1 = root)
        new_index[torch.arange(batch).unsqueeze(1), order + 1] = torch.arange(nodes).expand(batch, nodes)
        kept_score = score.gather(1, order)
        real = kept_score > float("-inf")  # [B, n] (a row with fewer nodes keeps padding)
        tokens = torch.where(real, self.tokens.gather(1, order), -1)
        old_parents = self.parents.gather(1, order)
        parents = torch.where(real, new_index.gather(1, old_parents + 1), -1)
        if bool((real & (parents < 0) & (old_parents >= 0)).any()):
            raise ValueError("scores must not increase from a parent to its child (the pruned tree lost a parent)")
        return Proposal(tokens, None, parents, kept_score.clamp(min=0), caught_up=self.caught_up)


# Which proposals a proposer drafts (declared, never changing): "chains" only; or "trees" when some
# row is greedy (chains while every row samples; the engine may also ask for chains, see
# ShapeRace): the engine decides each step by tree_shape.
TreeMode = Literal["chains", "trees"]


class Proposer(Protocol):
    """Each row's own state (a lookup index, the tokens a draft model has not fed yet) lives in
    the row: ``add`` returns one state object per new row, the engine keeps it in the row
    (:class:`~specdec.core.rows.RowState`'s ``draft``) and hands the batch's states back, in batch
    order, to every call (``states``). What is batched across rows (a draft's KV cache) stays in
    the proposer and is compacted by ``retain``."""

    # Whether the proposer reads the target's features (a draft head): the engine then passes the
    # last block's output of the prefill to ``add`` and of each verified block to ``observe``.
    wants_target_hidden: bool
    # What it can draft; the engine chooses each step's shape from it (tree_shape) and passes it
    # to ``propose``.
    tree_mode: TreeMode

    def add(self, prompts: list[list[int]], target_hidden: torch.Tensor | None = None) -> list:
        """New rows join at the end of the batch (continuous batching; the first call starts
        it): ``prompts`` are the token ids already in each new row's context; ``target_hidden``
        ``[N, L, E]`` their target features when ``wants_target_hidden``. Returns each new row's state."""

    def feed(self, states: list, pending: list[list[int]]) -> str:
        """Take the tokens each row committed since the last ``feed`` (the first call: the first
        generated token). The engine calls it once per decoding step, before ``propose``; a
        proposer that drafts from a model may hold them until its next forward. Returns which
        source the coming ``propose`` uses ("default" for a single one): adaptive k keeps one
        controller per source."""

    def propose(self, states: list, k: int, tree: bool, sampling: SamplingMetadata) -> Proposal:
        """Propose ``k`` tokens per row: a chain, or with ``tree`` a tree of at most ``k`` nodes
        (the engine passes ``tree`` only to a proposer whose ``tree_mode`` allows it), sampling
        as ``sampling`` says (this step's rows, in batch order, and the draft stream).
        ``Proposal.caught_up`` says whether it also fed tokens it had skipped."""

    def observe(self, states: list, num_accepted: torch.Tensor, target_hidden: torch.Tensor | None = None) -> None:
        """``num_accepted`` ``[B]``: how many of the last proposal's tokens the target accepted (for
        a tree: the depth of the accepted path); ``target_hidden`` ``[B, k+1, E]`` (a tree:
        ``[B, D+1, E]``): the features of the fed token and the accepted tokens, in order, when
        ``wants_target_hidden``."""

    def retain(self, rows: list[int], left: list) -> None:
        """Keep only these rows of the batched state (by current position, in this order);
        ``left``: the states of the rows that left (a shared history may learn from them)."""


class LookupProposer(Proposer, Protocol):
    """A proposer that drafts by looking the committed text up (n-gram, suffix): what a
    :class:`~specdec.proposers.hybrid.HybridProposer` calls besides the :class:`Proposer` protocol."""

    def has_match(self, states: list, k: int = 1) -> list[bool]:
        """Per row: whether a lookup would draft now (after :meth:`feed`)."""

    def lookup(self, states: list, k: int, tree: bool) -> Proposal:
        """Draft up to ``k`` tokens (or tree nodes) per row from the index, without feeding it again."""


def tree_shape(mode: TreeMode, wanted: bool, sampling: SamplingMetadata) -> bool:
    """Whether the next proposal is a tree: the one place the shape is decided (the engine calls
    it). ``wanted``: the engine's :class:`~specdec.core.adaptive.ShapeRace` (True without one).

    While every row samples, the tree proposers draft chains. Measured on this CPU
    (docs/CHANGELOG.md, 'all layers in one call'): at temperature > 0 a tree of deterministic
    candidates commits few more tokens per call than a chain (a candidate x is accepted with
    probability p(x), a sampled draft with min(1, p/q)), while its extra nodes and drafting levels
    cost time; hybrid_tree ran at 0.90x of hybrid_head at T = 0.7. With any greedy row the tree
    stays: greedy rows gain from siblings, and a chain of sampled drafts would not be theirs."""
    return mode == "trees" and wanted and not sampling.all_random
