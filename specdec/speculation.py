"""What speculates and how: the method table and :class:`SpeculationConfig`.

This module is the one place where these decisions are made (grep for them here):

* the default method: :data:`DEFAULT_METHOD` when the target has a draft head or a draft model is
  loaded, else :data:`LOOKUP_ONLY` (:meth:`SpeculationConfig.resolve`);
* what a hybrid's model side is (the draft model, else the head, else the early exit);
* k's defaults (:data:`K_DEFAULT`, :data:`specdec.core.adaptive.K_MAX`), the lookup sizes
  (:data:`NGRAM`), the early exit's depth (:data:`EXIT_FRACTION` of the layers) and where a head
  chain stops (:data:`HEAD_MIN_SCORE`);
* how each method's proposer is built (:data:`METHODS`);
* which installed model drafts for a target under ``--draft auto`` (:func:`auto_draft`), and
  whether the default loads one (:func:`default_draft`).

The CLI (generate, serve, profile, verify), the API, the bench and the server build a config here,
validated once, and hand it on; nothing downstream decides again. ``"none"`` is plain decoding: a
resolved config never holds ``None`` as a method.

Adding a method is one builder function and one :data:`METHODS` entry (CONTRIBUTING.md shows a
worked example).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol

from specdec.core.adaptive import K_MAX, check_k
from specdec.proposers import (DraftModelProposer, HeadProposer, HeadTreeProposer, HybridProposer, NgramProposer,
                               SuffixProposer)
from specdec.proposers.suffix import SuffixHistory
from specdec.proposers.text_draft import TextDraftProposer


class Sources(Protocol):
    """What a method's builder reads: a loaded :class:`specdec.api.TextGenerator`."""

    target: object  # LoadedModel: .model is the target Transformer
    draft: object | None  # LoadedModel of the draft model, if one is loaded
    draft_text: bool  # the draft has another tokenizer than the target: it drafts text
    suffix_history: SuffixHistory  # earlier outputs, shared by the suffix proposers

    def draft_head(self): ...  # the target's DraftHead (raises if it has none)

    def draft_model(self): ...  # a heads.DraftView: the draft with its pruned output layer, its ids, its vocab map

# What speculates when the caller names no method: the hybrid (lookup where the text repeats
# itself, the suffix proposer's copy drafted as chains; else the model side: the draft model if
# one is loaded, else the target's draft head). Measured best on this CPU over the head alone and
# over the draft model alone (docs/BENCHMARKS.md, table 2; docs/CHANGELOG.md, 'the default is the hybrid').
DEFAULT_METHOD = "hybrid"
# ... and for a target with neither a draft model nor a draft head: lookup alone (the suffix
# proposer: copies of the prompt and of earlier outputs), which costs next to nothing when it finds
# no match, so it never makes decoding much slower than plain.
LOOKUP_ONLY = "suffix"
K_DEFAULT = "auto"  # k chosen each step from measured costs and acceptance (specdec.core.adaptive)
NGRAM = (2, 4)  # shortest and longest context suffix a lookup matches
EXIT_FRACTION = 4  # the early exit drafts with the first 1/EXIT_FRACTION of the target's layers
# Under adaptive k, a head chain stops where the product of the top probabilities of the head's
# raw distribution along it falls below this (its chance of reaching that position): on the
# bench's answers its first draft was accepted 3% of the time below 0.1 (docs/CHANGELOG.md,
# 'chains cut by the head's confidence'). A fixed k drafts k tokens.
HEAD_MIN_SCORE = 0.2

Builder = Callable[[Sources, "SpeculationConfig", int], object]
AUTO = "auto"  # --draft auto: the smallest installed model with the target's tokenizer (auto_draft)


def default_draft(target: str, head: bool) -> str | None:
    """The draft model loaded when the caller names neither a method nor a draft: none for a
    target with a draft head, else :func:`auto_draft`'s pick (None where there is none: then
    lookup alone, :data:`LOOKUP_ONLY`). Measured side by side on the 1.5B target with the 0.5B
    (docs/BENCHMARKS.md, table 2; median of six categories, greedy / T = 0.7): the head's hybrid
    1.40x / 1.47x, the hybrid over the draft model 1.23x / 1.25x (lowest category 1.09x / 1.03x),
    lookup alone 1.14x / 1.18x (lowest 0.96x / 0.95x)."""
    return None if head else auto_draft(target, label="default draft (the target has no draft head): ")


