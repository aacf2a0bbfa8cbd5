"""The FastAPI application: OpenAI's request and response formats around the scheduler."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from specdec.api import TextGenerator, TextStream
from specdec.engine import MAX_SEED, Request
from specdec.sampling import SamplingParams
from specdec.server.metrics import ServerMetrics
from specdec.server.scheduler import Job, QueueFull, Scheduler, ServeConfig


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


def create_app(gen: TextGenerator, config: ServeConfig, model_name: str | None = None,
               engine_thread: bool = True) -> FastAPI:
    """The FastAPI application. ``engine_thread``: the scheduler runs in a thread that starts and
    stops with the app; False: the caller runs ``app.state.scheduler.run()`` itself (:func:`serve`)."""
    name = model_name or gen.target.name
    metrics = ServerMetrics()
    scheduler = Scheduler(gen, config, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            scheduler.start()
        yield
        if engine_thread:
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
          model_name: str | None = None, grace_s: float = 30.0) -> None:
    """Run the server until interrupted. Ctrl-C / SIGTERM: no new connections; in-flight
    requests finish (or are cancelled after ``grace_s``), then the engine stops.

    The engine runs in the main thread and HTTP in a second one: the main thread already owns
    the OpenMP thread team that loaded the model, and a second team (the engine in a thread of
    its own) makes libgomp throttle its spin-waits when threads outnumber cores — measured
    25-30% slower steps on this 2-core machine."""
    import signal
    import threading

    import uvicorn

    app = create_app(gen, config, model_name, engine_thread=False)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=grace_s))
    http = threading.Thread(target=server.run, name="specdec-http", daemon=True)

    def shutdown(*_) -> None:
        if server.should_exit:
            server.force_exit = True  # a second Ctrl-C: do not wait for the grace period
        server.should_exit = True

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    http.start()
    app.state.scheduler.run(until=lambda: not http.is_alive())
    http.join()
    if not server.started:
        raise OSError(f"could not serve on {host}:{port} (see the message above)")
