"""The engine's worker thread and the jobs handed to it.

Threads: the asyncio event loop (uvicorn, FastAPI) parses requests and streams answers; ONE
worker thread owns the engine and runs its steps. They meet in :class:`Scheduler`: handlers put
jobs in an inbox (or refuse them when the queue is full) and read their events from an asyncio
queue that the worker fills with ``call_soon_threadsafe``. A client that goes away cancels its
jobs; the worker takes them out of the batch before its next step, freeing their cache rows.

What a request gets back does not depend on the others: the runtime is batch invariant (greedy
answers are those of the request run alone) and a request with a ``seed`` is sampled
reproducibly from its own generator (:mod:`specdec.verify.reproducible`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace

from specdec.api import TextGenerator
from specdec.core.rows import Request, RowState
from specdec.core.prefill import STEP_TOKENS
from specdec.core.prefix_cache import PREFIX_CACHE_MB, PrefixCache
from specdec.server.metrics import ServerMetrics
from specdec.text.session import Session, TextRow, TextUpdate
from specdec.speculation import SpeculationConfig

# What a finished row's reason is called in the OpenAI format.
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled", "error": "error"}


@dataclass
class ServeConfig:
    """How the server decodes. ``speculation``: resolved by :meth:`TextGenerator.speculation`
    (default: plain decoding). ``max_batch``: rows decoded together;
    ``max_queue``: requests waiting for a row before new ones get 429; ``max_model_len``: prompt
    + max_tokens per request (sizes each row's KV cache); ``max_request_bytes``: the largest
    request body (413 beyond it); ``prefix_cache_mb``: memory for the KV of earlier prompts and
    answers that later requests start with (:mod:`specdec.core.prefix_cache`; 0: none);
    ``step_tokens``: the engine's ``token_budget`` (chunked prefill; None: whole prompts)."""

    speculation: SpeculationConfig = field(default_factory=SpeculationConfig.plain)
    max_batch: int = 16
    max_queue: int = 64
    max_model_len: int = 2048
    seed: int = 0
    max_request_bytes: int = 4 * 1024 * 1024
    prefix_cache_mb: float = PREFIX_CACHE_MB
    step_tokens: int | None = STEP_TOKENS

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "max_model_len", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.step_tokens is not None and self.step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1 or None, got {self.step_tokens}")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")


class QueueFull(Exception):
    pass


@dataclass
class Job:
    """One choice of one HTTP request, as the worker sees it."""

    index: int
    request: Request
    stop: list[str]
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    text: TextRow | None = None  # its row in the session, once the worker has taken it
    n_choices: int = 1  # choices per prompt in its HTTP request
    client: str = ""  # who sent it (the body's "user", else the peer's address): admission is per client
    first_token_at: float | None = None
    cancelled: bool = False


