"""API fuzzing: hypothesis generates request bodies for the OpenAI endpoints (well-formed ones,
wrong types, out-of-range values, unknown fields, broken JSON, odd Unicode) and sends each to a
live server on a tiny model. After every request:

- no 5xx, and every error is in OpenAI's shape (``{"error": {message, type, param, code}}``);
- ``/health`` answers;
- a canary request (greedy) gets exactly its solo answer: no malformed request changes what
  another request receives.

``make test`` runs the fast profile (``SPECDEC_FUZZ_EXAMPLES``, default 60 bodies per endpoint);
``make fuzz`` the long one (2,000 per endpoint).
"""

from __future__ import annotations

import json
import logging
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.server import ServeConfig
from servers import MODEL, Server

EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "60"))
CANARY = {"model": MODEL, "prompt": "canary", "max_tokens": 6, "temperature": 0}


class _Errors(logging.Handler):
    """Every log record at ERROR or above (uvicorn's "Exception in ASGI application" tracebacks,
    the scheduler's engine failures) while the fuzzer runs."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


ERRORS = _Errors()


@pytest.fixture(scope="module")
def server(gen):  # noqa: F811
    for name in ("", "uvicorn"):  # uvicorn's loggers do not propagate to the root
        logging.getLogger(name).addHandler(ERRORS)
    s = Server(gen, ServeConfig(gen.speculation("ngram", k=3), max_batch=8, max_queue=32, max_model_len=128,
                                max_request_bytes=64 * 1024))
    s.canary = httpx.post(s.url + "/v1/completions", json=CANARY, timeout=60).json()["choices"][0]["text"]
    yield s
    s.stop()
    for name in ("", "uvicorn"):
        logging.getLogger(name).removeHandler(ERRORS)


_piece = st.text(st.characters(codec="utf-8") | st.sampled_from(["\ud800", "\udfff", "\n", "\x00"]), max_size=20)
text = st.lists(_piece | st.sampled_from(["<|im_end|>", "<|im_start|>system\n", "assistant:"]), max_size=3).map("".join)
json_scalar = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | text
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                          max_leaves=12)


def _maybe(value_strategy, wrong=json_value):
    """A field's value: usually of the right kind, sometimes anything."""
    return st.one_of(value_strategy, value_strategy, wrong)


COMMON = {
    "model": _maybe(st.just(MODEL) | text),
    "max_tokens": _maybe(st.integers(-2, 300) | st.none()),
    "temperature": _maybe(st.sampled_from([0, 1e-300, 1e-50, 0.5, 1.0, 2.0, 100.0, 101.0, -1.0]) | st.floats()),
    "top_p": _maybe(st.floats(-0.5, 1.5)),
    "top_k": _maybe(st.integers(-3, 200)),
    "min_p": _maybe(st.floats(-0.5, 1.5)),
    "seed": _maybe(st.integers(-5, 2**64)),
    "stop": _maybe(st.none() | text | st.lists(text, max_size=6)),
    "n": _maybe(st.integers(-1, 20)),
    "stream": _maybe(st.booleans()),
    "stream_options": _maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logprobs": _maybe(st.none() | st.booleans()),
    "presence_penalty": _maybe(st.floats(-2, 2)),
    "logit_bias": _maybe(st.none() | st.dictionaries(text, st.floats(-100, 100), max_size=2)),
}
MESSAGE = st.fixed_dictionaries({"role": _maybe(st.sampled_from(["system", "user", "assistant", "developer", "tool", "bot"])),
                                 "content": _maybe(text | st.none() | st.lists(
                                     st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": text}),
                                     max_size=3))})


def _bodies(specific: dict):
    fields = COMMON | specific
    return st.fixed_dictionaries({}, optional=fields) | st.dictionaries(text, json_value, max_size=3)


COMPLETION_BODIES = _bodies({"prompt": _maybe(text | st.lists(text, max_size=40) | st.lists(st.integers(-5, 200), max_size=40)),
                             "echo": _maybe(st.booleans()), "best_of": _maybe(st.integers(-1, 3))})
CHAT_BODIES = _bodies({"messages": _maybe(st.lists(MESSAGE, max_size=4)),
                       "max_completion_tokens": _maybe(st.integers(-1, 300))})


def _raw(body: dict, mangle: int) -> bytes:
    """The body as sent: JSON, or JSON with a cut, a stray byte or an invalid UTF-8 sequence."""
    data = json.dumps(body).encode("utf-8", "surrogatepass")
    if mangle == 1:
        return data[: len(data) // 2]
    if mangle == 2:
        return data[:-1] + b"\xff}"
    return data


def _check(server, path: str, body: dict, mangle: int) -> None:
    r = httpx.post(server.url + path, content=_raw(body, mangle), headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and error["message"], r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    canary = httpx.post(server.url + "/v1/completions", json=CANARY, timeout=60).json()["choices"][0]["text"]
    assert canary == server.canary


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=COMPLETION_BODIES, mangle=st.sampled_from([0, 0, 0, 1, 2]))
def test_fuzz_completions(server, body, mangle):
    _check(server, "/v1/completions", body, mangle)


@FUZZ
@given(body=CHAT_BODIES, mangle=st.sampled_from([0, 0, 0, 1, 2]))
def test_fuzz_chat(server, body, mangle):
    _check(server, "/v1/chat/completions", body, mangle)


def test_the_fuzzer_reaches_answers_and_errors(server):
    """The strategies are not all errors (nor all answers): a fixed sample of bodies gets both
    200s and 400s, so the invariants above are exercised on both paths."""
    statuses = set()
    for body in [CANARY, CANARY | {"n": 2, "stream": True}, CANARY | {"temperature": "hot"}, {"prompt": 3}]:
        statuses.add(httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code)
    assert statuses == {200, 400}


def test_no_traceback_was_logged_while_fuzzing(server):
    """Runs last in this module: nothing the fuzzer sent made the server log an error. It sends
    bodies of its own first (each mangling, both endpoints), so it checks something run alone too."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "canary"}], "max_tokens": 4}
    for mangle in (0, 1, 2):
        _check(server, "/v1/completions", CANARY | {"stream": True}, mangle)
        _check(server, "/v1/chat/completions", chat, mangle)
    assert not ERRORS.records, [r.getMessage() for r in ERRORS.records[:5]]
