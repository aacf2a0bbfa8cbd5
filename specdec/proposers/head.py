"""Drafting with a trained head (EAGLE-style; the head itself: :mod:`specdec.runtime.head`).

Drafting k tokens: the committed pairs are fed in one forward (slots ``0..t``); the first draft is
sampled from the last slot's output; each next slot feeds ``(f, draft)`` — the head's own guess in
place of the target's feature, which training teaches it to read. After verification the head's
cache is cut back to the committed pairs, and the target's features of the accepted tokens
(returned by the verification forward at no extra cost) replace the guesses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.proposers.base import Proposal, draft_token, no_drafts
from specdec.runtime.head import DraftHead
from specdec.runtime.kv_cache import KVCache
from specdec.verify.sampling import SamplingMetadata, probs_per_row


@dataclass
class HeadRow:
    """One row's state: the target features not yet fed to the head ``[n, E]``, and the
    committed tokens that follow them (the token after the last feature arrives with the next
    pending list)."""

    feats: torch.Tensor
    tokens: list[int] = field(default_factory=list)


class HeadProposer:
    """Drafts k tokens per row with a :class:`DraftHead`; returns the processed ``q`` each was
    sampled from (the rows' own temperature / top-k / top-p / min-p, zero outside the subset).

    ``min_score`` > 0 cuts the chain short (EAGLE-2's observation: the head's confidence tracks
    acceptance). Before drafting position i, each row's score is multiplied by the top
    probability of the head's raw distribution there (:meth:`_confidence`), the product over
    positions 1..i being the head's estimate that the chain is still accepted at i; once no
    row's score reaches ``min_score`` the chain ends (a chain is as long in every row, so it goes
    on while any row's is worth it). Zero drafts is a plain step.
    Exact at every temperature: whether position i is drafted is decided from the drafts before
    it and the distribution position i's is drawn from, never from that draft itself, so each
    drafted token still follows the ``q`` it is verified with (tests/test_verify_stats.py: the
    stopping rule and its negative control, a rule that reads the drawn token).
    """

    wants_target_hidden = True
    tree_mode = "chains"

    def __init__(self, head: DraftHead, capacity: int, min_score: float = 0.0) -> None:
        if not 0 <= min_score <= 1:
            raise ValueError(f"min_score must be in [0, 1], got {min_score}")
        self.head, self.capacity, self.min_score = head, capacity, min_score
        self.cache: KVCache | None = None
        self._committed = torch.zeros(0, dtype=torch.long)  # [B] slots of true (feature, token) pairs

    def add(self, prompts: list[list[int]], target_hidden: torch.Tensor | None = None) -> list[HeadRow]:
        """New rows, with ``target_hidden`` ``[N, L, E]`` the target's features of their prompts
        (from prefill). The pairs (feature t, token t+1) of each prompt are fed now, in one head
        call over just those rows; the last feature waits for the first generated token."""
        if target_hidden is None:
            raise ValueError("the draft head needs the target's prefill features (target_hidden)")
        if self.cache is None:
            self.cache = self.head.new_cache(0, self.capacity)
        start = self.cache.batch
        rows = self.cache.append_rows(len(prompts))
        counts = torch.tensor([len(p) - 1 for p in prompts])  # pairs complete now
        width = int(counts.max())
        if width > 0:
            tokens = torch.tensor([p[1:] + [0] * (width - len(p) + 1) for p in prompts])  # [N, W]
            self.head(target_hidden[:, :width], tokens, rows, logit_index=(counts.clamp(min=1) - 1).unsqueeze(1))
            rows.truncate(counts)
        self.cache.set_lengths(start, rows.lengths)
        self._committed = torch.cat([self._committed, rows.lengths])
        return [HeadRow(target_hidden[b, len(p) - 1 : len(p)]) for b, p in enumerate(prompts)]

    def feed(self, states: list[HeadRow], pending: list[list[int]]) -> str:
        """Queue the committed ids; each pairs with a queued target feature at the next head call."""
        for row, ids in zip(states, pending):
            row.tokens = row.tokens + ids
        return "default"

    def propose(self, states: list[HeadRow], k: int, tree: bool, sampling: SamplingMetadata) -> Proposal:
        batch = len(states)
        if k == 0:
            return no_drafts(batch)
        caught_up = self._catching_up(states)
        logits, guess = self._catch_up(states)
        drafts, probs = [], []
        score = torch.ones(batch)  # [B] product of the head's top probabilities along each chain
        declined = False
        for i in range(k):
            if self.min_score > 0:
                score = score * self._confidence(logits[:, -1])
                if float(score.max()) < self.min_score:
                    declined = True  # no row's chain is likely enough to reach this position
                    break
            token, q = draft_token(logits[:, -1], sampling, self.head.vocab_ids, self.head.cfg.target_vocab_size,
                                   "draft head")
            drafts.append(token)  # [B, 1]
            if q is not None:
                probs.append(q)  # [B, V]
            if i < k - 1:
                logits, guess = self.head(guess, token, self.cache)
        tokens = torch.cat(drafts, 1) if drafts else torch.zeros(batch, 0, dtype=torch.long)  # [B, k'] k' <= k
        return Proposal(tokens, torch.stack(probs, 1) if probs else None, caught_up=caught_up, declined=declined)

    def _confidence(self, subset_logits: torch.Tensor) -> torch.Tensor:
        """``[B, N]`` subset logits -> the top probability of the head's raw distribution ``[B]``.
        Raw for every row: on the bench's answers at T = 0.7, first drafts whose processed
        distribution's top probability was 0.5-0.6 were accepted 0.22 of the time, those whose
        raw one's was 0.41 (measured by a script since removed: docs/CHANGELOG.md, 'chains cut by the head's confidence').
        No finiteness check here (the drafting loop): a NaN score never cuts, and
        :func:`~specdec.proposers.base.draft_token` refuses non-finite logits of sampled rows."""
        return torch.softmax(subset_logits.float(), -1).amax(-1)

    def _rank_probs(self, subset_logits: torch.Tensor, sampling: SamplingMetadata) -> torch.Tensor:
        """``[B, ..., N]`` subset logits -> the head's probabilities as each row's sampling
        parameters process them (the raw distribution for greedy rows, whose processed one is
        one-hot): what tree candidates are ranked by."""
        if not torch.isfinite(subset_logits).all():
            raise ValueError("the draft head produced non-finite logits")
        return probs_per_row(subset_logits, sampling.ranking())

    @staticmethod
    def _catching_up(states: list[HeadRow]) -> bool:
        """Whether the next head call feeds more than the usual 1-2 pairs a row (tokens skipped
        while k was 0, or while the other side of a hybrid drafted)."""
        return max(len(row.tokens) for row in states) > 2

    def _catch_up(self, states: list[HeadRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the queued (target feature, next token) pairs of every row in one head call;
        returns the subset logits at each row's last pair ``[B, 1, N]`` and the head's guess of
        the next feature ``[B, 1, E]`` (what drafting continues from)."""
        batch = len(states)
        counts = torch.tensor([len(row.tokens) for row in states])  # == len(feats) per row
        width = int(counts.max())
        first = states[0].feats
        feats = torch.zeros(batch, width, first.shape[-1], dtype=first.dtype)  # [B, W, E]
        for b, row in enumerate(states):
            feats[b, : row.feats.shape[0]] = row.feats
        tokens = torch.tensor([row.tokens + [0] * (width - len(row.tokens)) for row in states])
        before = self.cache.lengths.clone()
        logits, guesses = self.head(feats, tokens, self.cache, logit_index=(counts - 1).unsqueeze(1))
        self.cache.truncate(before + counts)
        self._committed = before + counts
        guess = guesses.gather(1, (counts - 1).view(-1, 1, 1).expand(-1, 1, guesses.shape[-1]))  # [B, 1, E]
        for row in states:
            row.feats, row.tokens = row.feats[:0], []
        return logits, guess

    def observe(self, states: list[HeadRow], num_accepted: torch.Tensor,
                target_hidden: torch.Tensor | None = None) -> None:
        """Drop the drafted slots; queue the target's features of the fed token and the accepted
        drafts (``target_hidden`` ``[B, k+1, E]`` from the verification forward)."""
        if target_hidden is None:
            raise ValueError("the draft head needs the target's features of each verified block")
        self.cache.truncate(self._committed)
        for b, (row, a) in enumerate(zip(states, num_accepted.tolist())):
            row.feats = torch.cat([row.feats, target_hidden[b, : a + 1]])

    def retain(self, rows: list[int], left: list[HeadRow]) -> None:
        self.cache.retain(rows)
        self._committed = self._committed[rows]


