"""The soak test's users (``make soak``; see ``run.py``): a mix of what clients send a server.

Each request is classed as one of:
- ``ok``: a 200 whose answer is whole (a stream ends with ``[DONE]`` after a finish_reason);
- ``rejected``: a 4xx in OpenAI's error shape, for requests meant to be bad, or a 429 (busy);
- ``disconnect``: a stream this user closed on purpose after two chunks;
- anything else is a failure: ``lost`` (a stream cut without [DONE], a connection error),
  ``5xx``, ``bad-shape`` (an error not in OpenAI's shape) or ``unexpected`` (a good request refused).

TTFT and TPOT of streamed answers are reported as their own rows ("TTFT", "TPOT") in milliseconds
(TPOT from the usage chunk's token count: a chunk can carry several tokens).
"""

from __future__ import annotations

import json
import random
import time

from locust import HttpUser, between, task

MODEL = "soak"
TOPICS = ["a haiku about rain", "binary search in Python", "why the sky is blue", "a limerick about a cat",
          "the capital of France", "a SQL query counting rows per day", "three tips for sleeping well"]
BAD_BODIES = [
    b'{"model": "soak", "messages": [{"role": "user", "content": "hi"}',  # cut JSON
    b'{"model": "soak", "messages": [{"role": "user", "content": "\\ud800"}]}',  # lone surrogate
    b'{"model": "soak", "messages": [], "temperature": "hot"}',
    b'{"model": "soak", "prompt": "x", "stream": "yes"}',
    b'{"model": "nope", "prompt": "x"}',
    b'{"model": "soak", "prompt": "x", "max_tokens": -3}',
    b'\xff\xfe not utf-8',
]


def _chat(stream: bool) -> dict:
    return {"model": MODEL, "stream": stream, "max_tokens": random.choice([16, 32, 64]),
            "temperature": random.choice([0, 0, 0.7]), "seed": random.randrange(1000),
            "stream_options": {"include_usage": True} if stream else None,
            "messages": [{"role": "system", "content": "You are a concise assistant."},
                         {"role": "user", "content": f"Write {random.choice(TOPICS)}."}]}


class Client(HttpUser):
    wait_time = between(0.05, 0.5)

    def _fire(self, kind: str, name: str, ms: float, exc: Exception | None = None) -> None:
        self.environment.events.request.fire(request_type=kind, name=name, response_time=ms, response_length=0,
                                             exception=exc, context={})

    def _post(self, path: str, name: str, **kw):
        return self.client.post(path, name=name, catch_response=True, timeout=120, **kw)

    @task(4)
    def chat(self) -> None:
        with self._post("/v1/chat/completions", "chat", json=_chat(False)) as r:
            if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"):
                r.success()
            elif r.status_code == 429:
                r.success()
            else:
                r.failure(f"{'5xx' if r.status_code >= 500 else 'unexpected'} {r.status_code}")

    @task(3)
    def chat_stream(self) -> None:
        self._stream(close_after=None)

    @task(1)
    def chat_stream_then_leave(self) -> None:
        self._stream(close_after=2)

    @task(1)
    def completions_n2(self) -> None:
        body = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 24, "n": 2, "temperature": 0.8, "seed": 7}
        with self._post("/v1/completions", "completions n=2", json=body) as r:
            ok = r.status_code == 200 and len(r.json()["choices"]) == 2
            r.success() if ok or r.status_code == 429 else r.failure(f"unexpected {r.status_code}")

    @task(1)
    def bad_request(self) -> None:
        body = random.choice(BAD_BODIES)
        with self._post("/v1/chat/completions", "bad request", data=body,
                        headers={"content-type": "application/json"}) as r:
            try:
                shaped = set(r.json()["error"]) >= {"message", "type", "param", "code"}
            except Exception:
                shaped = False
            if 400 <= r.status_code < 500 and shaped:
                r.success()
            else:
                r.failure(f"{'5xx' if r.status_code >= 500 else 'bad-shape'} {r.status_code}")

    def _stream(self, close_after: int | None) -> None:
        name = "chat stream" if close_after is None else "chat stream, client leaves"
        start = time.perf_counter()
        first = last = None
        chunks = 0
        finished = done = False
        tokens = 0
        with self._post("/v1/chat/completions", name, json=_chat(True), stream=True) as r:
            if r.status_code != 200:
                r.success() if r.status_code == 429 else r.failure(f"unexpected {r.status_code}")
                return
            try:
                for line in r.iter_lines():
                    if not line.startswith(b"data: "):
                        continue
                    if line == b"data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        r.failure(f"lost: error event {event['error']['message']}")
                        return
                    if not event["choices"]:  # the usage chunk
                        tokens = event["usage"]["completion_tokens"]
                        continue
                    choice = event["choices"][0]
                    if choice["delta"].get("content"):
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        chunks += 1
                    finished = finished or choice.get("finish_reason") is not None
                    if close_after is not None and chunks >= close_after:
                        r.close()
                        r.success()
                        return
            except Exception as exc:  # a connection cut under us
                r.failure(f"lost: {type(exc).__name__}")
                return
            if done and finished:
                r.success()
            else:
                r.failure("lost: stream ended without [DONE]" if not done else "lost: no finish_reason")
                return
        if first is not None:
            self._fire("TTFT", "chat stream", (first - start) * 1000)
            if tokens > 1:  # a chunk can carry several tokens (a step commits 1..k+1)
                self._fire("TPOT", "chat stream", (last - first) * 1000 / (tokens - 1))
