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
:class:`~specdec.core.adaptive.TreeBudget` calibrates those frequencies against measured acceptance.
Candidates are deterministic (``probs=None``): the tree verifier treats them exactly at any
temperature.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

from specdec.proposers.base import Proposal, TreeMode
from specdec.proposers.ngram import NgramIndex
from specdec.verify.sampling import SamplingMetadata

SEPARATOR = -1  # between documents of a shared index: no n-gram across it can match a context
SCAN = 4  # occurrences looked at per continuation wanted (SuffixIndex.continuations)


class SuffixIndex(NgramIndex):
    """A token history with every n-gram (n = 1..max_match) mapped to the positions it ends at
    (``SEPARATOR`` between documents)."""

    def __init__(self, max_match: int) -> None:
        super().__init__(1, max_match)
        self.max_match = max_match

    def continuations(self, suffix: tuple[int, ...], depth: int, limit: int, before: int | None = None) -> list[list[int]]:
        """What followed the latest ``limit`` occurrences of ``suffix`` ending before position
        ``before`` (default: anywhere), up to ``depth`` tokens each (cut at a separator). At most
        ``SCAN * limit`` occurrences are looked at: in a shared history of many short outputs, a
        suffix that mostly ends documents (nothing follows it) would otherwise cost a scan of
        every occurrence at every step."""
        out = []
        ends = self.ends.get(suffix, ())
        if before is not None:
            ends = ends[: bisect.bisect_left(ends, before)]
        for end in reversed(ends[-SCAN * limit:]):
            cont = self.tokens[end + 1 : end + 1 + depth]
            if SEPARATOR in cont:
                cont = cont[: cont.index(SEPARATOR)]
            if cont:
                out.append(cont)
                if len(out) == limit:
                    break
        return out


def build_tree(continuations: list[list[int]], budget: int, weights: list[float] | None = None,
               states: list[list] | None = None, total: float | None = None) -> tuple[list[int], list[int], list[float], list]:
    """Merge ``continuations`` into a trie and keep its ``budget`` heaviest nodes.

    A node's weight is the summed ``weights`` (default 1 each) of the continuations through it;
    its score = weight / ``total`` (default: the summed weights), the empirical probability that
    the text goes that way.
    Returns (tokens, parents, scores, node states) breadth first, siblings heaviest first (ties:
    the earlier continuation), so that scores never increase from a parent to its child or from a
    sibling to the next (what :meth:`~specdec.proposers.base.Proposal.prune` needs). ``states``
    (one per token of each continuation) ride along: the state of a node is that of the first
    continuation that created it.
    """
    weights = [1.0] * len(continuations) if weights is None else weights
    token, parent, weight, state = [], [], [], []
    child: dict[tuple[int, int], int] = {}
    for c, (cont, w) in enumerate(zip(continuations, weights)):
        node = -1
        for j, tok in enumerate(cont):
            key = (node, tok)
            if key not in child:
                child[key] = len(token)
                token.append(tok)
                parent.append(node)
                weight.append(0.0)
                state.append(states[c][j] if states is not None else None)
            node = child[key]
            weight[node] += w
    keep = set(sorted(range(len(token)), key=lambda i: (-weight[i], i))[:budget])
    kids: dict[int, list[int]] = {}
    for i in sorted(keep):
        kids.setdefault(parent[i], []).append(i)
    order, level = [], [-1]
    while level:
        level = [c for p in level for c in sorted(kids.get(p, []), key=lambda i: (-weight[i], i))]
        order += level
    new = {old: i for i, old in enumerate(order)}
    total = max(sum(weights) if total is None else total, 1e-9)
    return ([token[i] for i in order], [new.get(parent[i], -1) for i in order],
            [weight[i] / total for i in order], [state[i] for i in order])


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


# How much each kind of candidate weighs in a row's tree (scores are weight shares; the engine's
# TreeBudget calibrates them against measured acceptance per depth): the copy the row is
# following, the same copy without learned replacements (when one applies), the re-entry points
# after the copy broke off (source position skipped ahead by s), and the longest-suffix lookup.
COPY_WEIGHT = 1.0
RAW_WEIGHT = 0.25
RESYNC = ((1, 0.35), (0, 0.15), (2, 0.15), (3, 0.1))  # (s, weight)
LOOKUP_WEIGHT = 1.0
PATIENCE = 1  # calls after a break during which re-entry points are offered
MAX_RULES = 16
RAW = -1  # node states' mark for the copy without replacements (not a re-entry point)


class Cursor(NamedTuple):
    """Where a row's copy continues."""

    pos: int  # the position in the row's text the copy continues at
    pending: tuple[int, ...]  # replacement tokens still to come before it
    rule: tuple[int, ...] | None  # the replacement's key (the source tokens it replaces), if any


