"""Prefix routing's parts that need no Ray (specdec.server.routing): the routing key, the router's
memory and the in-process ASGI call the replicas answer through. The routing itself, on live
replicas, is in test_replicas.py (``make test-ray``)."""

from __future__ import annotations

import asyncio
import json

from specdec.server.routing import PROMPT_KEY_CHARS, Affinity, asgi_call, route_key

SYSTEM = {"role": "system", "content": "shared"}


def _chat(*messages: dict) -> bytes:
    return json.dumps({"model": "m", "messages": list(messages)}).encode()


def test_a_conversations_turns_share_a_key_and_conversations_with_one_system_prompt_do_not():
    first = {"role": "user", "content": "hello"}
    turn1 = route_key("/v1/chat/completions", [], _chat(SYSTEM, first))
    turn3 = route_key("/v1/chat/completions", [], _chat(SYSTEM, first, {"role": "assistant", "content": "hi"},
                                                        {"role": "user", "content": "more"}))
    other = route_key("/v1/chat/completions", [], _chat(SYSTEM, {"role": "user", "content": "bye"}))
    assert turn1 == turn3 and turn1 != other


def test_completion_keys_cut_the_prompt_and_the_header_overrides_the_body():
    base = "x" * PROMPT_KEY_CHARS
    key = route_key("/v1/completions", [], json.dumps({"prompt": base + "tail one"}).encode())
    assert key == route_key("/v1/completions", [], json.dumps({"prompt": base + "tail two"}).encode())
    assert key != route_key("/v1/completions", [], json.dumps({"prompt": "y" + base}).encode())
    header = [(b"X-Specdec-Route-Key", b"session-7")]
    assert route_key("/v1/completions", header, b"not json") == "header:session-7"
    assert len(key) < 64  # a digest travels with every request, not the prompt


def test_requests_without_a_key_leave_the_choice_to_load():
    assert route_key("/health", [], b"") is None
    assert route_key("/v1/completions", [], b"{not json") is None
    assert route_key("/v1/completions", [], b"[1, 2]") is None
    assert route_key("/v1/completions", [], json.dumps({"prompt": [1, 2, 3]}).encode()) is None


def test_affinity_remembers_where_a_key_went_until_its_replica_is_gone_or_it_is_old():
    affinity = Affinity(capacity=2)
    assert affinity.prefer("k1", {"a", "b"}) is None  # a new key: the less loaded replica takes it
    affinity.record("k1", "a")
    assert affinity.prefer("k1", {"a", "b"}) == "a"
    assert affinity.prefer("k1", {"b"}) is None  # its replica went away: placed anew
    affinity.record("k2", "b")
    affinity.prefer("k1", {"a", "b"})  # k1 used again: k2 is now the oldest
    affinity.record("k3", "a")
    assert affinity.prefer("k2", {"a", "b"}) is None and affinity.prefer("k1", {"a", "b"}) == "a"


async def _streaming_app(scope, receive, send):
    assert (await receive())["body"] == b"ping"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-path", scope["path"].encode())]})
    for part in (b"one", b"two"):
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def test_asgi_call_yields_the_apps_messages_in_order():
    async def run():
        request = {"method": "POST", "path": "/v1/x", "query_string": b"", "headers": []}
        return [m async for m in asgi_call(_streaming_app, request, b"ping")]

    messages = asyncio.run(run())
    assert messages[0]["status"] == 200 and messages[0]["headers"] == [(b"x-path", b"/v1/x")]
    assert [m["body"] for m in messages[1:]] == [b"one", b"two", b""]


def test_closing_the_call_early_tells_the_app_the_client_went_away():
    seen = []

    async def endless(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        seen.append((await receive())["type"])  # waits until the caller goes away

    async def run():
        request = {"method": "GET", "path": "/", "query_string": b"", "headers": []}
        calls = asgi_call(endless, request, b"")
        assert (await calls.__anext__())["status"] == 200
        await calls.aclose()

    asyncio.run(run())
    assert seen == ["http.disconnect"]
