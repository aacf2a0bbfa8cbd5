"""Prefix routing for the replicas (``specdec serve --replicas N``): a conversation's turns go to
the replica that holds its KV.

Each replica's prefix cache keeps the KV of the prompts and answers it served; a later turn
resends the whole conversation, so it finds its history only on the replica that served the
earlier turns. Serve's default router picks two replicas at random and takes the less loaded: with
two replicas, 81-84% of later turns found their history (a closed-loop client often lands back on
the replica its last turn just left; docs/BENCHMARKS.md, "Does a conversation find its history").

The routing key of a request is what stays the same across a conversation's turns: for chat,
the messages up to and including the first user message (a shared system prompt alone does not
decide: conversations that share it still spread over the replicas, each of which caches it
once); for a completion, the first :data:`PROMPT_KEY_CHARS` characters of the prompt. A client
may name the key itself with the header ``x-specdec-route-key`` (a session id, say).

The first request of a key goes to the less loaded replica (as Serve's default would send it:
it has no history anywhere yet), and the router remembers where it went (:class:`Affinity`);
the key's later requests go there. A replica that is full (``max_ongoing_requests``) passes its
requests to the others; a key whose replica went away is placed anew. Hashing keys to replicas
instead (rendezvous hashing, tried first) left the replicas unevenly loaded with few
conversations: at 4 clients on 2 replicas throughput read 0.88x Serve's default.

The HTTP path: Serve's proxy sees a request's headers but not its body, so the entry point is a
small router deployment that reads the body, computes the key and forwards the request to the
replicas through a handle; the replicas' own request router (:class:`specdec.server.prefix_router.
PrefixRouter`) reads the key and ranks the replicas. Each replica runs the single-process
server's ASGI application in-process (:func:`asgi_call`) and streams its messages back unchanged.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Collection, Sequence

ROUTINGS = ("prefix", "balance")  # by conversation (this module), or Serve's default (power of two choices)
PROMPT_KEY_CHARS = 256  # a completion's routing key: its prompt's first characters
ROUTE_HEADER = b"x-specdec-route-key"


def route_key(path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> str | None:
    """The routing key of a request (see the module's docstring); None: no preference (a
    request that is not a completion, or whose body does not parse: the replica answers it)."""
    for name, value in headers:
        if name.lower() == ROUTE_HEADER:
            return "header:" + value.decode("latin-1")
    if not path.startswith("/v1/"):
        return None
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    messages = request.get("messages")
    if isinstance(messages, list):
        first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
                          len(messages) - 1)
        return "chat:" + _digest(json.dumps(messages[: first_user + 1], sort_keys=True))
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return "prompt:" + _digest(prompt[:PROMPT_KEY_CHARS])
    return None


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class Affinity:
    """Which replica each routing key went to, for the most recent ``capacity`` keys (least
    recently used first out). One router process holds it: the deployment has one router."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity, self.where = capacity, OrderedDict()

    def prefer(self, key: str, live: Collection[str]) -> str | None:
        """The live replica ``key`` went to, or None (a new key, or its replica went away)."""
        name = self.where.get(key)
        if name is None or name not in live:
            return None
        self.where.move_to_end(key)
        return name

    def record(self, key: str, name: str) -> None:
        self.where[key] = name
        self.where.move_to_end(key)
        while len(self.where) > self.capacity:
            self.where.popitem(last=False)


async def asgi_call(app, request: dict, body: bytes) -> AsyncIterator[dict]:
    """Run one HTTP request through the ASGI application ``app`` in this process and yield the
    messages it sends (``http.response.start``, then ``http.response.body`` ones) as they come.
    ``request``: method, path, query_string (bytes), headers ([(bytes, bytes)]). Closing the
    iterator early (the client went away) tells the app that the client disconnected."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "scheme": "http", "root_path": "", "client": None, "server": None, "method": request["method"],
             "path": request["path"], "raw_path": request["path"].encode(), "query_string": request["query_string"],
             "headers": request["headers"]}
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
        task.result() if task.done() else None  # an exception the app raised after its last message
    finally:
        disconnected.set()
        if not task.done():
            await asyncio.wait({task}, timeout=30)
