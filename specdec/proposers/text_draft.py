"""A draft model with another tokenizer: it drafts text, which becomes the target's tokens.

Each step, per row: the committed target tokens are decoded to text and encoded with the draft's
tokenizer; the draft's KV cache keeps its longest common prefix with that encoding and is fed the
rest (so the draft follows what the target committed, whatever the two tokenizations); the draft
then writes a few tokens greedily. Their text is appended to the last committed target tokens'
text and encoded with the target's tokenizer: where the committed tokens come back unchanged, the
tokens after them are the drafts, less the last one (more text could still extend it: only a
boundary that stays stable as more text arrives is drafted).

The drafts are deterministic (one-hot q): the verifier accepts a draft y with probability p(y)
and otherwise samples the residual p without y, renormalised, so the committed tokens follow the
target's law exactly and greedy output is plain greedy (tests/test_text_draft.py). A row whose
text does not round-trip (a partial UTF-8 character, a tokenizer that normalises) gets no drafts
that step: its k positions repeat its last token, which the verifier rejects like any wrong draft.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specdec.proposers.base import Proposal, no_drafts
from specdec.runtime import elementwise
from specdec.runtime.model import Transformer
from specdec.verify.sampling import SamplingMetadata

TAIL = 8  # committed target tokens re-encoded with the drafted text (the boundary must reproduce them)
EXTRA = 2  # draft tokens beyond k: tokenizations differ, and the last target token is dropped
MEMO = 4096  # text conversions remembered (rows often share a context)


@dataclass
class TextRow:
    """One row's state: its committed target tokens, and the draft tokens its cache row holds."""

    target_ids: list[int]
    draft_ids: list[int] = field(default_factory=list)


class TextDraftProposer:
    """Drafts k target tokens per row from ``model``, whose tokenizer is ``draft_tokenizer``;
    ``target_tokenizer`` turns its text back into target tokens. Both tokenizers are Hugging Face
    tokenizers (``encode``/``decode``)."""

    wants_target_hidden = False
    tree_mode = "chains"

    def __init__(self, model: Transformer, draft_tokenizer, target_tokenizer, capacity: int) -> None:
        self.model, self.dtok, self.ttok = model, draft_tokenizer, target_tokenizer
        self.capacity = 2 * capacity + 64  # the draft's tokenizer may need more tokens for the same text
        self.cache = None
        self._memo: OrderedDict = OrderedDict()

    def add(self, prompts: list[list[int]], target_hidden: torch.Tensor | None = None) -> list[TextRow]:
        """New rows: nothing is run now; the first proposal feeds their text."""
        if self.cache is None:
            self.cache = self.model.new_cache(0, self.capacity)
        self.cache.append_rows(len(prompts))
        return [TextRow(list(p)) for p in prompts]

    def feed(self, states: list[TextRow], pending: list[list[int]]) -> str:
        for row, new in zip(states, pending):
            row.target_ids.extend(new)
        return "default"

    def propose(self, states: list[TextRow], k: int, tree: bool, sampling: SamplingMetadata) -> Proposal:
        """(Deterministic drafts: the rows' sampling does not matter.)"""
        if k == 0:
            return no_drafts(len(states))
        wanted = [self._convert("draft", tuple(row.target_ids)) for row in states]  # [B] draft tokens of the text
        logits = self._sync(states, wanted)  # [B, V_draft]: after each row's last draft token
        drafted = self._draft(states, logits, k + EXTRA)  # [B] lists of draft tokens
        tokens = [self._target_drafts(row, w, d, k) for row, w, d in zip(states, wanted, drafted)]
        return Proposal(torch.tensor(tokens, dtype=torch.long), None)

    def _convert(self, kind: str, key: tuple):
        """Memoised text conversions: ``("draft", target ids)`` -> the draft's encoding of their
        text; ``("target", (tail ids, draft text))`` -> the target's encoding of tail text + draft text."""
        hit = self._memo.get((kind, key))
        if hit is not None:
            self._memo.move_to_end((kind, key))
            return hit
        if kind == "draft":
            text = self.ttok.decode(list(key), skip_special_tokens=True, clean_up_tokenization_spaces=False)
            out = self.dtok.encode(text, add_special_tokens=False) or [self._draft_start()]
        else:
            tail, text = key
            prefix = self.ttok.decode(list(tail), clean_up_tokenization_spaces=False)
            out = self.ttok.encode(prefix + text, add_special_tokens=False)
        self._memo[(kind, key)] = out
        if len(self._memo) > MEMO:
            self._memo.popitem(last=False)
        return out

    def _draft_start(self) -> int:
        """A token to start an empty draft context from (its BOS, else EOS, else 0)."""
        for token in (self.dtok.bos_token_id, self.dtok.eos_token_id):
            if token is not None:
                return token
        return 0

    def _sync(self, states: list[TextRow], wanted: list[list[int]]) -> torch.Tensor:
        """Roll each row's cache back to its common prefix with ``wanted`` (at least one token
        short of it, so every row feeds one) and feed the rest; the logits after the last."""
        feed, keep = [], []
        for row, want in zip(states, wanted):
            have = row.draft_ids
            common = 0
            limit = min(len(have), len(want) - 1)
            while common < limit and have[common] == want[common]:
                common += 1
            keep.append(common)
            feed.append(want[common:])
            row.draft_ids = list(want)
        if max(len(w) for w in wanted) + EXTRA + 8 > self.capacity:
            raise ValueError(f"the text draft's context ({max(len(w) for w in wanted)} tokens) outgrew its cache")
        self.cache.truncate(torch.tensor(keep))
        counts = torch.tensor([len(f) for f in feed])
        width = int(counts.max())
        padded = torch.tensor([f + [0] * (width - len(f)) for f in feed])
        logits = self.model(padded, self.cache, logit_index=(counts - 1).unsqueeze(1))[:, 0]
        self.cache.truncate(torch.tensor(keep) + counts)
        return logits

    def _draft(self, states: list[TextRow], logits: torch.Tensor, steps: int) -> list[list[int]]:
        """``steps`` greedy draft tokens per row (fed to the cache, all but the last)."""
        out = []
        for i in range(steps):
            token = elementwise.argmax(logits).unsqueeze(1)  # [B, 1]
            out.append(token)
            if i < steps - 1:
                logits = self.model(token, self.cache)[:, -1]
        tokens = torch.cat(out, 1).tolist()  # [B, steps]
        for row, drafted in zip(states, tokens):
            row.draft_ids += drafted[:-1]
        return tokens

    def _target_drafts(self, row: TextRow, wanted: list[int], drafted: list[int], k: int) -> list[int]:
        """Up to ``k`` target tokens for the text ``drafted`` adds, padded with the last token."""
        base = self.dtok.decode(wanted, clean_up_tokenization_spaces=False)
        full = self.dtok.decode(wanted + drafted, clean_up_tokenization_spaces=False)
        ids = row.target_ids
        out: list[int] = []
        if full.startswith(base) and "\ufffd" not in full[len(base) - 1 if base else 0 :]:
            tail = tuple(ids[-TAIL:])
            encoded = self._convert("target", (tail, full[len(base):]))
            if tuple(encoded[: len(tail)]) == tail:
                out = list(encoded[len(tail) : -1])[:k]  # the last one may still grow
        return out + [ids[-1]] * (k - len(out))

    def observe(self, states: list[TextRow], num_accepted: torch.Tensor,
                target_hidden: torch.Tensor | None = None) -> None:
        """Nothing: the next proposal re-syncs the draft from the committed tokens."""

    def retain(self, rows: list[int], left: list[TextRow]) -> None:
        self.cache.retain(rows)
