"""Suffix proposer (SuffixDecoding style): several frequent continuations of the context, as a tree.

Each row keeps an index from every n-gram (n = 1..``max_match``) of its text — the prompt and
everything committed since — to the positions where it ends; this answers the suffix-tree query
the proposer needs ("where did the longest suffix of the context occur before?") in O(max_match)
per step and O(max_match) per appended token. A :class:`SuffixHistory` of earlier finished
outputs (of this proposer's earlier rows, and of earlier calls or other requests when it is
shared, as :class:`~specdec.api.TextGenerator` shares one) is consulted too.

At each step the longest suffix of the context (up to ``max_match`` tokens, at least
``min_match``) that occurred before is looked up; the continuations that followed its latest
``max_occurrences`` occurrences (up to the node budget in depth) are merged into a trie. A node's
score is the fraction of occurrences that continue through it — the empirical probability that
the text goes that way — so the tree holds the most frequent continuations, and
:class:`~specdec.adaptive.TreeBudget` calibrates those frequencies against measured acceptance.
Candidates are deterministic (``probs=None``): the tree verifier treats them exactly at any
temperature.
"""

from __future__ import annotations

import torch

from specdec.proposers.base import Proposal, SingleSource, tree_shape
from specdec.proposers.ngram import NgramIndex
from specdec.sampling import SamplingParams

SEPARATOR = -1  # between documents of a shared index: no n-gram across it can match a context


class SuffixIndex(NgramIndex):
    """A token history with every n-gram (n = 1..max_match) mapped to the positions it ends at
    (``SEPARATOR`` between documents)."""

    def __init__(self, max_match: int) -> None:
        super().__init__(1, max_match)
        self.max_match = max_match

    def continuations(self, suffix: tuple[int, ...], depth: int, limit: int, before: int | None = None) -> list[list[int]]:
        """What followed the latest ``limit`` occurrences of ``suffix`` ending before position
        ``before`` (default: anywhere), up to ``depth`` tokens each (cut at a separator)."""
        out = []
        for end in reversed(self.ends.get(suffix, ())):
            if before is not None and end >= before:
                continue
            cont = self.tokens[end + 1 : end + 1 + depth]
            if SEPARATOR in cont:
                cont = cont[: cont.index(SEPARATOR)]
            if cont:
                out.append(cont)
                if len(out) == limit:
                    break
        return out


def build_tree(continuations: list[list[int]], budget: int) -> tuple[list[int], list[int], list[float]]:
    """Merge ``continuations`` into a trie and keep its ``budget`` most frequent nodes.

    Returns (tokens, parents, scores) in creation order (a parent before its children); score =
    occurrences through the node / all occurrences. Children never score above their parent, so
    the kept nodes form a tree (ties keep the earlier node).
    """
    tokens: list[int] = []
    parents: list[int] = []
    counts: list[int] = []
    child: dict[tuple[int, int], int] = {}
    for cont in continuations:
        node = -1
        for token in cont:
            key = (node, token)
            if key not in child:
                child[key] = len(tokens)
                tokens.append(token)
                parents.append(node)
                counts.append(0)
            node = child[key]
            counts[node] += 1
    total = max(len(continuations), 1)
    keep = sorted(sorted(range(len(tokens)), key=lambda i: (-counts[i], i))[:budget])
    new = {old: i for i, old in enumerate(keep)}
    return ([tokens[i] for i in keep], [new.get(parents[i], -1) for i in keep], [counts[i] / total for i in keep])


def best_path(tokens: list[int], parents: list[int], scores: list[float]) -> list[int]:
    """The tree's most frequent continuation: from the root, the best-scoring child each time
    (the earlier one on ties)."""
    path, node = [], -1
    while True:
        children = [i for i, p in enumerate(parents) if p == node]
        if not children:
            return path
        node = max(children, key=lambda i: (scores[i], -i))
        path.append(tokens[node])


