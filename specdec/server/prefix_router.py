"""Serve's request router for the replicas: the replica a request's routing key hashes to first,
the others after it (see :mod:`specdec.server.routing`). Imports Ray: only replicas load it."""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from specdec.server.routing import rendezvous


class PrefixRouter(RequestRouter):
    """Ranks the live replicas for a request: ``[[first for its key], [the others]]``. Serve takes
    the first rank's replica unless it is full, then the least loaded of the next rank. A request
    without a key (``route_key=None``) goes to the least loaded replica."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get("route_key") if pending_request is not None else None
        if key is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        first, *others = rendezvous(key, list(by_name))
        return [[by_name[first]], [by_name[name] for name in others]]
