"""Hybrid proposer: lookup when the context repeats itself, a model draft (or head) otherwise.

Each step, if every row has a lookup match (n-gram or suffix: nearly free) the lookup proposes;
otherwise one of the model-backed sides does — the draft head, a draft model, or, with several,
the one the engine's :class:`~specdec.adaptive.Race` names (``use_model``): a head is cheap and
accepted less often, a draft model costs ~0.3 of a target step a token and is accepted more, and
which pays depends on the text and the temperature (docs/BENCHMARKS.md §21).

Every model side has to see every committed token: the tokens committed while another side
proposed are queued per side and fed to it the next time it proposes (in one forward). A side
that reads the target's features (a head) observes every verified block. ``next_source()`` tells
the engine which side the coming step uses ("ngram" or the side's name), so that adaptive k
keeps separate cost and acceptance estimates for each.
"""

from __future__ import annotations

import torch

from specdec.proposers.base import Proposal
from specdec.proposers.ngram import NgramProposer
from specdec.sampling import SamplingParams


class HybridProposer:
    def __init__(self, ngram: NgramProposer, models: dict) -> None:
        """``models``: the model-backed sides by source name, e.g. ``{"head": ..., "draft": ...}``;
        the first one drafts until :meth:`use_model` names another."""
        if not models or "ngram" in models:
            raise ValueError("a hybrid needs at least one model side, none named 'ngram'")
        self.ngram, self.models = ngram, dict(models)
        self._check_shapes()
        self.model_sources = tuple(self.models)
        self._model = self.model_sources[0]
        self._queued: dict[str, list[list[int]]] = {name: [] for name in self.models}
        self._fresh: list[list[int]] | None = None
        self._used = None

    def _check_shapes(self) -> bool:
        shapes = {self.ngram.emits_trees} | {m.emits_trees for m in self.models.values()}
        if len(shapes) > 1:
            raise ValueError("a hybrid's proposers must all emit chains or all emit trees")
        return shapes.pop()

    @property
    def emits_trees(self) -> bool:
        """The sides' common shape (tree proposers draft chains while every row samples or when
        asked, all by the same rule: :func:`~specdec.proposers.base.tree_shape`)."""
        return self._check_shapes()

    def use_trees(self, on: bool) -> None:
        self.ngram.use_trees(on)
        for model in self.models.values():
            model.use_trees(on)

    def use_model(self, name: str) -> None:
        if name not in self.models:
            raise ValueError(f"no model side {name!r}; this hybrid has {', '.join(self.models)}")
        self._model = name

    @property
    def wants_target_hidden(self) -> bool:
        return any(m.wants_target_hidden for m in self.models.values())

    def add(self, prompts: list[list[int]], params: list[SamplingParams], generator: torch.Generator,
            target_hidden: torch.Tensor | None = None) -> None:
        self.ngram.add(prompts, params, generator)
        for name, model in self.models.items():
            model.add(prompts, params, generator, target_hidden=target_hidden if model.wants_target_hidden else None)
            self._queued[name] += [[] for _ in prompts]
        self._fresh = None

    def next_source(self, pending: list[list[int]]) -> str:
        """Which side the next ``propose(pending, k)`` will use (feeds the n-gram index)."""
        if self._fresh is not pending:
            self.ngram.feed(pending)
            self._fresh = pending
        return "ngram" if all(self.ngram.has_match()) else self._model

    def propose(self, pending: list[list[int]], k: int) -> Proposal:
        source = self.next_source(pending)
        self._fresh = None
        for name, queued in self._queued.items():
            self._queued[name] = [q + p for q, p in zip(queued, pending)]
        if source == "ngram":
            self._used = self.ngram
            return self.ngram.lookup(k)
        self._used = self.models[source]
        queued, self._queued[source] = self._queued[source], [[] for _ in pending]
        return self._used.propose(queued, k)

    @property
    def caught_up(self) -> bool:
        return self._used is not self.ngram and self._used is not None and self._used.caught_up

    def observe(self, num_accepted: torch.Tensor, target_hidden: torch.Tensor | None = None) -> None:
        # A draft head must see the target's features of every committed token, whoever proposed.
        for model in self.models.values():
            if model is self._used or model.wants_target_hidden:
                model.observe(num_accepted, target_hidden=target_hidden if model.wants_target_hidden else None)

    def retain(self, rows: list[int]) -> None:
        self.ngram.retain(rows)
        for name, model in self.models.items():
            model.retain(rows)
            self._queued[name] = [self._queued[name][i] for i in rows]