class Scheduler:
    """A text session (its engine) plus a queue, and the worker thread that steps it."""

    def __init__(self, gen: TextGenerator, config: ServeConfig, metrics: ServerMetrics) -> None:
        self.gen, self.config, self.metrics = gen, config, metrics
        self.prefix = PrefixCache.of_megabytes(config.prefix_cache_mb)  # outlives engines (a failed step replaces one)
        self.session = self._new_session()
        self._abort: str | None = None  # set by abort_all: the message every job in flight ends with
        self._lock = threading.Lock()
        self._inbox: deque[Job] = deque()
        self._held: dict[str, deque[Job]] = {}  # per client, in arrival order: jobs the engine has no row for yet
        self._n_held = 0  # (read by the event loop's queue check; the worker alone changes _held)
        self._cancels: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}  # id(row) -> job
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._calls_seen = 0  # the current engine's target calls already counted
        self._calls_total = 0  # every engine's (a failed step replaces the engine)
        self._tokens = 0  # generated tokens published so far

    def _new_session(self) -> Session:
        config = self.config
        engine = self.gen.engine(config.speculation, config.max_model_len, seed=config.seed, max_batch=config.max_batch,
                                 prefix_cache=self.prefix, token_budget=config.step_tokens)
        return Session(engine, self.gen.target.tokenizer)

    @property
    def engine(self):
        return self.session.engine

    # -- the event-loop side ------------------------------------------------------------------

    def start(self) -> None:
        """Run the engine in a thread of its own (tests, a server inside another program).
        `specdec serve` runs it in the main thread instead (see :func:`specdec.server.app.serve`)."""
        self._thread = threading.Thread(target=self.run, name="specdec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is still running or waiting and stop the engine loop."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        """The worker thread (:meth:`start`) has ended (stopped, or died)."""
        return self._stopping or (self._thread is not None and not self._thread.is_alive())

    def waiting(self) -> int:
        return len(self._inbox) + len(self.engine.waiting) + self._n_held

    def check(self, request: Request) -> None:
        self.engine.check(request)  # reads configuration only: safe from any thread

    def submit(self, jobs: list[Job]) -> None:
        with self._lock:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if self.waiting() + len(jobs) > self.config.max_queue:
                raise QueueFull(f"{self.waiting()} requests are waiting (max_queue {self.config.max_queue})")
            self._inbox.extend(jobs)
        self._wake.set()

    def abort_all(self, message: str) -> None:
        """End every request in flight or waiting with an error event carrying ``message`` (a
        server that stops at the end of its grace period: each stream gets a clean last event)."""
        with self._lock:
            self._abort = message
        self._wake.set()

    def cancel(self, jobs: list[Job]) -> None:
        with self._lock:
            self._cancels.extend(j for j in jobs if not j.cancelled)
        self._wake.set()

    # -- the worker thread --------------------------------------------------------------------

    def run(self, until=lambda: False) -> None:
        """The engine loop, until :meth:`stop` or ``until()``; then every request still running
        or waiting gets a "cancelled" end, and the learned call costs are kept."""
        try:
            while not self._stopping and not until():
                self._take_inbox()
                if not self.engine.busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                try:
                    updates = self.session.step()
                except Exception as exc:  # a bug: fail the requests in flight, keep serving the next ones
                    self._recover(exc)
                    continue
                self._publish(updates)
        finally:
            for job in list(self._jobs.values()) + list(self._inbox) + self._take_held():
                self._emit(job, {"finish_reason": "cancelled", "text": ""})
            self.gen.keep_costs()  # what the target's calls cost, for the next server or command

    def _recover(self, exc: Exception) -> None:
        """An engine step raised: its state is not to be trusted. Every request in flight gets
        an error event (the failure is logged once, with its traceback, for the operator) and a
        fresh engine takes the next requests. Per-row faults never get here: the engine fails
        such a row alone (:meth:`Engine.fail`)."""
        import logging

        logging.getLogger("specdec.server").error("engine step failed; %d requests in flight fail",
                                                   len(self._jobs), exc_info=exc)
        waiting = [self._jobs.pop(id(r)) for r in self.engine.waiting if id(r) in self._jobs]
        for job in list(self._jobs.values()):
            self._emit(job, {"error": f"internal error: {type(exc).__name__}: {exc}", "finish_reason": "error"})
            self.metrics.requests.labels("error").inc()
        self._jobs.clear()
        self.session = self._new_session()
        self._calls_seen = 0
        for job in waiting:  # requests that had not started yet lose nothing
            self._start(job)

    def _take_inbox(self) -> None:
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            cancels, self._cancels = list(self._cancels), deque()
            abort, self._abort = self._abort, None
        if abort is not None:
            for job in list(self._jobs.values()) + self._take_held() + new:
                if job.text is not None:
                    self.session.cancel(job.text)
                self._emit(job, {"error": abort, "finish_reason": "cancelled"})
                self.metrics.requests.labels("cancelled").inc()
            self._jobs.clear()
            return
        for job in new:
            self._held.setdefault(job.client, deque()).append(job)
            self._n_held += 1
            self.metrics.prompt_tokens.inc(len(job.request.prompt))
        for job in cancels:
            job.cancelled = True
            held = self._held.get(job.client)
            if job.text is None and held is not None and job in held:
                held.remove(job)
                if not held:
                    del self._held[job.client]  # (_release takes a client's queue as not empty)
                self._n_held -= 1
                self._emit(job, {"finish_reason": "cancelled", "text": ""})
                self.metrics.requests.labels("cancelled").inc()
            elif job.text is not None and not job.text.row.done:
                self.session.cancel(job.text)
                self._jobs.pop(id(job.text.row), None)
                self.metrics.requests.labels("cancelled").inc()
        self._release()
        self.metrics.queue.set(self.waiting())

    def _release(self) -> None:
        """Hand the engine held jobs while it has room, so that one client's flood of requests
        does not queue every other client's behind it:

        * the next job is the held one of the client with the fewest jobs in the engine (ties:
          round robin, a client to the back of the turn once served);
        * with chunked prefill, a client's job that has others in the engine goes only while the
          engine's prompts not yet started are under one step's budget (the engine fills no more
          a step): the rest stay here, where a later client's request can still go first (handed
          to the engine as they came, a burst's first prompts took every row, and the next
          client waited for one to end); a client with none there goes at once, and its prompt
          fills before the flood's (``Engine._background``, which counts what is held here).

        (No row is kept back for clients yet to come: behind a proxy, or in the benchmarks,
        every request is one address's, and a kept row would cost one in every ``max_batch``.)"""
        budget = self.config.step_tokens
        while self._held and self.engine.room > 0:
            in_engine = Counter(job.client for job in self._jobs.values())
            client = min(self._held, key=lambda c: in_engine[c])  # (the dict keeps the turn's order)
            if budget is not None and in_engine[client] and self.engine.queued_positions >= budget:
                break
            queue = self._held.pop(client)
            self._start(queue.popleft())
            self._n_held -= 1
            if queue:
                self._held[client] = queue  # (to the back of the turn)
        self.engine.held = Counter({client: len(queue) for client, queue in self._held.items()})

    def _take_held(self) -> list[Job]:
        jobs = [job for queue in self._held.values() for job in queue]
        self._held.clear()
        self._n_held = 0
        return jobs

    def _start(self, job: Job) -> None:
        job.text = self.session.add(replace(job.request, client=job.client), job.stop)
        self._jobs[id(job.text.row)] = job

    def _publish(self, updates: list[TextUpdate]) -> None:
        """Events and metrics of the step's text updates."""
        m = self.metrics
        calls = self.engine.metrics.target_calls
        m.target_calls.inc(calls - self._calls_seen)
        self._calls_total += calls - self._calls_seen
        self._calls_seen = calls
        m.batch.set(len(self.engine.rows))
        for phase, seconds in self.engine.timer.step.items():
            m.phase_seconds.labels(phase).inc(seconds)
        now = time.perf_counter()
        for update in updates:
            row = update.row.row
            job = self._jobs.get(id(row))
            if job is None:  # cancelled in the meantime
                continue
            if job.first_token_at is None and row.token_ids:
                job.first_token_at = now
                m.ttft.observe(now - row.added_at)
            m.generated.inc(update.new_tokens)
            self._tokens += update.new_tokens
            if not update.done:
                if update.text:
                    self._emit(job, {"text": update.text})
                continue
            del self._jobs[id(row)]
            self._finish(job, row, update.text, now)
        m.calls_per_token.set(self._calls_total / max(1, self._tokens))
        m.queue.set(self.waiting())
        if self.prefix is not None:
            m.observe_prefix(self.prefix)

    def _finish(self, job: Job, row: RowState, text: str, now: float) -> None:
        """A finished row's last event (its held-back text, finish reason and usage) and metrics."""
        m = self.metrics
        if row.finish_reason == "error":
            self._emit(job, {"error": row.result.error, "finish_reason": "error"})
            m.requests.labels("error").inc()
            return
        self._emit(job, {"text": text, "finish_reason": FINISH[row.finish_reason], "usage": self._usage(row)})
        m.requests.labels(FINISH[row.finish_reason]).inc()
        n = len(row.token_ids)
        if n > 1 and job.first_token_at is not None:
            m.tpot.observe((now - job.first_token_at) / (n - 1))
        acc = row.result.metrics.acceptance
        for i, (reached, accepted) in enumerate(zip(acc.reached_at, acc.accepted_at)):
            m.reached.labels(str(i)).inc(reached)
            m.accepted.labels(str(i)).inc(accepted)

    def _usage(self, row: RowState) -> dict:
        metrics = row.result.metrics
        own = metrics.to_dict()  # the ratios as metrics.py computes them, once
        n = len(row.token_ids)
        return {"prompt_tokens": len(row.request.prompt), "completion_tokens": n,
                "cached_tokens": metrics.cached_prompt_tokens,
                "speculative": {  # an extension: this choice's own speculation, in the three metric classes
                    "accepted_per_call": own["acceptance"]["mean_accepted_per_call"],
                    "acceptance_rate": own["acceptance"]["acceptance_rate"],
                    "target_calls_per_token": own["target_calls_per_token"],
                    "draft_share": metrics.acceptance.accepted / n if n else 0.0,  # share of tokens that were accepted drafts
                    "time_to_first_token_s": metrics.timings.ttft,
                    "total_s": metrics.timings.total}}

    def _emit(self, job: Job, event: dict) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, (job.index, event))
        except RuntimeError:  # the event loop is gone (shutdown)
            pass


