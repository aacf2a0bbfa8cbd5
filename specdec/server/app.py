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
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.api import TextGenerator
from specdec.core.rows import MAX_SEED, Request
from specdec.verify.sampling import SamplingParams
from specdec.server.metrics import ServerMetrics
from specdec.server.scheduler import Job, QueueFull, Scheduler, ServeConfig


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are accepted and ignored, but "user" names the client (_client)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]
    echo: StrictBool = False
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


MAX_STOP_CHARS = 256  # per stop string: the stop finder holds back that much text while streaming


def _stops(body: _Body) -> list[str]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 4:
        raise BadRequest("at most 4 stop sequences", "stop")
    for s in stops:
        _text(s, "stop")
        if len(s) > MAX_STOP_CHARS:
            raise BadRequest(f"a stop sequence may have at most {MAX_STOP_CHARS} characters, got {len(s)}", "stop")
    return [s for s in stops if s]


def _text(value: str, param: str) -> str:
    """``value`` if it is valid Unicode text; a lone surrogate (JSON ``"\\ud800"``) cannot be
    encoded or tokenized, so it is a 400 naming the field rather than a tokenizer's TypeError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"{param} is not valid Unicode text: a lone surrogate at character {exc.start}", param) from None
    return value


class _ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that computed it."""

    def __init__(self, app, replica: str) -> None:
        self.app, self.header = app, (b"x-specdec-replica", replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


class _BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 before anything parses it
    (a 50 MB body used to stall every other request while it was read and parsed). The body is
    read here in full (it is at most ``limit``) and replayed to the app."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._too_large(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large(send)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        payload = json.dumps({"error": {"message": f"the request body exceeds {self.limit} bytes (max_request_bytes)",
                                        "type": "invalid_request_error", "param": None,
                                        "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


async def _disconnected(request: HTTPRequest) -> None:
    """Returns when the client has gone away (the ASGI server's ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(gen: TextGenerator, config: ServeConfig, model_name: str | None = None,
               engine_thread: bool = True, replica: str | None = None) -> FastAPI:
    """The FastAPI application. ``engine_thread``: the scheduler runs in a thread that starts and
    stops with the app; False: the caller runs ``app.state.scheduler.run()`` itself (:func:`serve`).
    ``replica``: this server's name among replicas, sent in every response's ``x-specdec-replica``
    header (:mod:`specdec.server.replicas`)."""
    api = OpenAIServer(gen, config, model_name or gen.target.name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            api.scheduler.start()
        yield
        if engine_thread:
            api.scheduler.stop()

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.add_middleware(_BodyLimit, limit=config.max_request_bytes)
    if replica is not None:
        app.add_middleware(_ReplicaHeader, replica=replica)
    app.state.scheduler = api.scheduler
    _add_error_handlers(app, api.metrics)
    app.get("/health")(api.health)
    app.get("/v1/models")(api.models)
    app.get("/metrics")(api.prometheus)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat)
    return app


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error in OpenAI's shape, counted in ``specdec_rejected_total`` by kind."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HTTPRequest, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        metrics.rejected.labels("invalid").inc()
        if first.get("type") == "json_invalid":  # loc is ("body", character offset)
            where = first.get("loc", [None, None])[-1]
            reason = (first.get("ctx") or {}).get("error", "JSON decode error")
            return _error(400, f"the request body is not valid JSON: {reason} at character {where}",
                          "invalid_request_error")
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        return _error(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}",
                      "invalid_request_error", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HTTPRequest, exc: StarletteHTTPException):
        """FastAPI's own errors (a body that is not UTF-8, an unknown path, a wrong method) in
        OpenAI's error shape."""
        if exc.status_code < 500:
            metrics.rejected.labels("invalid").inc()
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the request body could not be read as JSON (it must be UTF-8 encoded JSON)"
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, detail, kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(BadRequest)
    async def bad(request: HTTPRequest, exc: BadRequest):
        metrics.rejected.labels("invalid").inc()
        return _error(exc.status, exc.message, "invalid_request_error", exc.param, exc.code)

    @app.exception_handler(QueueFull)
    async def full(request: HTTPRequest, exc: QueueFull):
        metrics.rejected.labels("queue_full").inc()
        return _error(429, f"server busy: {exc}", "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})


class OpenAIServer:
    """The routes: OpenAI's request and response formats around one :class:`Scheduler`."""

    def __init__(self, gen: TextGenerator, config: ServeConfig, name: str) -> None:
        self.gen, self.config, self.name = gen, config, name
        self.metrics = ServerMetrics()
        self.scheduler = Scheduler(gen, config, self.metrics)
        self.created = int(time.time())

    # -- routes ---------------------------------------------------------------------------------

    async def health(self):
        engine = self.scheduler.engine
        return {"status": "ok", "batch": len(engine.rows), "prefilling": len(engine.filling),
                "waiting": self.scheduler.waiting()}

    async def models(self):
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                            "owned_by": "specdec"}]}

    async def prometheus(self):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, body: CompletionBody, request: HTTPRequest):
        texts = _completion_texts(body, self.gen.target.model.vocab_size)
        checked = self.check_body(body, len(texts or [0]))  # before the tokenizer's work
        # Tokenizing is CPU work (seconds for a few MB): a worker thread, so /health and the
        # other requests' streams go on meanwhile.
        prompts = [list(body.prompt)] if texts is None else await asyncio.to_thread(self.tokenize, texts)
        jobs = self.prepare(body, prompts, 16, "prompt", checked, _client(body, request))
        self.scheduler.submit(jobs)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int, text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": now, "model": self.name,
                    "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            return self.stream(jobs, chunk, _include_usage(body), [])
        collected = await self.collect(request, jobs)
        if isinstance(collected, JSONResponse):
            return collected
        choices, usage = collected
        for c in choices:
            c["logprobs"] = None
        return {"id": rid, "object": "text_completion", "created": now, "model": self.name, "choices": choices,
                "usage": usage}

    async def chat(self, body: ChatBody, request: HTTPRequest):
        messages = _chat_messages(body)
        checked = self.check_body(body, 1)
        try:  # the template and the tokenizer in a worker thread (see completions)
            prompt = await asyncio.to_thread(self.gen.encode_chat, messages)
        except ValueError as exc:
            raise BadRequest(str(exc), "messages") from None
        if body.max_completion_tokens and not body.max_tokens:
            body.max_tokens = body.max_completion_tokens
        jobs = self.prepare(body, [prompt], None, "messages", checked, _client(body, request))
        self.scheduler.submit(jobs)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int, text: str, finish: str | None, delta: dict | None = None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": self.name,
                    "choices": [{"index": index, "delta": delta if delta is not None else {"content": text} if text else {},
                                 "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            firsts = [chunk(j.index, "", None, {"role": "assistant", "content": ""}) for j in jobs]
            return self.stream(jobs, chunk, _include_usage(body), firsts)
        collected = await self.collect(request, jobs)
        if isinstance(collected, JSONResponse):
            return collected
        choices, usage = collected
        return {"id": rid, "object": "chat.completion", "created": now, "model": self.name, "usage": usage,
                "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                             "logprobs": None, "finish_reason": c["finish_reason"]} for c in choices]}

    # -- a request's steps ----------------------------------------------------------------------

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        tok = self.gen.target.tokenizer
        return [tok(t)["input_ids"] for t in texts]

    def check_body(self, body: _Body, prompts: int) -> tuple[SamplingParams, list[str]]:
        """What can be checked before tokenizing: the model, the parameters, the request's size."""
        if body.model != self.name:
            raise BadRequest(f"the model {body.model!r} does not exist; this server serves {self.name!r}", "model",
                             "model_not_found")
        _unsupported(body)
        if prompts * body.n > self.config.max_queue:  # it could never be queued: not a 429 to retry
            raise BadRequest(f"{prompts} prompts x n = {body.n} choices exceed this server's queue of "
                             f"{self.config.max_queue} (max_queue)", "prompt" if prompts > 1 else "n")
        return _params(body), _stops(body)

    def prepare(self, body: _Body, prompts: list[list[int]], default_max: int | None, param: str,
                checked: tuple[SamplingParams, list[str]], client: str = "") -> list[Job]:
        """One job per prompt and choice, each checked against the engine's limits; ``checked``:
        what :meth:`check_body` made of the body (its sampling parameters and stop strings);
        ``client``: who sent it (:func:`_client`), whose jobs take their turn together."""
        params, stops = checked
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        jobs = []
        for p, prompt in enumerate(prompts):
            max_new = self._max_new_tokens(body, prompt, default_max, param)
            for c in range(body.n):
                seed = None if body.seed is None else (body.seed + c) % (MAX_SEED + 1)
                request = Request(prompt, params, max_new, seed)
                try:
                    self.scheduler.check(request)
                except ValueError as exc:
                    raise BadRequest(str(exc), "max_tokens" if body.max_tokens else param,
                                     "context_length_exceeded") from None
                jobs.append(Job(p * body.n + c, request, stops, events,
                                loop, n_choices=body.n, client=client))
        return jobs

    def _max_new_tokens(self, body: _Body, prompt: list[int], default_max: int | None, param: str) -> int:
        if not prompt:
            raise BadRequest("the prompt is empty", param)
        limit = self.config.max_model_len
        room = limit - len(prompt)
        if room < 1:
            raise BadRequest(f"the prompt ({len(prompt)} tokens) leaves no room for a completion: it exceeds this "
                             f"server's limit of {limit - 1} prompt tokens (max_model_len {limit}, prompt and "
                             "completion together)", param, "context_length_exceeded")
        return body.max_tokens or (min(default_max, room) if default_max else room)

    async def collect(self, request: HTTPRequest, jobs: list[Job]) -> tuple[list[dict], dict] | JSONResponse:
        """Wait for every job's final event. A client that leaves cancels its jobs at once (the
        engine drops their rows before its next step); a job that fails fails the request."""
        texts = [""] * len(jobs)
        finals: list[dict | None] = [None] * len(jobs)
        queue = jobs[0].events
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while any(f is None for f in finals):
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    self.scheduler.cancel(jobs)
                    raise asyncio.CancelledError
                index, event = get.result()
                if "error" in event:
                    self.scheduler.cancel(jobs)
                    return _error(500, event["error"], "server_error", code=event.get("finish_reason"))
                texts[index] += event.get("text", "")
                if "finish_reason" in event:
                    finals[index] = event
        finally:
            gone.cancel()
        choices = [{"index": i, "text": t, "finish_reason": f["finish_reason"]} for i, (t, f) in enumerate(zip(texts, finals))]
        return choices, _sum_usage([f.get("usage") for f in finals], _prompt_tokens(jobs))

    def stream(self, jobs: list[Job], make_chunk, include_usage: bool, first_chunks: list[dict]) -> StreamingResponse:
        """Server-sent events: each committed text as a chunk, then usage (if asked) and [DONE];
        a failed choice ends the stream with an error chunk and [DONE]."""
        return StreamingResponse(self._events(jobs, make_chunk, include_usage, first_chunks),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _events(self, jobs: list[Job], make_chunk, include_usage: bool, first_chunks: list[dict]):
        done, usages = 0, []
        try:
            for chunk in first_chunks:
                yield _sse(chunk)
            queue = jobs[0].events
            while done < len(jobs):
                index, event = await queue.get()
                finish = event.get("finish_reason")
                if "error" in event:  # a failed choice, or a server at the end of its grace period
                    error = {"message": event["error"], "type": "server_error", "param": None, "code": finish}
                    yield _sse(make_chunk(index, "", finish or "error") | {"error": error})
                    yield "data: [DONE]\n\n"
                    return
                if event.get("text") or finish:
                    yield _sse(make_chunk(index, event.get("text", ""), finish))
                if finish:
                    done += 1
                    usages.append(event.get("usage"))
            if include_usage:
                yield _sse(make_chunk(0, "", None) | {"choices": [], "usage": _sum_usage(usages, _prompt_tokens(jobs))})
            yield "data: [DONE]\n\n"
        finally:
            if done < len(jobs):  # the client went away (or the server stops): free the rows
                self.scheduler.cancel(jobs)


def _client(body: _Body, request: HTTPRequest) -> str:
    """Whom a request is admitted for: the OpenAI body's ``user`` when it has one, else the
    peer's address (the scheduler takes the clients' requests in turn)."""
    user = (body.model_extra or {}).get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    return "addr:" + (request.client.host if request.client else "")


def _sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def _include_usage(body: _Body) -> bool:
    return bool((body.stream_options or {}).get("include_usage"))


def _completion_texts(body: CompletionBody, vocab: int) -> list[str] | None:
    """The prompts' texts (None: one prompt given as token ids, checked against ``vocab``)."""
    if isinstance(body.prompt, str):
        return [_text(body.prompt, "prompt")]
    if body.prompt and isinstance(body.prompt[0], int):
        if any(not 0 <= t < vocab for t in body.prompt):
            raise BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
        return None
    if not body.prompt:
        raise BadRequest("the prompt is empty", "prompt")
    return [_text(p, "prompt") for p in body.prompt]


def _chat_messages(body: ChatBody) -> list[dict[str, str]]:
    """The messages as the chat template takes them: text parts joined, "developer" as "system"."""
    messages = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):  # text parts only
            if any(part.get("type") != "text" or not isinstance(part.get("text", ""), str) for part in content):
                raise BadRequest("only text content parts are supported", f"messages.{i}.content")
            content = "".join(part.get("text", "") for part in content)
        messages.append({"role": "system" if m.role == "developer" else m.role,
                         "content": _text(content or "", f"messages.{i}.content")})
    return messages


def _sum_usage(usages: list[dict | None], prompt: int) -> dict:
    """One response's usage: ``prompt`` tokens (each prompt once, however many choices) and the
    choices' completions; ``speculative`` is the choice's own figures (a list with n > 1)."""
    usages = [u for u in usages if u]
    completion = sum(u["completion_tokens"] for u in usages)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if usages:  # OpenAI's field: prompt tokens served from the prefix cache (the first choice's)
        out["prompt_tokens_details"] = {"cached_tokens": usages[0]["cached_tokens"]}
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
    # uvicorn's own grace is longer than ours: at ``grace_s`` the scheduler ends every request
    # still running with an error event (a stream gets its last chunk and [DONE]), so uvicorn
    # never has to cut a response in the middle.
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=grace_s + 5))
    http = threading.Thread(target=server.run, name="specdec-http", daemon=True)
    scheduler = app.state.scheduler

    def shutdown(*_) -> None:
        if server.should_exit:
            server.force_exit = True  # a second Ctrl-C: do not wait for the grace period
            scheduler.abort_all("the server is shutting down")
        else:
            timer = threading.Timer(grace_s, scheduler.abort_all, ["the server is shutting down"])
            timer.daemon = True
            timer.start()
        server.should_exit = True

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    http.start()
    app.state.scheduler.run(until=lambda: not http.is_alive())
    http.join()
    if not server.started:
        raise OSError(f"could not serve on {host}:{port} (see the message above)")
