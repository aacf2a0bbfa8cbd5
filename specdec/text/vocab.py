"""A draft whose vocabulary differs from the target's in a few tokens: the map between the two.

Token-level intersection (Timor et al., ICML 2025): the draft drafts only the tokens whose string
is in both vocabularies, each as the target's id of that string. Its q is then supported on
those ids (zero elsewhere), and the verifier's acceptance/residual rule is exact for any q, so the
committed tokens follow the target's law (tests/test_vocab_intersection.py). The draft reads the
committed target tokens through the same map; a target token outside the intersection (another
special token, an id the tokenizer does not define) reaches it as the first token of the draft
tokenizer's encoding of that token's text, or as the draft's token 0 where that text encodes to
nothing: one draft token for each target token, so the draft's context is as long as the
target's (its KV capacity is counted in target tokens). Only the draft's context depends on
that, never the output.

A fine-tune with other special tokens (DeepSeek-R1-Distill-Qwen-7B: 152,064 ids) and the base
family's small model (Qwen2.5-0.5B: 151,936) share all but a handful of strings. Tokenizers that
share less than :data:`MIN_SHARED` of the target's strings are another tokenization altogether:
such a draft drafts text instead (:mod:`specdec.proposers.text_draft`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# The fraction of the target tokenizer's strings that the draft's must also hold for the draft to
# draft target tokens through the intersection (below it: text drafts). The family fine-tunes this
# is for share more than 99.9%; unrelated BPE vocabularies share far less.
MIN_SHARED = 0.99


@dataclass
class VocabMap:
    """The shared strings of a target and a draft tokenizer: ``target_ids`` (sorted) and the
    draft's id of each (``draft_ids``); ``target_size`` and ``draft_size`` are the models'
    vocabulary sizes (rows of their output layers, at least the tokenizers' lengths)."""

    target_ids: torch.Tensor  # [N] sorted
    draft_ids: torch.Tensor  # [N]
    target_size: int
    draft_size: int
    shared: float  # the fraction of the target tokenizer's strings in the draft's
    _table: torch.Tensor = field(repr=False)  # [target_size] the draft id of each target id, -1 outside
    _target_tok: object = field(repr=False)
    _draft_tok: object = field(repr=False)
    _outside: dict[int, int] = field(default_factory=dict, repr=False)  # memo: the draft id of an outside id

    @classmethod
    def build(cls, target_tok, draft_tok, target_size: int, draft_size: int) -> "VocabMap":
        """The map between two Hugging Face tokenizers (matched by token string, added tokens
        included) for models of ``target_size`` and ``draft_size`` ids."""
        target, draft = target_tok.get_vocab(), draft_tok.get_vocab()
        pairs = sorted((i, draft[s]) for s, i in target.items() if s in draft and i < target_size and draft[s] < draft_size)
        target_ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
        draft_ids = torch.tensor([d for _, d in pairs], dtype=torch.long)
        table = torch.full((target_size,), -1, dtype=torch.long)
        table[target_ids] = draft_ids
        return cls(target_ids, draft_ids, target_size, draft_size, len(pairs) / max(1, len(target)), table,
                   target_tok, draft_tok)

    @property
    def usable(self) -> bool:
        """Whether the draft can draft target tokens through this map (else it drafts text)."""
        return self.shared >= MIN_SHARED

    def draft_rows(self, target_ids: torch.Tensor) -> torch.Tensor:
        """The draft's ids of shared ``target_ids`` (its output rows for them)."""
        rows = self._table[target_ids]
        if bool((rows < 0).any()):
            raise ValueError("draft_rows: some ids are outside the intersection")
        return rows

    def to_draft(self, ids: list[int]) -> list[int]:
        """Committed target ids as the draft reads them, one for one: each shared one as its
        draft id, each other one as the first token of the draft's encoding of its text (token 0
        where that is empty)."""
        ids_t = torch.tensor(ids, dtype=torch.long)  # [n]
        inside = (ids_t >= 0) & (ids_t < self.target_size)
        mapped = torch.full_like(ids_t, -1)
        mapped[inside] = self._table[ids_t[inside]]  # one lookup for all (this runs every step's feed)
        return [d if d >= 0 else self._outside_id(i) for i, d in zip(ids, mapped.tolist())]

    def draft_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Drafted target ids ``[B, 1]`` (always shared ones) as the draft's ids."""
        return self._table[tokens]

    def _outside_id(self, i: int) -> int:
        if i not in self._outside:
            text = self._target_tok.decode([i]) if 0 <= i < len(self._target_tok) else ""
            ids = [d for d in (self._draft_tok.encode(text, add_special_tokens=False) if text else []) if d < self.draft_size]
            self._outside[i] = ids[0] if ids else 0
        return self._outside[i]