def auto_draft(target: str, label: str = "--draft auto: ") -> str | None:
    """The draft for ``target`` under ``--draft auto``: the smallest installed or converted model
    that is smaller than the target and has its tokenizer (the same token -> id map and special
    tokens, :func:`specdec.models.catalog.tokenizer_fingerprint`); failing that, the smallest that
    shares :data:`specdec.text.vocab.MIN_SHARED` of its token strings (a fine-tune with other
    special tokens and its base family: the draft drafts their intersection); else None. Says on
    stderr in one line (starting with ``label``) which model was chosen and why, or why none was.
    Whether such a draft pays is adaptive k's to decide each step (it drafts k = 0 where it does not)."""
    from specdec.cache import notice
    from specdec.models import catalog, loading, registry
    from specdec.text.vocab import MIN_SHARED

    directory = loading.metadata_for(target, install=True)
    spec = registry.resolve(target)
    target = spec.name if spec else target
    mine, size = catalog.tokenizer_fingerprint(directory), catalog.parameters(directory)
    others = [m for m in catalog.installed() if m.directory.resolve() != directory.resolve()]
    same = sorted((m for m in others if catalog.tokenizer_fingerprint(m.directory) == mine), key=lambda m: m.parameters)
    smaller, how = [m for m in same if m.parameters < size], f"with its tokenizer ({mine})"
    if not smaller:
        smaller = sorted((m for m in others if m.parameters < size and m not in same
                          and catalog.shared_fraction(directory, m.directory) >= MIN_SHARED), key=lambda m: m.parameters)
        how = f"sharing at least {MIN_SHARED:.0%} of its token strings (it drafts those)"
    if not smaller:
        why = (f"{len(same)} with its tokenizer, none smaller" if same
               else f"none of the {len(others)} other installed models has its tokenizer or nearly all of its tokens")
        notice(f"{label}no draft for {Path(target).name} (tokenizer {mine}, {_count(size)} weights): {why}")
        return None
    pick = smaller[0]
    notice(f"{label}{Path(pick.name).name} ({_count(pick.parameters)} weights) drafts for {Path(target).name} "
           f"({_count(size)}): the smallest of {len(smaller)} installed models {how}")
    return pick.name


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


@dataclass(frozen=True)
class Method:
    """What a method needs and uses. ``build(gen, config, capacity)`` makes its proposer (a fresh
    one per engine: proposers hold per-row state); None for plain decoding."""

    summary: str
    build: Builder | None
    needs_head: bool = False  # the target's draft head drafts (or backs the hybrid)
    needs_draft: bool = False  # a draft model drafts
    uses_lookup: bool = False  # the n-gram sizes (--ngram-min/--ngram-max) apply
    uses_exit_layer: bool = False  # the early exit's depth (--exit-layer) applies
    trees: bool = False  # drafts candidate trees: k is the node budget


def copy_lookup(gen: Sources, ngram: tuple[int, int]) -> SuffixProposer:
    """The chain hybrids' lookup side: the suffix proposer drafting chains, matching ``ngram``'s
    lengths. Besides the n-gram lookup's latest match, it follows the copy a row is making and
    drafts replacements it has seen (renames), and sees earlier outputs (the shared history):
    measured against n-gram lookup in the head hybrid, 2.59x against 2.22x on the editing
    prompts, and equal or better on the six categories (docs/CHANGELOG.md, 'hybrids' lookup')."""
    return SuffixProposer(min_match=ngram[0], max_match=ngram[1], history=gen.suffix_history, tree_mode="chains")


def _draft(gen, config, capacity):
    """The draft model: drafting target tokens (with their q) when it shares the target's
    tokenizer or nearly all of its tokens (their intersection, :mod:`specdec.text.vocab`), else
    drafting text that the target's tokenizer turns into deterministic drafts."""
    if gen.draft_text:
        return TextDraftProposer(gen.draft.model, gen.draft.tokenizer, gen.target.tokenizer, capacity)
    view = gen.draft_model()
    return DraftModelProposer(view.model, capacity, vocab_ids=view.ids,
                              vocab_size=None if view.ids is None else view.vocab_size, vocab_map=view.vocab)


