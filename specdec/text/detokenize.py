"""Streaming text: decode a growing token sequence a few tokens at a time, and find stop strings.

Re-decoding every generated id at every step costs O(n) per token and O(n^2) per answer; the
classes here keep per-row state so each step decodes only a short window of recent tokens and
searches for stop strings only in the text that is new.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Text of one growing token sequence.

    Two offsets into the ids: text before ``_prefix`` is settled; ``ids[_prefix:_read]`` is the
    last chunk already turned into text. Decoding ``ids[_prefix:]`` and removing the text of
    ``ids[_prefix:_read]`` gives the new text, with the last chunk as left context, so tokenizers
    that drop a word's leading space at the start of a decode (SentencePiece) still produce it.
    New text that ends in an incomplete UTF-8 sequence (U+FFFD) is held back until a later token
    completes it. (The same two-offset scheme as Hugging Face TGI and vLLM.)
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self._length = 0  # how many ids the last call saw
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: list[int]) -> str:
        """``ids``: the whole sequence so far, an extension of the previous call's. Returns the
        text it adds (possibly empty) and appends it to ``self.text``."""
        if len(ids) < self._length:
            raise ValueError(f"the token sequence shrank from {self._length} to {len(ids)} ids")
        if len(ids) == self._length:
            return ""
        self._length = len(ids)
        prefix_text = self._decode(ids[self._prefix : self._read])
        new_text = self._decode(ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(ids)
        self.text += delta
        return delta


class StopFinder:
    """Where the first stop string occurs in a growing text, searching only near the new part."""

    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self.stop), default=0)
        self._searched = 0  # text[:_searched] holds no complete stop string
        self.position: int | None = None  # index in the text where the first stop string starts

    def feed(self, text: str) -> int | None:
        """``text``: the whole text so far (it extends the previous call's). Returns where the
        first stop string starts, or None."""
        if self.position is None and self.stop:
            start = max(0, self._searched - self._longest + 1)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.position = min(hits)
            self._searched = len(text)
        return self.position

    def safe_length(self, text: str) -> int:
        """How much of ``text`` can be shown: up to the stop string if one was found, else all but
        a tail that might be the start of a stop string still to be completed."""
        if self.position is not None:
            return self.position
        for n in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return len(text) - n
        return len(text)