class HeadTreeProposer(HeadProposer):
    """Candidate trees from the draft head (EAGLE-2 style dynamic trees), deterministic candidates.

    Depth by depth, the ``width`` best nodes so far (score = product of the head's probabilities
    along the path) are expanded in ONE head call (tree attention over the head's own cache: each
    node sees the committed pairs and its ancestors), each offering its ``width`` most probable
    children. After ``depth`` levels (at most the node budget ``k``), or earlier once no node of
    the newest level scores ``min_score`` (drafting costs a head call per level, and such nodes
    rarely pay for their verification on this CPU), the ``k`` best-scoring nodes form the tree. Scores rank by the head's distribution processed with the row's own sampling
    parameters (the raw distribution for greedy rows, whose processed one is one-hot).

    The candidates are a deterministic function of the committed text, so they are verified as
    such (``probs=None``; :func:`specdec.verify_tree` removes each rejected candidate from the
    target's distribution): exact at every temperature, whatever the head's quality.

    It drafts :class:`HeadProposer`'s chain instead (sampled drafts, or the argmax for greedy
    rows) while every row samples (measured faster at T > 0) or when the engine asks for chains
    (its :class:`~specdec.core.adaptive.ShapeRace` measures both): the engine decides, by
    :func:`~specdec.proposers.base.tree_shape`.
    """

    tree_mode = "trees"

    def __init__(self, head: DraftHead, capacity: int, width: int = 4, depth: int = 5, min_score: float = 0.2) -> None:
        if width < 1 or depth < 1 or not 0 <= min_score <= 1:
            raise ValueError(f"need width >= 1, depth >= 1 and 0 <= min_score <= 1, got {width}, {depth}, {min_score}")
        super().__init__(head, capacity + width * depth)  # the expanded nodes' slots while drafting (chains uncut)
        self.width, self.depth, self.tree_min_score = width, depth, min_score

    def propose(self, states: list[HeadRow], k: int, tree: bool, sampling: SamplingMetadata) -> Proposal:
        if not tree:
            return super().propose(states, k, tree, sampling)
        batch = len(states)
        if k == 0:
            return no_drafts(batch, tree=True)
        caught_up = self._catching_up(states)
        logits, guess = self._catch_up(states)  # [B, 1, N], [B, 1, E]
        width = min(self.width, k)
        probs, ids = self._rank_probs(logits, sampling).topk(width, dim=-1)  # [B, 1, W]
        tokens, scores = self.head.vocab_ids[ids[:, 0]], probs[:, 0]  # [B, M] nodes so far (M = W)
        parents = torch.full((batch, width), -1, dtype=torch.long)
        base = self.cache.lengths.clone()  # the committed pairs; the expanded nodes go after them
        fed: list[torch.Tensor] = []  # per level: the expanded nodes [B, W], in feeding order
        guesses = guess.new_zeros(batch, 0, guess.shape[-1])  # [B, F, E] the head's guess after each fed node
        level_start = 0
        for level in range(1, min(self.depth, k)):
            if float(scores[:, level_start:].max()) < self.tree_min_score:
                break  # no row has a node worth a deeper level
            # expand the `width` best nodes of the newest level, each offering its `width` best children
            frontier = level_start + scores[:, level_start:].topk(width, dim=1).indices.sort(dim=1).values  # [B, W]
            if level == 1:
                feat = guess.expand(-1, width, -1)  # children of the root continue from its guess
            else:  # a node continues from the guess after its parent (fed one level up)
                parent_slot = (width * (level - 2)) + _position_in(fed[-1], parents.gather(1, frontier))
                feat = guesses.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, guesses.shape[-1]))
            logits, out = self.head(feat, tokens.gather(1, frontier), self.cache,
                                    tree_mask=self._mask(parents, fed, frontier),
                                    positions=(base + level - 1).unsqueeze(1).expand(-1, width), tree_base=base)
            fed.append(frontier)
            guesses = torch.cat([guesses, out], 1)
            probs, ids = self._rank_probs(logits, sampling).topk(width, dim=-1)  # [B, W, W]
            level_start = tokens.shape[1]
            tokens = torch.cat([tokens, self.head.vocab_ids[ids].flatten(1)], 1)
            parents = torch.cat([parents, frontier.repeat_interleave(width, dim=1)], 1)
            scores = torch.cat([scores, (scores.gather(1, frontier).unsqueeze(-1) * probs).flatten(1)], 1)
        self.cache.truncate(self._committed)
        return Proposal(tokens, None, parents=parents, scores=scores, caught_up=caught_up).prune(k)

    @staticmethod
    def _mask(parents: torch.Tensor, fed: list[torch.Tensor], frontier: torch.Tensor) -> torch.Tensor:
        """``[B, W, F + W]``: which fed nodes (in feeding order) and which new ones each frontier
        node sees — its ancestors and itself."""
        batch, width = frontier.shape
        order = torch.cat(fed + [frontier], 1)  # [B, F + W] node index of each slot
        seen = torch.zeros(batch, width, order.shape[1], dtype=torch.bool)
        node = frontier.clone()
        while True:
            seen |= order.unsqueeze(1) == node.unsqueeze(2)
            node = torch.where(node >= 0, parents.gather(1, node.clamp(min=0)), -1)
            if bool((node < 0).all()):
                return seen


def _position_in(order: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` where each of ``nodes`` ``[B, n]`` stands in ``order`` ``[B, W]``."""
    return (order.unsqueeze(1) == nodes.unsqueeze(2)).long().argmax(-1)