class NodeState(NamedTuple):
    """A drafted node's state: the cursor after its token, and how its branch entered the tree."""

    cursor: Cursor
    entry: int | None  # RAW: the copy without replacements; s >= 0: a re-entry point s tokens past a break




class CopyRow:
    """One row's text and where it is copying from.

    Edits, renames and summaries copy long stretches of their input, break off for a few new
    tokens, and pick the copy up again further on. Besides the suffix index, a row tracks:

    - ``cursor`` = (position in ``index.tokens`` the copy continues at, replacement tokens still
      to come before it, the replacement's key): set whenever the committed tokens followed a
      drafted copy; the next draft is that copy, which beats a frequency vote among the context's
      occurrences (the latest or most frequent occurrence is often not the one being copied);
    - ``anchor``: where the copy broke off; for ``PATIENCE`` calls the tree also offers the
      source from ``anchor + s`` (the new text replaced s source tokens: s = 1 a renamed
      identifier, 0 an insertion);
    - ``rules``: when a re-entry branch is accepted, the replaced source tokens X and the new
      tokens Y become a rule, and later copies of the prompt draft Y where the source has X (a
      rename is then predicted at its next occurrence). A rule that fails is dropped.
    """

    def __init__(self, prompt: list[int], max_match: int) -> None:
        self.index = SuffixIndex(max_match)
        self.index.extend(prompt)
        self.prompt_len = len(prompt)
        self.cursor: Cursor | None = None
        self.anchor: int | None = None
        self.diverged: list[int] = []
        self.waited = 0
        self.rules: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.last: tuple[list[int], list[int], list] = ([], [], [])  # the last tree and its nodes' states

    def copy(self, pos: int, pending: tuple[int, ...], depth: int, rules: bool, rule=None) -> tuple[list[int], list, bool]:
        """Up to ``depth`` tokens of the copy at ``pos`` (after ``pending``), with each token's
        state (the cursor after it); whether a rule was applied."""
        text, tokens, states, applied = self.index.tokens, [], [], False
        end = len(text) - 1  # (the last token is the context itself)
        while len(tokens) < depth:
            if pending:
                tokens.append(pending[0])
                pending = pending[1:]
                states.append(Cursor(pos, pending, rule if pending else None))
                continue
            if pos >= end or text[pos] == SEPARATOR:
                break
            if rules and pos < self.prompt_len:
                hit = next((x for x in self.rules if tuple(text[pos:pos + len(x)]) == x), None)
                if hit is not None:
                    pos, pending, rule, applied = pos + len(hit), self.rules[hit], hit, True
                    continue
            tokens.append(text[pos])
            pos += 1
            states.append(Cursor(pos, (), None))
        return tokens, states, applied

    def agreement(self, pos: int, cap: int = 64) -> int:
        """How many tokens before ``pos`` the context agrees with (the copy's run so far)."""
        text, run = self.index.tokens, 0
        while run < cap and run < pos and text[pos - 1 - run] == text[len(text) - 1 - run] and pos - 1 - run != len(text) - 1 - run:
            run += 1
        return run

    def feed(self, ids: list[int]) -> None:
        """The committed tokens: follow them through the last tree, then along the copy; after a
        break, watch for the text coming back to the source."""
        tokens, parents, states = self.last
        self.last = ([], [], [])
        node, matched = -1, 0
        for t in ids:
            nxt = next((i for i in range(len(tokens)) if parents[i] == node and tokens[i] == t), None)
            if nxt is None:
                break
            node, matched = nxt, matched + 1
            if states[node] is not None and states[node].entry == RAW:  # the source stayed where a rule applied
                pos = states[node].cursor.pos - 1
                for x in [x for x in self.rules if tuple(self.index.tokens[pos:pos + len(x)]) == x]:
                    del self.rules[x]
        anchor, diverged = self.anchor, self.diverged
        if node >= 0:
            state = states[node]
            if state is not None and state.entry is not None and state.entry >= 0 and anchor is not None:
                self._learn(anchor, state.entry, diverged)  # a re-entry branch was accepted
            cursor = state.cursor if state is not None else None
        else:
            cursor = self.cursor
        copying = cursor is not None
        for i, t in enumerate(ids[matched:] if copying else ()):
            pos, pending, rule = cursor
            expected = pending[0] if pending else (self.index.tokens[pos] if pos < len(self.index.tokens) else None)
            if t != expected:
                if rule is not None:  # the replacement was wrong here: forget it
                    self.rules.pop(rule, None)
                    pos = pos - len(rule)
                self.anchor, self.diverged, self.waited, cursor = pos, list(ids[matched + i:]), 0, None
                break
            cursor = Cursor(pos, pending[1:], rule if len(pending) > 1 else None) if pending else Cursor(pos + 1, (), None)
        if cursor is None and anchor is not None:
            cursor = self._reenter(anchor, diverged + list(ids))
        if cursor is not None:
            self.anchor, self.diverged = None, []
        elif not copying and self.anchor is not None:
            self.diverged += ids
            self.waited += 1
            if self.waited > PATIENCE or len(self.diverged) > 16:
                self.anchor, self.diverged = None, []
        self.cursor = cursor
        self.index.extend(ids)

    def _reenter(self, anchor: int, seq: list[int]):
        """If the tokens since the break (``seq``) end with the source ``s`` tokens past the
        break (the re-entry points the tree offers), learn the replacement and return the cursor
        after them. One token of agreement is enough right at the break or one past it, two
        further on."""
        text = self.index.tokens
        for skip, _ in RESYNC:
            source = text[anchor + skip: min(anchor + skip + 8, len(text))]
            for j in range(min(len(seq) - (skip == 0), len(source)), (1 if skip <= 1 else 2) - 1, -1):
                if seq[len(seq) - j:] == source[:j] and SEPARATOR not in source[:j]:
                    self._learn(anchor, skip, seq[: len(seq) - j])
                    return Cursor(anchor + skip + j, (), None)
        return None

    def _learn(self, anchor: int, skip: int, new: list[int]) -> None:
        """The copy broke off at ``anchor`` for the tokens ``new`` and came back ``skip`` source
        tokens further on: a rule source[anchor:anchor+skip] -> new."""
        text, a = self.index.tokens, anchor
        x, y = tuple(text[a:a + skip]), tuple(new)
        if not x and a >= 1:  # an insertion: keyed by the token before it
            x, y = (text[a - 1],), (text[a - 1],) + y
        if x and y and x != y and a + skip <= self.prompt_len and len(x) <= 8 and len(y) <= 16 and SEPARATOR not in x:
            self.rules.pop(x, None)
            self.rules[x] = y
            while len(self.rules) > MAX_RULES:
                self.rules.pop(next(iter(self.rules)))


