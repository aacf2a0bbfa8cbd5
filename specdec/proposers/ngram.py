"""Prompt lookup / n-gram proposer: copy what followed the latest earlier occurrence of the
context's last n tokens (in the prompt or the generated text). Deterministic and nearly free.

The tokens are proposed with a one-hot ``q`` (``probs=None``), which the verifier treats exactly.
Rows without a match propose nothing; in a batch, the step uses the longest proposal and pads
shorter rows by repeating their last token (any deterministic padding is exact: it is simply a
proposal that will probably be rejected).
"""

from __future__ import annotations

import torch

from specdec.proposers.base import Proposal
from specdec.verify.sampling import SamplingMetadata


class NgramIndex:
    """Token history of one row with an index from each n-gram (n_min..n_max) to the positions
    where it ends, maintained incrementally."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, ids: list[int]) -> None:
        """Append ``ids``; a ``-1`` separates documents (no n-gram across it is indexed)."""
        for token in ids:
            self.tokens.append(token)
            end = len(self.tokens) - 1
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                gram = tuple(self.tokens[end + 1 - n :])
                if -1 in gram:
                    break  # longer grams contain the separator too
                self.ends.setdefault(gram, []).append(end)

    def lookup(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the longest suffix."""
        last = len(self.tokens) - 1
        for n in range(self.n_max, self.n_min - 1, -1):
            if last + 1 < n:
                continue
            ends = self.ends.get(tuple(self.tokens[last + 1 - n :]), [])
            # the latest occurrence other than the suffix itself
            for end in reversed(ends):
                if end < last:
                    return self.tokens[end + 1 : end + 1 + k]
        return []


class NgramProposer:
    """Each row's state is its :class:`NgramIndex`."""

    wants_target_hidden = False
    tree_mode = "chains"

    def __init__(self, n_min: int = 2, n_max: int = 4) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max

    def add(self, prompts: list[list[int]], target_hidden: torch.Tensor | None = None) -> list[NgramIndex]:
        indexes = [NgramIndex(self.n_min, self.n_max) for _ in prompts]
        for index, prompt in zip(indexes, prompts):
            index.extend(prompt)
        return indexes

    def feed(self, states: list[NgramIndex], pending: list[list[int]]) -> str:
        """Add newly committed tokens to each row's history."""
        for index, ids in zip(states, pending):
            index.extend(ids)
        return "default"

    def propose(self, states: list[NgramIndex], k: int, tree: bool, sampling: SamplingMetadata) -> Proposal:
        return self.lookup(states, k)  # (deterministic drafts: the rows' sampling does not matter)

    def lookup(self, states: list[NgramIndex], k: int, tree: bool = False) -> Proposal:
        """The proposal from the current histories (``feed`` first)."""
        found = [index.lookup(k) if k > 0 else [] for index in states]
        width = max((len(f) for f in found), default=0)
        padded = [f + [(f or index.tokens)[-1]] * (width - len(f)) for f, index in zip(found, states)]
        tokens = torch.tensor(padded, dtype=torch.long).view(len(states), width)
        return Proposal(tokens, None)

    def has_match(self, states: list[NgramIndex], k: int = 1) -> list[bool]:
        """Whether each row would propose something now (used by the hybrid proposer)."""
        return [bool(index.lookup(k)) for index in states]

    def observe(self, states: list[NgramIndex], num_accepted: torch.Tensor,
                target_hidden: torch.Tensor | None = None) -> None:
        pass  # the committed tokens arrive with the next ``feed``

    def retain(self, rows: list[int], left: list[NgramIndex]) -> None:
        pass  # nothing batched
