"""A smaller language model as the proposer; it owns its KV cache and rolls it back itself."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.core.prefill import STEP_TOKENS
from specdec.proposers.base import Proposal, draft_token, no_drafts
from specdec.runtime.model import Transformer
from specdec.text.vocab import VocabMap
from specdec.verify.sampling import SamplingMetadata


@dataclass
class DraftRow:
    """One row's state: committed ids not yet fed to the draft model, and how many accepted
    drafts (already in the cache) the next pending list starts with."""

    unfed: list[int] = field(default_factory=list)
    skip: int = 0


class DraftModelProposer:
    """Samples k tokens autoregressively from the draft with the rows' own sampling parameters,
    so the returned ``probs`` are exactly the processed ``q`` each token was drawn from."""

    wants_target_hidden = False
    tree_mode = "chains"

    def __init__(self, model: Transformer, capacity: int, vocab_ids: torch.Tensor | None = None,
                 vocab_size: int | None = None, vocab_map: VocabMap | None = None) -> None:
        """``vocab_ids``: the model computes logits only for these (target) ids (its output layer
        built with :meth:`Transformer.with_output_rows`); the others get q = 0 and are never
        drafted (exact: the verifier handles zeros in q). ``vocab_size``: the target's full
        vocabulary then. ``vocab_map``: the draft numbers tokens otherwise than the target
        (:mod:`specdec.text.vocab`); what it reads goes through the map, and ``vocab_ids`` are
        shared ids."""
        if (vocab_ids is None) != (vocab_size is None) or (vocab_map is not None and vocab_ids is None):
            raise ValueError("vocab_ids and vocab_size go together, and a vocab_map needs both")
        self.model = model
        self.capacity = capacity
        self.vocab_ids, self.vocab_size, self.vocab_map = vocab_ids, vocab_size, vocab_map
        self.cache = None
        self._fed_drafts = 0  # draft tokens of the last proposal that were written into the cache

    def add(self, prompts: list[list[int]], target_hidden: torch.Tensor | None = None) -> list[DraftRow]:
        """New rows: their prompts are prefilled now, over just those rows, in chunks of
        :data:`~specdec.core.prefill.STEP_TOKENS` positions (bit-identical to one call, as the
        target's chunked prefill; a 3,950-token prompt through a 1B draft in one call held
        ~0.5 GB of intermediates)."""
        if self.cache is None:
            self.cache = self.model.new_cache(0, self.capacity)
        prompts = [self._draft_ids(p) for p in prompts]
        start = self.cache.batch
        rows = self.cache.append_rows(len(prompts))
        counts = torch.tensor([len(p) for p in prompts])
        width = int(counts.max())
        padded = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
        first = torch.zeros(len(prompts), 1, dtype=torch.long)  # (the logits come with the first token)
        for at in range(0, width, STEP_TOKENS):
            self.model(padded[:, at : at + STEP_TOKENS], rows, logit_index=first)
        rows.truncate(counts)  # (the padding past a shorter prompt is dropped)
        self.cache.set_lengths(start, rows.lengths)
        return [DraftRow() for _ in prompts]

    def feed(self, states: list[DraftRow], pending: list[list[int]]) -> str:
        """Queue the committed ids, less the accepted drafts already in the cache; they are fed
        with the next proposal's forward (steps with k = 0, or the other side of a hybrid
        drafting, queue more)."""
        for row, new in zip(states, pending):
            row.unfed += self._draft_ids(new[row.skip:])
            row.skip = 0
        self._fed_drafts = 0
        return "default"

    def propose(self, states: list[DraftRow], k: int, tree: bool, sampling: SamplingMetadata) -> Proposal:
        if k == 0:  # no drafts this step (adaptive k turned speculation off): run nothing
            return no_drafts(len(states))
        logits, caught_up = self._feed_unfed(states)  # [B, V] (or [B, N] over vocab_ids)
        tokens, probs = [], []
        for i in range(k):
            token, q = draft_token(logits, sampling, self.vocab_ids, self.vocab_size, "draft model")
            tokens.append(token)  # [B, 1]
            if q is not None:
                probs.append(q)  # [B, V]
            if i < k - 1:
                fed = token if self.vocab_map is None else self.vocab_map.draft_tokens(token)  # [B, 1] draft ids
                logits = self.model(fed, self.cache)[:, -1]
        self._fed_drafts = k - 1
        return Proposal(torch.cat(tokens, 1), torch.stack(probs, 1) if probs else None, caught_up=caught_up)

    def _draft_ids(self, ids: list[int]) -> list[int]:
        """Committed target ids as the draft reads them."""
        return ids if self.vocab_map is None else self.vocab_map.to_draft(ids)

    def _feed_unfed(self, states: list[DraftRow]) -> tuple[torch.Tensor, bool]:
        """Feed each row's queued committed ids in one forward: the next draft's logits, and
        whether this caught up on more than the usual 1-2 new tokens (then this step's time says
        little about the cost of a draft token, see AdaptiveK.observe)."""
        feed = [row.unfed for row in states]
        for row in states:
            row.unfed = []
        counts = torch.tensor([len(f) for f in feed])
        return self._feed(feed, counts), int(counts.max()) > 2

    def _feed(self, feed: list[list[int]], counts: torch.Tensor) -> torch.Tensor:
        width = int(counts.max())
        before = self.cache.lengths.clone()
        padded = torch.tensor([f + [0] * (width - len(f)) for f in feed])
        logits = self.model(padded, self.cache, logit_index=(counts - 1).unsqueeze(1))[:, 0]
        self.cache.truncate(before + counts)
        return logits

    def retain(self, rows: list[int], left: list[DraftRow]) -> None:
        self.cache.retain(rows)

    def observe(self, states: list[DraftRow], num_accepted: torch.Tensor,
                target_hidden: torch.Tensor | None = None) -> None:
        # The cache holds the fed pending tokens plus drafts d_1..d_{k-1}. Keep the accepted ones
        # and skip them in the next pending list; an accepted d_k (never fed) is fed next time,
        # together with the bonus token.
        fed = self._fed_drafts
        keep = torch.clamp(num_accepted, max=fed)
        self.cache.truncate(self.cache.lengths - fed + keep)
        for row, skip in zip(states, keep.tolist()):
            row.skip = skip