class SuffixProposer:
    """Candidate trees from the context's own repetitions (and a shared history of earlier outputs),
    led by the copy each row is following (:class:`CopyRow`, each row's state).

    When the engine asks for a chain (every row samples, or its ShapeRace wants one: see
    :func:`~specdec.proposers.base.tree_shape`) it proposes each tree's best path. ``tree_mode``:
    "trees" (the default) or "chains" (the hybrids' lookup side)."""

    wants_target_hidden = False

    def __init__(self, min_match: int = 2, max_match: int = 8, max_occurrences: int = 32,
                 history: SuffixHistory | None = None, tree_mode: TreeMode = "trees") -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        if max_occurrences < 1:
            raise ValueError("max_occurrences must be >= 1")
        self.min_match, self.max_match, self.max_occurrences = min_match, max_match, max_occurrences
        self.history = SuffixHistory(max_match) if history is None else history
        self.tree_mode = tree_mode

    def add(self, prompts: list[list[int]], target_hidden: torch.Tensor | None = None) -> list[CopyRow]:
        return [CopyRow(prompt, self.max_match) for prompt in prompts]

    def feed(self, states: list[CopyRow], pending: list[list[int]]) -> str:
        """Index the committed ids of each row."""
        for row, ids in zip(states, pending):
            if ids:
                row.feed(ids)
        return "default"

    def _lookup(self, row: CopyRow, depth: int) -> tuple[list[list[int]], list[float], list[list]]:
        """The longest suffix of the context (``min_match``..``max_match`` tokens) that occurred
        before: what followed its latest ``max_occurrences`` occurrences (in the row, then in the
        shared history), equally weighted, so that a node's weight share is its frequency.
        (Ranking the occurrences by their distance to the copy's position instead measured no
        better on edits and summaries.)"""
        text = row.index.tokens
        for n in range(min(self.max_match, len(text)), self.min_match - 1, -1):
            suffix = tuple(text[len(text) - n:])
            conts, states = [], []
            for end in reversed(row.index.ends.get(suffix, ())):
                if len(conts) == self.max_occurrences:
                    break
                if end < len(text) - 1:
                    tokens, st, _ = row.copy(end + 1, (), depth, rules=False)
                    if tokens:
                        conts.append(tokens)
                        states.append([NodeState(x, None) for x in st])
            if len(conts) < self.max_occurrences:
                more = self.history.index.continuations(suffix, depth, self.max_occurrences - len(conts))
                conts += more
                states += [[None] * len(c) for c in more]
            if conts:
                return conts, [LOOKUP_WEIGHT / len(conts)] * len(conts), states
        return [], [], []

    def _row_tree(self, row: CopyRow, budget: int, resync: bool = True) -> tuple[list[int], list[int], list[float], list]:
        conts, weights, states, masses = [], [], [], []

        def chain(tokens, st, mass, run, skip=None):
            # P(the text follows the copy d more tokens) = (run+1)/(run+1+d) (Laplace's rule of
            # succession, per token, after `run` tokens that did): the chain enters as its
            # truncations, each weighted by the chance the text leaves the copy right there.
            st = [NodeState(x, skip) for x in st]
            masses.append(mass)  # (the part of it that leaves the copy at once is no node's)
            reach = [(run + 1) / (run + 1 + d) for d in range(len(tokens) + 1)] + [0.0]
            for d in range(1, len(tokens) + 1):
                w = mass * (reach[d] - (reach[d + 1] if d < len(tokens) else 0.0))
                if w > 0:
                    conts.append(tokens[:d]), weights.append(w), states.append(st[:d])

        if row.cursor is not None:
            pos, pending, rule = row.cursor
            run = row.agreement(pos)
            tokens, st, applied = row.copy(pos, pending, budget, rules=True, rule=rule)
            chain(tokens, st, COPY_WEIGHT, run)
            if applied:
                tokens, st, _ = row.copy(pos, pending, budget, rules=False, rule=rule)
                chain(tokens, st, RAW_WEIGHT, run, RAW)
            lookup_mass = 1.0 / (run + 2)
        else:
            if resync and row.anchor is not None:
                for skip, weight in RESYNC:
                    tokens, st, _ = row.copy(row.anchor + skip, (), budget, rules=True)
                    chain(tokens, st, weight, 0, skip)
            lookup_mass = LOOKUP_WEIGHT
        found = self._lookup(row, budget)
        conts, states = conts + found[0], states + found[2]
        weights += [lookup_mass * w for w in found[1]]
        if not conts:
            return [], [], [], []
        return build_tree(conts, budget, weights, states, total=sum(masses) + (lookup_mass if found[0] else 0.0))

    def lookup(self, states: list[CopyRow], k: int, tree: bool = True) -> Proposal:
        """A tree of at most ``k`` nodes per row from the current histories (``feed`` first); a
        chain of at most ``k`` tokens (each tree's best path) without ``tree``."""
        trees = [self._row_tree(row, k) if k > 0 else ([], [], [], []) for row in states]
        for row, (tokens, parents, _, nodes) in zip(states, trees):
            row.last = (tokens, parents, nodes)
        if not tree:
            paths = [best_path(*t[:3]) for t in trees]
            width = max((len(path) for path in paths), default=0)
            # a row without a match repeats its last token (as the n-gram proposer does): a guess
            padded = [path + [(path or row.index.tokens)[-1]] * (width - len(path)) for path, row in zip(paths, states)]
            return Proposal(torch.tensor(padded, dtype=torch.long).view(len(states), width), None)
        width = max((len(t[0]) for t in trees), default=0)
        batch = len(states)
        tokens = torch.full((batch, width), -1, dtype=torch.long)
        parents = torch.full((batch, width), -1, dtype=torch.long)
        scores = torch.zeros(batch, width)
        for b, (tok, par, score, _) in enumerate(trees):
            tokens[b, : len(tok)] = torch.tensor(tok, dtype=torch.long)
            parents[b, : len(par)] = torch.tensor(par, dtype=torch.long)
            scores[b, : len(score)] = torch.tensor(score)
        return Proposal(tokens, None, parents=parents, scores=scores)

    def propose(self, states: list[CopyRow], k: int, tree: bool, sampling: SamplingMetadata) -> Proposal:
        return self.lookup(states, k, tree)  # (deterministic candidates: the rows' sampling does not matter)

    def has_match(self, states: list[CopyRow], k: int = 1) -> list[bool]:
        """Whether each row has a copy or a lookup match now (re-entry guesses alone do not
        count); used by the hybrid proposer."""
        return [bool(self._row_tree(row, 1, resync=False)[0]) for row in states]

    def observe(self, states: list[CopyRow], num_accepted: torch.Tensor,
                target_hidden: torch.Tensor | None = None) -> None:
        pass  # the committed tokens arrive with the next ``feed``

    def retain(self, rows: list[int], left: list[CopyRow]) -> None:
        for row in left:  # a finished row: its output joins the shared history
            self.history.add(row.index.tokens[row.prompt_len:])
