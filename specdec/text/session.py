"""Text over the engine: the one owner of detokenization, stop strings and streaming.

The engine speaks token ids only. A :class:`Session` wraps one engine and one tokenizer:

- :meth:`Session.add` queues a request with its stop strings;
- :meth:`Session.publish` turns the rows an engine step changed into :class:`TextUpdate` s: a
  stop string ends its row where it begins (later tokens of the same verification block are
  dropped, as if the row had stopped at that token), and text is released only up to where a
  stop string may still begin;
- :meth:`Session.run` is the batch loop of the API (``TextGenerator.generate``); the server's
  worker thread is a session plus a queue (:mod:`specdec.server.scheduler`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specdec.text.detokenize import IncrementalDetokenizer, StopFinder
from specdec.core.engine import Engine, steps
from specdec.core.rows import Request, RowState
from specdec.core.metrics import GenerationMetrics


class TextStream:
    """One answer's text as its tokens arrive: decoded a few tokens at a time, searched for stop
    strings, and released only up to where a stop string may still begin."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.finder = StopFinder(stop)
        self.emitted = 0  # characters already released

    def stop_at(self, ids: list[int]) -> bool:
        """``ids``: the whole answer so far (one more token than the last call, or more). Whether
        a stop string has appeared in their text."""
        self.detok.update(ids)
        return self.finder.feed(self.detok.text) is not None

    def release(self) -> str:
        """The text safe to show that has not been shown yet."""
        text = self.detok.text
        end = self.finder.safe_length(text)
        if end <= self.emitted:
            return ""
        out, self.emitted = text[self.emitted : end], end
        return out

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the whole answer, cut at its stop string) not yet shown."""
        out = final_text[self.emitted :] if len(final_text) > self.emitted else ""
        self.emitted = max(self.emitted, len(final_text))
        return out


@dataclass
class TextResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: GenerationMetrics  # this request's own
    batch_metrics: GenerationMetrics | None  # the whole batch, with the time breakdown by phase
    prompt_tokens: int = 0
    error: str | None = None  # why the request failed (finish_reason "error")


@dataclass(eq=False)  # compared by identity
class TextRow:
    """One request's text state beside its engine row."""

    row: RowState
    stream: TextStream
    stop: list[str]
    seen: int = 0  # ids already checked for stop strings


@dataclass
class TextUpdate:
    """What one engine step changed for one request."""

    row: TextRow
    text: str  # new text, safe to show (a finished row: all that was held back)
    new_tokens: int  # ids committed since the previous update (after any stop cut)
    done: bool


def cut_at_stop(text: str, stop: list[str]) -> str:
    """``text`` up to where its first stop string begins."""
    cut = min((text.find(s) for s in stop if s and s in text), default=-1)
    return text if cut < 0 else text[:cut]


class Session:
    """One engine's requests as text (see the module docstring)."""

    def __init__(self, engine: Engine, tokenizer) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self._rows: dict[int, TextRow] = {}  # id(engine row) -> its text state, while running

    @property
    def busy(self) -> bool:
        return self.engine.busy

    def add(self, request: Request, stop: list[str] | None = None) -> TextRow:
        """Queue ``request`` (ValueError naming the parameter if the engine cannot run it)."""
        stop = [s for s in (stop or []) if s]
        row = TextRow(self.engine.add(request), TextStream(self.tokenizer, stop), stop)
        self._rows[id(row.row)] = row
        return row

    def cancel(self, row: TextRow, reason: str = "cancelled") -> None:
        """End ``row`` now; it publishes nothing more."""
        self.engine.cancel(row.row, reason)
        self._rows.pop(id(row.row), None)

    def step(self) -> list[TextUpdate]:
        """One engine step, published."""
        return self.publish(self.engine.step())

    def publish(self, changed: list[RowState]) -> list[TextUpdate]:
        """The text updates of the rows one engine step changed (rows cancelled meanwhile are
        skipped): stop strings first, then the text that is safe to show."""
        updates = []
        for row in changed:
            text_row = self._rows.get(id(row))
            if text_row is None:
                continue
            self._check_stop(text_row)
            ids = row.token_ids
            new, text_row.seen = len(ids) - text_row.seen, len(ids)
            text = text_row.stream.release()
            if row.done:
                del self._rows[id(row)]
                if row.finish_reason != "error":
                    text += text_row.stream.finish(self.final_text(text_row))
            updates.append(TextUpdate(text_row, text, new, row.done))
        return updates

    def _check_stop(self, text_row: TextRow) -> None:
        """The first of this step's new ids at which a stop string appears ends the row there,
        also when the step's block reached max_new_tokens or EOS after it. (An EOS id is not
        checked: it ends the row itself.)"""
        row, stream = text_row.row, text_row.stream
        ids = row.token_ids
        if not text_row.stop:
            stream.detok.update(ids)
            return
        last = len(ids) - (row.finish_reason == "eos")
        for end in range(text_row.seen + 1, last + 1):
            if stream.stop_at(ids[:end]):
                self.engine.cancel(row, "stop", keep=end)
                return

    def final_text(self, text_row: TextRow) -> str:
        """A finished answer's whole text, cut where its first stop string begins (one full
        decode: the streamed increments add up to it)."""
        text = self.tokenizer.decode(text_row.row.token_ids, skip_special_tokens=True)
        return cut_at_stop(text, text_row.stop)

    def result(self, text_row: TextRow) -> TextResult:
        res = text_row.row.result
        return TextResult(self.final_text(text_row), res.token_ids, res.finish_reason, res.metrics,
                          res.batch_metrics, len(text_row.row.request.prompt), res.error)

    def run(self, requests: list[Request], stop: list[str] | None = None,
            on_text: Callable[[int, str], None] | None = None) -> list[TextResult]:
        """Run ``requests`` to the end, all joining at once; ``on_text(i, text)`` sees request
        i's text as it becomes safe to show (the pieces add up to its final text)."""
        rows = [self.add(r, stop) for r in requests]
        index = {id(r): i for i, r in enumerate(rows)}
        for changed in steps(self.engine, [r.row for r in rows]):
            for update in self.publish(changed):
                if on_text is not None and update.text:
                    on_text(index[id(update.row)], update.text)
        return [self.result(r) for r in rows]
