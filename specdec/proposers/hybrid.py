"""Hybrid proposer: lookup when the context repeats itself, a model draft (or head) otherwise.

The lookup side is an :class:`NgramProposer` or a :class:`SuffixProposer` (the API's hybrids use
the latter, drafting chains: it also follows the copy a row is making, see
:func:`specdec.speculation.copy_lookup`). Each step, if every row has a match the (nearly free) lookup
proposes; otherwise the model draft does. The model draft still has to see every committed token, so tokens committed
while the n-gram was in use are queued and fed to it the next time it proposes (in one forward).
``next_source()`` tells the engine which proposer the coming step uses, so that adaptive k keeps
separate cost and acceptance estimates for each.
"""

from __future__ import annotations

import torch

from specdec.proposers.base import LookupProposer, Proposal, Proposer
from specdec.sampling import SamplingParams


class HybridProposer:
    def __init__(self, lookup_side: LookupProposer, model_draft: Proposer) -> None:
        if lookup_side.tree_mode != model_draft.tree_mode:
            raise ValueError(f"a hybrid's two proposers must draft the same shapes (tree_mode "
                             f"{lookup_side.tree_mode!r} and {model_draft.tree_mode!r})")
        self.lookup_side, self.model_draft = lookup_side, model_draft
        self.tree_mode = model_draft.tree_mode
        self._queued: list[list[int]] = []
        self._fresh: list[list[int]] | None = None
        self._used = None

    @property
    def wants_target_hidden(self) -> bool:
        return self.model_draft.wants_target_hidden

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.model_draft.feature_layers

    def add(self, prompts: list[list[int]], params: list[SamplingParams], generator: torch.Generator,
            target_hidden: torch.Tensor | None = None) -> None:
        self.lookup_side.add(prompts, params, generator)
        self.model_draft.add(prompts, params, generator, target_hidden=target_hidden)
        self._queued += [[] for _ in prompts]
        self._fresh = None

    def next_source(self, pending: list[list[int]]) -> str:
        """Which proposer the next ``propose(pending, k)`` will use (feeds the n-gram index)."""
        if self._fresh is not pending:
            self.lookup_side.feed(pending)
            self._fresh = pending
        return "ngram" if all(self.lookup_side.has_match()) else "draft"

    def propose(self, pending: list[list[int]], k: int, tree: bool = False) -> Proposal:
        source = self.next_source(pending)
        self._fresh = None
        self._queued = [q + p for q, p in zip(self._queued, pending)]
        if source == "ngram":
            self._used = self.lookup_side
            return self.lookup_side.lookup(k, tree)
        self._used = self.model_draft
        queued, self._queued = self._queued, [[] for _ in self._queued]
        return self.model_draft.propose(queued, k, tree)

    def observe(self, num_accepted: torch.Tensor, target_hidden: torch.Tensor | None = None) -> None:
        # A draft head must see the target's features of every committed token, whoever proposed.
        if self._used is self.model_draft or self.model_draft.wants_target_hidden:
            self.model_draft.observe(num_accepted, target_hidden=target_hidden)

    def retain(self, rows: list[int]) -> None:
        self.lookup_side.retain(rows)
        self.model_draft.retain(rows)
        self._queued = [self._queued[i] for i in rows]