class SuffixHistory:
    """Finished outputs (of earlier rows, calls or requests) in one bounded suffix index, shared by
    suffix proposers. At most ``max_tokens`` tokens: past that the older half is dropped."""

    def __init__(self, max_match: int = 8, max_tokens: int = 200_000) -> None:
        if max_match < 1 or max_tokens < 0:
            raise ValueError("max_match must be >= 1 and max_tokens >= 0")
        self.max_tokens = max_tokens
        self.index = SuffixIndex(max_match)

    def add(self, output: list[int]) -> None:
        if not output or self.max_tokens == 0:
            return
        output = output[-(self.max_tokens // 2):]
        if len(self.index.tokens) + len(output) + 1 > self.max_tokens:  # keep the newer half
            recent = self.index.tokens[len(self.index.tokens) // 2:]
            self.index = SuffixIndex(self.index.max_match)
            self.index.extend(recent)
        self.index.extend([SEPARATOR] + output)


class SuffixProposer(SingleSource):
    """Candidate trees from the context's own repetitions (and a shared history of earlier outputs).

    While every row samples (:func:`~specdec.proposers.base.all_sample`), or when the engine asks
    for chains (``use_trees``), it proposes each tree's most frequent path as a chain;
    ``always_trees``: trees whatever the rows and the engine ask (tests)."""

    wants_target_hidden = False

    def __init__(self, min_match: int = 2, max_match: int = 8, max_occurrences: int = 32,
                 history: SuffixHistory | None = None, always_trees: bool = False) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        if max_occurrences < 1:
            raise ValueError("max_occurrences must be >= 1")
        self.min_match, self.max_match, self.max_occurrences = min_match, max_match, max_occurrences
        self.history = SuffixHistory(max_match) if history is None else history
        self.always_trees = always_trees
        self.trees_wanted = True
        self.rows: list[SuffixIndex] = []
        self.params: list[SamplingParams] = []
        self._prompt_lengths: list[int] = []

    @property
    def emits_trees(self) -> bool:
        return tree_shape(self.trees_wanted, self.always_trees, self.params)

    def use_trees(self, on: bool) -> None:
        self.trees_wanted = on

    def add(self, prompts: list[list[int]], params: list[SamplingParams], generator: torch.Generator,
            target_hidden: torch.Tensor | None = None) -> None:
        self.params = self.params + list(params)
        self._prompt_lengths += [len(p) for p in prompts]
        for prompt in prompts:
            index = SuffixIndex(self.max_match)
            index.extend(prompt)
            self.rows.append(index)

    def feed(self, pending: list[list[int]]) -> None:
        for index, ids in zip(self.rows, pending):
            index.extend(ids)

    def _row_tree(self, index: SuffixIndex, budget: int) -> tuple[list[int], list[int], list[float]]:
        text = index.tokens
        for n in range(min(self.max_match, len(text)), self.min_match - 1, -1):
            suffix = tuple(text[len(text) - n:])
            conts = index.continuations(suffix, budget, self.max_occurrences, before=len(text) - 1)
            if len(conts) < self.max_occurrences:
                conts += self.history.index.continuations(suffix, budget, self.max_occurrences - len(conts))
            if conts:
                return build_tree(conts, budget)
        return [], [], []

    def lookup(self, k: int) -> Proposal:
        """A tree of at most ``k`` nodes per row from the current histories (``feed`` first); a
        chain of at most ``k`` tokens when :attr:`emits_trees` is off."""
        trees = [self._row_tree(index, k) if k > 0 else ([], [], []) for index in self.rows]
        if not self.emits_trees:
            paths = [best_path(*tree) for tree in trees]
            width = max((len(path) for path in paths), default=0)
            # a row without a match repeats its last token (as the n-gram proposer does): a guess
            padded = [path + [(path or index.tokens)[-1]] * (width - len(path)) for path, index in zip(paths, self.rows)]
            return Proposal(torch.tensor(padded, dtype=torch.long).view(len(self.rows), width), None)
        width = max((len(t[0]) for t in trees), default=0)
        batch = len(self.rows)
        tokens = torch.full((batch, width), -1, dtype=torch.long)
        parents = torch.full((batch, width), -1, dtype=torch.long)
        scores = torch.zeros(batch, width)
        for b, (tok, par, score) in enumerate(trees):
            tokens[b, : len(tok)] = torch.tensor(tok, dtype=torch.long)
            parents[b, : len(par)] = torch.tensor(par, dtype=torch.long)
            scores[b, : len(score)] = torch.tensor(score)
        return Proposal(tokens, None, parents=parents, scores=scores)

    def propose(self, pending: list[list[int]], k: int) -> Proposal:
        self.feed(pending)
        return self.lookup(k)

    def has_match(self, k: int = 1) -> list[bool]:
        """Whether each row would propose something now (used by the hybrid proposer)."""
        return [bool(self._row_tree(index, 1)[0]) for index in self.rows]

    def observe(self, num_accepted: torch.Tensor, target_hidden: torch.Tensor | None = None) -> None:
        pass  # the committed tokens arrive as the next call's ``pending``

    def retain(self, rows: list[int]) -> None:
        kept = set(rows)
        for i, index in enumerate(self.rows):
            if i not in kept:  # a finished row: its output joins the shared history
                self.history.add(index.tokens[self._prompt_lengths[i]:])
        self.rows = [self.rows[i] for i in rows]
        self.params = [self.params[i] for i in rows]
        self._prompt_lengths = [self._prompt_lengths[i] for i in rows]
