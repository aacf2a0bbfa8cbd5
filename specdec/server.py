"""An OpenAI-compatible HTTP server over one :class:`~specdec.engine.Engine` (continuous batching).

Threads: the asyncio event loop (uvicorn, FastAPI) parses requests and streams answers; ONE
worker thread owns the engine and runs its steps. They meet in :class:`Scheduler`: handlers put
jobs in an inbox (or refuse them when the queue is full) and read their events from an asyncio
queue that the worker fills with ``call_soon_threadsafe``. A client that goes away cancels its
jobs; the worker takes them out of the batch before its next step, freeing their cache rows.

What a request gets back does not depend on the others: the runtime is batch invariant (greedy
answers are those of the request run alone) and a request with a ``seed`` is sampled
reproducibly from its own generator (:mod:`specdec.reproducible`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from specdec.api import TextGenerator, TextStream
from specdec.engine import MAX_SEED, Engine, Request, RowState, check_stop
from specdec.sampling import SamplingParams

# What a finished row's reason is called in the OpenAI format.
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled"}


@dataclass
class ServeConfig:
    """How the server decodes. ``proposer``: a name from :data:`specdec.proposers.PROPOSERS`
    already resolved (None: plain decoding). ``max_batch``: rows decoded together;
    ``max_queue``: requests waiting for a row before new ones get 429; ``max_model_len``: prompt
    + max_tokens per request (sizes each row's KV cache)."""

    proposer: str | None = None
    k: int | str = "auto"
    k_max: int = 8
    ngram: tuple[int, int] = (2, 4)
    exit_layer: int | None = None
    max_batch: int = 16
    max_queue: int = 64
    max_model_len: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "max_model_len", "k_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class QueueFull(Exception):
    pass


@dataclass
class Job:
    """One choice of one HTTP request, as the worker sees it."""

    index: int
    request: Request
    text: TextStream
    stop: list[str]
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    row: RowState | None = None
    n_choices: int = 1  # choices per prompt in its HTTP request
    seen: int = 0  # ids already checked for stop strings
    first_token_at: float | None = None
    cancelled: bool = False


class ServerMetrics:
    """Prometheus metrics of one server (its own registry, so tests can run several)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specdec_requests", "Finished choices by finish reason", ["finish_reason"], registry=r)
        self.rejected = Counter("specdec_rejected_requests", "Requests refused (queue full or invalid)", ["reason"], registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated = Counter("specdec_generated_tokens", "Tokens generated", registry=r)
        self.target_calls = Counter("specdec_target_calls", "Target forward calls (prefill and verification)", registry=r)
        self.queue = Gauge("specdec_queue_depth", "Requests waiting for a batch row", registry=r)
        self.batch = Gauge("specdec_batch_size", "Rows decoded in the last step", registry=r)
        self.calls_per_token = Gauge("specdec_target_calls_per_token", "Target calls per generated token so far", registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "From arrival to first token", buckets=buckets, registry=r)
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56), registry=r)
        self.reached = Counter("specdec_draft_reached", "Verifications that reached each draft position", ["position"], registry=r)
        self.accepted = Counter("specdec_draft_accepted", "Draft tokens accepted at each position", ["position"], registry=r)


class Scheduler:
    """Owns the engine and its worker thread."""

    def __init__(self, gen: TextGenerator, config: ServeConfig, metrics: ServerMetrics) -> None:
        self.gen, self.config, self.metrics = gen, config, metrics
        capacity = config.max_model_len + max(config.k_max, config.k if isinstance(config.k, int) else 0) + 2
        proposer = gen.make_proposer(config.proposer, capacity, config.ngram, config.exit_layer) if config.proposer else None
        self.engine = Engine(gen.target.model, proposer, capacity=capacity, k=config.k if proposer else 0,
                             k_max=config.k_max, eos_token_ids=gen.eos_token_ids, seed=config.seed,
                             max_batch=config.max_batch)
        self._lock = threading.Lock()
        self._inbox: deque[Job] = deque()
        self._cancels: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}  # id(row) -> job
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._calls_seen = 0
        self._tokens = 0  # generated tokens published so far

    # -- the event-loop side ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is still running or waiting and stop the worker."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def waiting(self) -> int:
        return len(self._inbox) + len(self.engine.waiting)

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

    def cancel(self, jobs: list[Job]) -> None:
        with self._lock:
            self._cancels.extend(j for j in jobs if not j.cancelled)
        self._wake.set()

    # -- the worker thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._take_inbox()
                if not self.engine.busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                changed = self.engine.step()
                self._publish(changed)
        except Exception as exc:  # a bug: fail every request loudly rather than hang them
            for job in list(self._jobs.values()) + list(self._inbox):
                self._emit(job, {"error": f"internal error: {type(exc).__name__}: {exc}"})
            raise
        finally:
            for job in list(self._jobs.values()) + list(self._inbox):
                self._emit(job, {"finish_reason": "cancelled", "text": ""})

    def _take_inbox(self) -> None:
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            cancels, self._cancels = list(self._cancels), deque()
        for job in new:
            job.row = self.engine.add(job.request)
            self._jobs[id(job.row)] = job
            self.metrics.prompt_tokens.inc(len(job.request.prompt))
        for job in cancels:
            job.cancelled = True
            if job.row is not None and not job.row.done:
                self.engine.cancel(job.row)
                self._jobs.pop(id(job.row), None)
                self.metrics.requests.labels("cancelled").inc()
        self.metrics.queue.set(len(self.engine.waiting))

    def _publish(self, changed: list[RowState]) -> None:
        """Stop strings, text increments and final events of the rows that changed."""
        m = self.metrics
        calls = self.engine.metrics.target_calls
        m.target_calls.inc(calls - self._calls_seen)
        self._calls_seen = calls
        m.batch.set(len(self.engine.rows))
        now = time.perf_counter()
        for row in changed:
            job = self._jobs.get(id(row))
            if job is None:  # cancelled in the meantime
                continue
            if job.first_token_at is None and row.token_ids:
                job.first_token_at = now
                m.ttft.observe(now - row.added_at)
            if job.stop:
                check_stop(self.engine, row, job.text.stop_at, job.seen)
            else:
                job.text.detok.update(row.token_ids)
            m.generated.inc(len(row.token_ids) - job.seen)
            self._tokens += len(row.token_ids) - job.seen
            job.seen = len(row.token_ids)
            text = job.text.release()
            if not row.done:
                if text:
                    self._emit(job, {"text": text})
                continue
            del self._jobs[id(row)]
            text += job.text.finish(self.gen.final_text(row.token_ids, job.stop))
            self._emit(job, {"text": text, "finish_reason": _FINISH[row.finish_reason], "usage": self._usage(row)})
            m.requests.labels(_FINISH[row.finish_reason]).inc()
            n = len(row.token_ids)
            if n > 1 and job.first_token_at is not None:
                m.tpot.observe((now - job.first_token_at) / (n - 1))
            acc = row.result.metrics.acceptance
            for i, (reached, accepted) in enumerate(zip(acc.reached_at, acc.accepted_at)):
                m.reached.labels(str(i)).inc(reached)
                m.accepted.labels(str(i)).inc(accepted)
        m.calls_per_token.set(calls / max(1, self._tokens))
        m.queue.set(len(self.engine.waiting))

    def _usage(self, row: RowState) -> dict:
        metrics = row.result.metrics
        acc = metrics.acceptance
        n = len(row.token_ids)
        return {"prompt_tokens": len(row.request.prompt), "completion_tokens": n,
                "speculative": {  # an extension: this choice's own speculation, in the three metric classes
                    "accepted_per_call": acc.accepted / acc.calls if acc.calls else 0.0,
                    "acceptance_rate": acc.accepted / acc.drafted if acc.drafted else 0.0,
                    "target_calls_per_token": metrics.target_calls / n if n else 0.0,
                    "draft_share": acc.accepted / n if n else 0.0,  # share of tokens that were accepted drafts
                    "time_to_first_token_s": metrics.timings.ttft,
                    "total_s": metrics.timings.total}}

    def _emit(self, job: Job, event: dict) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, (job.index, event))
        except RuntimeError:  # the event loop is gone (shutdown)
            pass


# -- the HTTP side ----------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields (e.g. "user") are accepted and ignored

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]
    echo: bool = False
    best_of: int | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _unsupported(body: _Body) -> None:
    """Parameters that would change the target's distribution (or that we do not return) are
    refused rather than silently ignored."""
    if body.logprobs not in (None, False, 0):
        raise BadRequest("logprobs are not supported", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise BadRequest(f"{name} is not supported (speculation is exact for the unpenalised distribution)", name)
    if body.logit_bias:
        raise BadRequest("logit_bias is not supported", "logit_bias")
    if isinstance(body, CompletionBody) and (body.echo or (body.best_of or 1) > 1):
        raise BadRequest("echo and best_of are not supported", "echo" if body.echo else "best_of")


def _params(body: _Body) -> SamplingParams:
    try:
        return SamplingParams(body.temperature, body.top_k if body.top_k and body.top_k > 0 else None, body.top_p, body.min_p)
    except ValueError as exc:
        raise BadRequest(str(exc), str(exc).split()[0]) from None


def _stops(body: _Body) -> list[str]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 4:
        raise BadRequest("at most 4 stop sequences", "stop")
    return [s for s in stops if s]


def create_app(gen: TextGenerator, config: ServeConfig, model_name: str | None = None) -> FastAPI:
    """The FastAPI application (the scheduler starts and stops with it)."""
    name = model_name or gen.target.name
    metrics = ServerMetrics()
    scheduler = Scheduler(gen, config, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.scheduler = scheduler

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HTTPRequest, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        metrics.rejected.labels("invalid").inc()
        return _error(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}",
                      "invalid_request_error", ".".join(loc) or None)

    @app.exception_handler(BadRequest)
    async def bad(request: HTTPRequest, exc: BadRequest):
        metrics.rejected.labels("invalid").inc()
        return _error(exc.status, exc.message, "invalid_request_error", exc.param, exc.code)

    @app.exception_handler(QueueFull)
    async def full(request: HTTPRequest, exc: QueueFull):
        metrics.rejected.labels("queue_full").inc()
        return _error(429, f"server busy: {exc}", "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})

    @app.get("/health")
    async def health():
        return {"status": "ok", "batch": len(scheduler.engine.rows), "waiting": scheduler.waiting()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "specdec"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def prepare(body: _Body, prompts: list[list[int]], default_max: int | None) -> list[Job]:
        if body.model != name:
            raise BadRequest(f"the model {body.model!r} does not exist; this server serves {name!r}", "model", "model_not_found")
        _unsupported(body)
        params, stops = _params(body), _stops(body)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        jobs = []
        for p, prompt in enumerate(prompts):
            if not prompt:
                raise BadRequest("the prompt is empty", "prompt")
            max_new = body.max_tokens or default_max or (config.max_model_len - len(prompt))
            for c in range(body.n):
                seed = None if body.seed is None else (body.seed + c) % (MAX_SEED + 1)
                request = Request(prompt, params, max_new, seed)
                try:
                    scheduler.check(request)
                except ValueError as exc:
                    raise BadRequest(str(exc), "max_tokens" if body.max_tokens else "prompt", "context_length_exceeded") from None
                jobs.append(Job(p * body.n + c, request, TextStream(gen.target.tokenizer, stops), stops, events, loop,
                                n_choices=body.n))
        return jobs

    async def collect(request: HTTPRequest, jobs: list[Job]) -> tuple[list[dict], dict]:
        """Wait for every job's final event (a client that leaves cancels them)."""
        texts = [""] * len(jobs)
        finals: list[dict | None] = [None] * len(jobs)
        queue = jobs[0].events
        while any(f is None for f in finals):
            try:
                index, event = await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    scheduler.cancel(jobs)
                    raise asyncio.CancelledError from None
                continue
            if "error" in event:
                raise RuntimeError(event["error"])
            texts[index] += event.get("text", "")
            if "finish_reason" in event:
                finals[index] = event
        return [{"index": i, "text": t, "finish_reason": f["finish_reason"]} for i, (t, f) in enumerate(zip(texts, finals))], \
            _sum_usage([f.get("usage") for f in finals], _prompt_tokens(jobs))

    def stream(jobs: list[Job], make_chunk, include_usage: bool, first_chunks: list[dict]):
        async def events():
            done = 0
            usages = []
            try:
                for chunk in first_chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
                queue = jobs[0].events
                while done < len(jobs):
                    index, event = await queue.get()
                    if "error" in event:
                        yield f"data: {json.dumps({'error': {'message': event['error'], 'type': 'server_error'}})}\n\n"
                        break
                    finish = event.get("finish_reason")
                    if event.get("text") or finish:
                        yield f"data: {json.dumps(make_chunk(index, event.get('text', ''), finish))}\n\n"
                    if finish:
                        done += 1
                        usages.append(event.get("usage"))
                if include_usage:
                    chunk = make_chunk(0, "", None)
                    chunk["choices"] = []
                    chunk["usage"] = _sum_usage(usages, _prompt_tokens(jobs))
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                if done < len(jobs):  # the client went away (or the server stops): free the rows
                    scheduler.cancel(jobs)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: HTTPRequest):
        tok = gen.target.tokenizer
        if isinstance(body.prompt, str):
            prompts = [tok(body.prompt)["input_ids"]]
        elif body.prompt and isinstance(body.prompt[0], int):
            vocab = gen.target.model.vocab_size
            if any(not 0 <= t < vocab for t in body.prompt):
                raise BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
            prompts = [list(body.prompt)]
        else:
            prompts = [tok(p)["input_ids"] for p in body.prompt]
        if not prompts:
            raise BadRequest("the prompt is empty", "prompt")
        jobs = prepare(body, prompts, 16)
        scheduler.submit(jobs)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int, text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": now, "model": name,
                    "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            return stream(jobs, chunk, bool((body.stream_options or {}).get("include_usage")), [])
        choices, usage = await collect(request, jobs)
        for c in choices:
            c["logprobs"] = None
        return {"id": rid, "object": "text_completion", "created": now, "model": name, "choices": choices, "usage": usage}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: HTTPRequest):
        messages = []
        for m in body.messages:
            content = m.content
            if isinstance(content, list):  # text parts only
                if any(part.get("type") != "text" for part in content):
                    raise BadRequest("only text content parts are supported", "messages")
                content = "".join(part.get("text", "") for part in content)
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        try:
            prompt = gen.encode_chat(messages)
        except ValueError as exc:
            raise BadRequest(str(exc), "messages") from None
        if body.max_completion_tokens and not body.max_tokens:
            body.max_tokens = body.max_completion_tokens
        jobs = prepare(body, [prompt], None)
        scheduler.submit(jobs)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int, text: str, finish: str | None) -> dict:
            delta = {"content": text} if text else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": name,
                    "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            firsts = [{"id": rid, "object": "chat.completion.chunk", "created": now, "model": name,
                       "choices": [{"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]} for j in jobs]
            return stream(jobs, chunk, bool((body.stream_options or {}).get("include_usage")), firsts)
        choices, usage = await collect(request, jobs)
        return {"id": rid, "object": "chat.completion", "created": now, "model": name, "usage": usage,
                "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                             "logprobs": None, "finish_reason": c["finish_reason"]} for c in choices]}

    return app


def _sum_usage(usages: list[dict | None], prompt: int) -> dict:
    """One response's usage: ``prompt`` tokens (each prompt once, however many choices) and the
    choices' completions; ``speculative`` is the choice's own figures (a list with n > 1)."""
    usages = [u for u in usages if u]
    completion = sum(u["completion_tokens"] for u in usages)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if usages:
        out["speculative"] = usages[0]["speculative"] if len(usages) == 1 else [u["speculative"] for u in usages]
    return out


def _prompt_tokens(jobs: list[Job]) -> int:
    return sum({j.index // j.n_choices: len(j.request.prompt) for j in jobs}.values())


def serve(gen: TextGenerator, config: ServeConfig, host: str = "127.0.0.1", port: int = 8000,
          model_name: str | None = None) -> None:
    """Run the server until interrupted (Ctrl-C / SIGTERM: in-flight requests finish or are
    cancelled after a grace period, then the engine stops)."""
    import uvicorn

    uvicorn.run(create_app(gen, config, model_name), host=host, port=port, log_level="info",
                timeout_graceful_shutdown=30)
