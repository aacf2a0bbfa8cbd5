"""Serve's request router for the replicas: a routing key's requests go where its first went (see
:mod:`specdec.server.routing`). Imports Ray: only the router deployment's handle loads it."""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from specdec.server.routing import Affinity


class PrefixRouter(RequestRouter):
    """Ranks the live replicas for a request: ``[[the key's replica], [the others]]`` when the key
    was seen, else one rank of all in random order (Serve takes the least loaded of a rank, and a full replica's
    requests go to the next rank). The replica each keyed request was routed to is remembered."""

    def initialize_state(self, **kwargs) -> None:
        self.affinity = Affinity()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get("route_key") if pending_request is not None else None
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        name = self.affinity.prefer(key, by_name) if key is not None else None
        if name is None:  # in random order: Serve takes the first of equally loaded replicas
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        return [[by_name[name]], [r for n, r in by_name.items() if n != name]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        key = pending_request.kwargs.get("route_key")
        if key is not None:
            self.affinity.record(key, replica_id.unique_id)