def _early_exit(gen, config, capacity):
    layers = config.exit_layer or max(1, gen.target.model.cfg.num_layers // EXIT_FRACTION)
    return DraftModelProposer(gen.target.model.truncated(layers), capacity)


def _head(gen, config, capacity):
    return HeadProposer(gen.draft_head(), capacity, min_score=HEAD_MIN_SCORE if config.k == "auto" else 0.0)


def _head_tree(gen, config, capacity):
    return HeadTreeProposer(gen.draft_head(), capacity)


def _hybrid(gen, config, capacity):
    side = METHODS[config.model_side]
    return HybridProposer(copy_lookup(gen, config.ngram), side.build(gen, config, capacity))


def _hybrid_head(gen, config, capacity):
    return HybridProposer(copy_lookup(gen, config.ngram), _head(gen, config, capacity))


def _hybrid_tree(gen, config, capacity):
    return HybridProposer(SuffixProposer(history=gen.suffix_history), _head_tree(gen, config, capacity))


METHODS: dict[str, Method] = {
    "head": Method("the target's draft head", _head, needs_head=True),
    "draft": Method("the draft model (its text, where its tokenizer is another)", _draft, needs_draft=True),
    "ngram": Method("n-gram prompt lookup", lambda gen, c, cap: NgramProposer(*c.ngram), uses_lookup=True),
    "early-exit": Method("the target's first layers", _early_exit, uses_exit_layer=True),
    # The hybrid's model side is resolved from what is loaded (SpeculationConfig.model_side).
    "hybrid": Method("lookup where the text repeats, else a model", _hybrid, uses_lookup=True),
    "hybrid-head": Method("lookup where the text repeats, else the draft head", _hybrid_head, needs_head=True,
                          uses_lookup=True),
    "suffix": Method("suffix lookup trees (copies of the text and earlier outputs)",
                     lambda gen, c, cap: SuffixProposer(history=gen.suffix_history), trees=True),
    "head-tree": Method("the draft head's dynamic trees", _head_tree, needs_head=True, trees=True),
    "hybrid-tree": Method("suffix trees where the text repeats, else head trees", _hybrid_tree, needs_head=True,
                          trees=True),
    "none": Method("plain decoding", None),
}


@dataclass(frozen=True)
class SpeculationConfig:
    """A resolved, validated choice of how to speculate. Build it with :meth:`resolve` (or
    :meth:`plain`); ``method`` is a :data:`METHODS` key, "none" for plain decoding."""

    method: str = "none"
    k: int | str = 0  # draft tokens per step (trees: nodes), or "auto"; 0 with "none"
    k_max: int = K_MAX  # the largest k "auto" may choose
    ngram: tuple[int, int] = NGRAM
    exit_layer: int | None = None  # None: EXIT_FRACTION of the layers
    model_side: str | None = None  # a hybrid's model side: "draft", "head" or "early-exit"
    requested: str | None = None  # what the caller asked for (None: the default), for describe()

    @classmethod
    def resolve(cls, method: str | None = None, *, draft: bool, head: bool, k: int | str | None = None,
                k_max: int | None = None, ngram: tuple[int | None, int | None] | None = None,
                exit_layer: int | None = None) -> "SpeculationConfig":
        """The config for ``method`` (None: the default for what is loaded) given whether a draft
        model (``draft``) and a draft head (``head``) are available; None for an option means its
        default. Raises ValueError naming the parameter for a choice that cannot run."""
        if method is not None and method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        name = method if method is not None else (DEFAULT_METHOD if draft or head else LOOKUP_ONLY)
        if k == 0 and method is None:
            name = "none"  # k = 0: no speculation
        spec = METHODS[name]
        if spec.needs_draft and not draft:
            raise ValueError(f"method {name!r} needs a draft model (--draft NAME_OR_PATH; draft= in the API)")
        if spec.needs_head and not head:
            raise ValueError(f"method {name!r} needs a draft head: this target has none shipped; train one "
                             "with `specdec train-head` and pass its file (--head PATH; head= in the API)")
        lo, hi = ngram if ngram is not None else (None, None)
        lo, hi = lo if lo is not None else NGRAM[0], hi if hi is not None else NGRAM[1]
        if not 1 <= lo <= hi:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max (--ngram-min, --ngram-max), got ({lo}, {hi})")
        k_max = K_MAX if k_max is None else k_max
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        k = 0 if name == "none" else check_k(K_DEFAULT if k is None else k)
        if exit_layer is not None and exit_layer < 1:
            raise ValueError(f"exit_layer must be >= 1, got {exit_layer}")
        side = ("draft" if draft else "head" if head else "early-exit") if name == "hybrid" else None
        return cls(name if k != 0 else "none", k, k_max, (lo, hi), exit_layer, side, method)

    @classmethod
    def plain(cls) -> "SpeculationConfig":
        return cls(requested="none")

    @property
    def speculates(self) -> bool:
        return self.method != "none"

    @property
    def uses_head(self) -> bool:
        return METHODS[self.method].needs_head or self.model_side == "head"

    @property
    def uses_draft(self) -> bool:
        return METHODS[self.method].needs_draft or self.model_side == "draft"

    @property
    def uses_lookup(self) -> bool:
        return METHODS[self.method].uses_lookup

    @property
    def uses_exit_layer(self) -> bool:
        return METHODS[self.method].uses_exit_layer or self.model_side == "early-exit"

    @property
    def trees(self) -> bool:
        return METHODS[self.method].trees

    def build(self, gen: Sources, capacity: int):
        """A fresh proposer for an engine of ``capacity`` slots per row (None: plain decoding)."""
        build = METHODS[self.method].build
        return build(gen, self, capacity) if build is not None else None

    def with_k(self, k: int | str) -> "SpeculationConfig":
        """The same method at another k (k = 0: plain decoding)."""
        if k == 0:
            return replace(self, method="none", k=0, model_side=None)
        return replace(self, k=k)

    def describe(self) -> str:
        """One line for stderr: which method runs, and why (the caller's choice or the default)."""
        if not self.speculates:
            return "plain decoding (--proposer none)" if self.requested == "none" else "plain decoding"
        side = f" (lookup, else the {self.model_side})" if self.model_side else ""
        if self.requested is not None:
            return f"proposer {self.method}{side} (as asked)"
        if self.model_side == "draft":
            return "proposer hybrid: lookup where the text repeats, else the draft model (the default with a draft model)"
        if self.model_side == "head":
            return "proposer hybrid: lookup where the text repeats, else the target's draft head (the default)"
        return (f"no draft head for this target: proposer {LOOKUP_ONLY} (lookup only, nearly free); "
                "`specdec train-head` makes a head, --proposer none decodes plainly")
