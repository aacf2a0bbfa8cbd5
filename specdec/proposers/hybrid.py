"""Hybrid proposer: lookup when the context repeats itself, a model draft (or head) otherwise.

The lookup side is an :class:`NgramProposer` or a :class:`SuffixProposer` (the API's hybrids use
the latter, drafting chains: it also follows the copy a row is making, see
:func:`specdec.speculation.copy_lookup`). Each step, if every row has a match the (nearly free) lookup
proposes; otherwise the model draft does. Both sides are fed every step; a model draft queues the
tokens committed while the lookup was in use and feeds them the next time it proposes (in one
forward). ``feed`` tells the engine which proposer the coming step uses, so that adaptive k keeps
separate cost and acceptance estimates for each.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.proposers.base import LookupProposer, Proposal, Proposer
from specdec.verify.sampling import SamplingMetadata


class HybridRow(NamedTuple):
    """One row's state: each side's own."""

    lookup: object
    draft: object


class HybridProposer:
    def __init__(self, lookup_side: LookupProposer, model_draft: Proposer) -> None:
        if lookup_side.tree_mode != model_draft.tree_mode:
            raise ValueError(f"a hybrid's two proposers must draft the same shapes (tree_mode "
                             f"{lookup_side.tree_mode!r} and {model_draft.tree_mode!r})")
        self.lookup_side, self.model_draft = lookup_side, model_draft
        self.tree_mode = model_draft.tree_mode
        self._source = "draft"  # which side proposes this step (chosen by ``feed``)

    @property
    def wants_target_hidden(self) -> bool:
        return self.model_draft.wants_target_hidden

    def add(self, prompts: list[list[int]], target_hidden: torch.Tensor | None = None) -> list[HybridRow]:
        lookups = self.lookup_side.add(prompts)
        return [HybridRow(*pair) for pair in zip(lookups, self.model_draft.add(prompts, target_hidden=target_hidden))]

    def feed(self, states: list[HybridRow], pending: list[list[int]]) -> str:
        """Both sides take the committed ids (the model draft queues them for its next forward);
        the lookup proposes this step if every row has a match ("ngram"), else the model ("draft")."""
        lookups = [row.lookup for row in states]
        self.lookup_side.feed(lookups, pending)
        self.model_draft.feed([row.draft for row in states], pending)
        self._source = "ngram" if all(self.lookup_side.has_match(lookups)) else "draft"
        return self._source

    def propose(self, states: list[HybridRow], k: int, tree: bool, sampling: SamplingMetadata) -> Proposal:
        if self._source == "ngram":
            return self.lookup_side.lookup([row.lookup for row in states], k, tree)
        return self.model_draft.propose([row.draft for row in states], k, tree, sampling)

    def observe(self, states: list[HybridRow], num_accepted: torch.Tensor,
                target_hidden: torch.Tensor | None = None) -> None:
        # A draft head must see the target's features of every committed token, whoever proposed.
        if self._source == "draft" or self.model_draft.wants_target_hidden:
            self.model_draft.observe([row.draft for row in states], num_accepted, target_hidden=target_hidden)

    def retain(self, rows: list[int], left: list[HybridRow]) -> None:
        self.lookup_side.retain(rows, [row.lookup for row in left])
        self.model_draft.retain(rows, [row.draft for row in left])
