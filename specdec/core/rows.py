"""The rows in flight: what a caller asks for (:class:`Request`), one request's state while it
decodes (:class:`RowState`: its request and sampling params, its randomness, what its proposer
has not seen yet, its output and metrics) and what it returns (:class:`RowResult`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specdec.core.metrics import GenerationMetrics
from specdec.verify.reproducible import PositionUniforms
from specdec.verify.sampling import SamplingParams

MAX_SEED = 2**63 - 2  # the draft's generator gets seed + 1: both must fit a signed 64-bit integer


@dataclass
class RowResult:
    """One request's output. ``metrics`` are this request's own (its acceptance, the target
    calls it took part in, its TTFT and finish time); ``batch_metrics`` aggregate the whole
    batch, including the time breakdown by phase."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "length", "eos", "stop", "cancelled" or "error"
    error: str | None = None  # why the row failed (finish_reason "error"); the other rows go on
    metrics: GenerationMetrics = field(default_factory=GenerationMetrics)
    batch_metrics: GenerationMetrics | None = None


def commit_tokens(res: RowResult, ids: list[int], eos_token_ids, max_new_tokens: int) -> bool:
    """Append a step's committed ``ids`` to one row, stopping at EOS (kept) or at
    ``max_new_tokens``; returns whether the row goes on. (Stop strings are text: the session's,
    :mod:`specdec.text.session`.)"""
    for token in ids:
        res.token_ids.append(token)
        if token in eos_token_ids:
            res.finish_reason = "eos"
        if res.finish_reason != "length" or len(res.token_ids) >= max_new_tokens:
            return False
    return True


@dataclass
class Request:
    """What a caller asks for: a prompt's token ids, how to sample, how many tokens at most.
    ``seed``: sample this request reproducibly from its own generator (the same answer whatever
    else runs; see :mod:`specdec.verify.reproducible`); None: rejection sampling from the engine's stream.
    ``client``: who sent it (a server's per-client admission): with chunked prefill, the prompt of a
    client that has other requests in the engine fills behind other clients' (``Engine._plan``)."""

    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    seed: int | None = None
    client: str = ""


@dataclass(eq=False)  # rows are compared by identity (two requests may be alike)
class RowState:
    """One request in flight: its request and sampling params, its randomness, its proposer's
    state of it, its output so far and its own metrics."""

    request: Request
    uniforms: PositionUniforms | None  # reproducible sampling (a request seed), else None
    result: RowResult = field(default_factory=RowResult)
    pending: list[int] = field(default_factory=list)  # committed ids the proposer has not seen yet
    # The proposer's own state of this row (from Proposer.add; the engine hands it back, never reads it)
    draft: object = None
    done: bool = False
    added_at: float = field(default_factory=time.perf_counter)

    @property
    def token_ids(self) -> list[int]:
        return self.result.token_ids

    @property
    def finish_reason(self) -> str | None:
        """None while running, else "length", "eos", "stop", "cancelled" or "error"."""
        return self.result.finish_reason if self.done else None


@dataclass(eq=False)
class Filling:
    """A request whose prompt is being prefilled in chunks (chunked prefill): its cache row,
    after the batch's rows (shortest remaining first), holds the KV of its prompt's first ``done`` tokens."""

    row: RowState
    done: int = 0  # prompt tokens whose KV its cache row holds (cached prefix + chunks)
    started: bool = False  # its cached prefix is loaded and its first chunk planned
    calls: int = 0  # target calls its chunks took part in
    hidden: list = field(default_factory=list)  # [n_i, E] the target's features of its prefix and chunks, in order

    @property
    def prompt(self) -> list[int]:
        return self.row.request.prompt

    @property
    def left(self) -> int:
        return len(self.row.request.prompt) - self.done
