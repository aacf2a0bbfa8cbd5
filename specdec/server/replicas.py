"""The OpenAI server as Ray Serve replicas (``specdec serve --replicas N``; ``pip install -e '.[ray]'``).

Each replica is the single-process server's FastAPI application (:func:`create_app`) over its
own engine, with continuous batching inside it; Ray Serve runs the replicas, restarts the ones
that die, scales their number between bounds and checks their health. In front of them a small
router deployment takes every HTTP request and sends a conversation's turns to the replica that
holds its KV in its prefix cache (:mod:`specdec.server.routing`); ``routing="balance"`` leaves
the choice to Serve's default (the less loaded of two random replicas).

Why any replica gives the same answer: the runtime is batch invariant and a request with a seed
is sampled from its own generator, so a greedy answer, or a seeded one, does not depend on which
replica ran it or on what else that replica was running. A client that retries a request after
its replica died gets exactly what the dead replica would have sent.

Every response names the replica that computed it (header ``x-specdec-replica``). Each
replica serves its own ``/health`` and ``/metrics`` (whichever replica the proxy picks); the
deployment's whole state is at ``/cluster/health`` and ``/cluster/metrics`` (every replica's
samples, labelled ``replica``), served by a small second deployment that asks every replica.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from specdec.server.routing import ROUTINGS
from specdec.server.scheduler import ServeConfig

APP = "specdec"  # the Serve application of the replicas
CLUSTER_APP = "specdec-cluster"  # the aggregate /cluster endpoints
DEPLOYMENT = "SpecdecReplica"
ROUTER = "SpecdecRouter"  # the HTTP entry point in front of the replicas


class RayMissing(RuntimeError):
    pass


def require_ray():
    """Import Ray Serve, or say how to install it."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise RayMissing("replicas need Ray Serve, which is not installed: pip install -e '.[ray]' "
                         "(the single-process server needs nothing more)") from None
    return ray, serve


@dataclass
class ReplicaSpec:
    """What each replica loads and how it serves: the arguments of :meth:`TextGenerator.load`,
    the server's :class:`ServeConfig`, and the torch threads it runs with."""

    target: str
    draft: str | None = None
    dtype: str | None = None
    draft_dtype: str | None = None
    head: str | None = "auto"
    config: ServeConfig = field(default_factory=ServeConfig)
    model_name: str | None = None
    threads: int = 1


@dataclass
class Scaling:
    """A fixed number of replicas, or autoscaling between ``min_replicas`` and ``max_replicas``
    towards ``target_ongoing`` requests in flight per replica."""

    replicas: int = 2
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing: float = 8.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("min_replicas and max_replicas go together (autoscaling)")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if self.target_ongoing <= 0:
            raise ValueError(f"target_ongoing must be > 0, got {self.target_ongoing}")

    def options(self) -> dict:
        if self.min_replicas is None:
            return {"num_replicas": self.replicas}
        return {"autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                       "initial_replicas": max(self.min_replicas, min(self.replicas, self.max_replicas)),
                                       "target_ongoing_requests": self.target_ongoing}}


def application(spec: ReplicaSpec, scaling: Scaling, routing: str = "prefix"):
    """The two Serve applications: the router and its replicas (route ``/``) and the aggregate
    (``/cluster``). ``routing``: "prefix" sends a conversation's turns to one replica (see
    :mod:`specdec.server.routing`); "balance" leaves the choice to Serve's default router."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    ray, serve = require_ray()
    from ray.serve.config import RequestRouterConfig

    router_config = RequestRouterConfig(request_router_class="specdec.server.prefix_router.PrefixRouter")
    replicas = serve.deployment(_replica_class(), name=DEPLOYMENT, ray_actor_options={"num_cpus": spec.threads},
                                max_ongoing_requests=spec.config.max_batch + spec.config.max_queue,
                                health_check_period_s=5, health_check_timeout_s=60,
                                **({"request_router_config": router_config} if routing == "prefix" else {}),
                                **scaling.options())
    router = serve.deployment(_router_class(), name=ROUTER, ray_actor_options={"num_cpus": 0},
                              max_ongoing_requests=100_000)
    return router.bind(replicas.bind(spec), spec.config.max_request_bytes), cluster_application()


def _replica_class():
    """One replica: the single-process server's application over its own engine, called by the
    router through :meth:`http` (the replica has no HTTP route of its own)."""
    ray, serve = require_ray()

    class SpecdecReplica:
        def __init__(self, spec: ReplicaSpec) -> None:
            import torch

            from specdec.api import TextGenerator
            from specdec.server.app import create_app

            torch.set_num_threads(spec.threads)
            self.replica = serve.get_replica_context().replica_id.unique_id
            gen = TextGenerator.load(spec.target, spec.draft, spec.dtype, spec.draft_dtype, head=spec.head)
            self.server = create_app(gen, spec.config, spec.model_name, engine_thread=False, replica=self.replica)
            self.server.state.scheduler.start()
            self.started = time.time()

        async def http(self, request: dict, body: bytes, route_key: str | None = None):
            """The ASGI messages of one HTTP request (``route_key``: read by the request router)."""
            from specdec.server.routing import asgi_call

            async for message in asgi_call(self.server, request, body):
                yield message

        def check_health(self) -> None:
            """Serve's health check: the engine's worker thread must be alive."""
            if self.server.state.scheduler.stopped:
                raise RuntimeError("the engine's worker thread has stopped")

        def status(self) -> dict:
            """This replica's health and Prometheus text (for the aggregate endpoints)."""
            from prometheus_client import generate_latest

            scheduler = self.server.state.scheduler
            return {"replica": self.replica, "pid": os.getpid(), "uptime_s": time.time() - self.started,
                    "running": len(scheduler.engine.rows), "waiting": scheduler.waiting(),
                    "metrics": generate_latest(scheduler.metrics.registry).decode()}

        def __del__(self) -> None:
            self.server.state.scheduler.stop()

    return SpecdecReplica


def _router_class():
    """The HTTP entry point: reads a request's body, computes its routing key and streams the
    chosen replica's response back unchanged."""
    ray, serve = require_ray()

    @serve.ingress()
    class SpecdecRouter:
        def __init__(self, replicas, max_request_bytes: int) -> None:
            self.replicas, self.limit = replicas.options(stream=True), max_request_bytes

        def __serve_build_asgi_app__(self):
            async def app(scope, receive, send) -> None:  # a function: uvicorn takes a bound method for ASGI 2
                await self.forward(scope, receive, send)

            return app

        async def forward(self, scope, receive, send) -> None:
            from specdec.server.routing import route_key

            if scope["type"] == "lifespan":
                return await _lifespan(receive, send)
            body = await _read_body(receive, self.limit + 1)  # over the limit: the replica answers 413
            request = {"method": scope["method"], "path": scope["path"], "headers": list(scope["headers"]),
                       "query_string": scope.get("query_string", b"")}
            stream = self.replicas.http.remote(request, body, route_key=route_key(scope["path"], request["headers"], body))
            await _relay(stream, send)

    return SpecdecRouter


async def _lifespan(receive, send) -> None:
    while (message := await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def _read_body(receive, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes of it."""
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return body
        body = (body + message.get("body", b""))[:limit]
        if not message.get("more_body", False):
            return body


async def _relay(stream, send) -> None:
    """Send the replica's messages on. A replica that fails before its response started gives a
    503; one that fails during it ends the response where it stands (a stream without its end)."""
    started = False
    try:
        async for message in stream:
            started = started or message["type"] == "http.response.start"
            await send(message)
    except Exception as exc:  # the replica died or failed: Ray's errors, whatever their type
        if started:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        body = json.dumps({"error": {"message": f"the replica failed: {type(exc).__name__}", "type": "server_error",
                                     "code": 503}}).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    except BaseException:  # cancelled: the client went away
        stream.cancel()
        raise


def cluster_application():
    """``/cluster/health`` and ``/cluster/metrics``: every replica's state, gathered by broadcast."""
    ray, serve = require_ray()
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    app = FastAPI(title="specdec cluster")

    @serve.deployment(name="SpecdecCluster", ray_actor_options={"num_cpus": 0})
    @serve.ingress(app)
    class SpecdecCluster:
        def __init__(self) -> None:
            self.replicas = serve.get_deployment_handle(DEPLOYMENT, app_name=APP)

        async def _statuses(self) -> list[dict]:
            """Every live replica's :meth:`status` (a replica that does not answer within 30 s,
            or fails, is left out: /cluster/health then counts fewer replicas)."""
            results = await self.replicas.broadcast("status").results_async(timeout_s=30, return_exceptions=True)
            return [r for r in results if isinstance(r, dict)]

        @app.get("/health")
        async def health(self) -> dict:
            statuses = await self._statuses()
            return {"status": "ok" if statuses else "no replicas", "replicas": len(statuses),
                    "running": sum(s["running"] for s in statuses), "waiting": sum(s["waiting"] for s in statuses),
                    "per_replica": [{k: v for k, v in s.items() if k != "metrics"} for s in statuses]}

        @app.get("/metrics")
        async def metrics(self) -> PlainTextResponse:
            return PlainTextResponse(merge_metrics([(s["replica"], s["metrics"]) for s in await self._statuses()]))

    return SpecdecCluster.bind()


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """Prometheus text of several replicas as one exposition: each sample gains a ``replica``
    label (``sum by`` in PromQL gives the deployment's totals), each family's HELP/TYPE once."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in texts:
        for family in text_string_to_metric_families(text):
            help_, type_, lines = families.setdefault(family.name, (family.documentation, family.type, []))
            for sample in family.samples:
                labels = {**sample.labels, "replica": replica}
                body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{sample.name}{{{body}}} {sample.value}")
    out = []
    for name, (help_, type_, lines) in families.items():
        name = name + "_total" if type_ == "counter" else name  # as prometheus_client writes them
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {type_}", *lines]
    return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def deploy(spec: ReplicaSpec, scaling: Scaling, host: str = "127.0.0.1", port: int = 8000,
           address: str | None = None, routing: str = "prefix") -> None:
    """Start (or join, with ``address``) a Ray cluster, deploy the replicas and the aggregate, and
    wait for them to be ready; :func:`serve_replicas` also blocks until interrupted."""
    ray, serve = require_ray()
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    entry, cluster = application(spec, scaling, routing)
    serve.run(entry, name=APP, route_prefix="/")
    serve.run(cluster, name=CLUSTER_APP, route_prefix="/cluster")


def serve_replicas(spec: ReplicaSpec, scaling: Scaling, host: str, port: int, address: str | None,
                   routing: str = "prefix") -> None:
    """``specdec serve --replicas N``: deploy, then wait for Ctrl-C / SIGTERM and shut down."""
    import signal

    ray, serve = require_ray()
    deploy(spec, scaling, host, port, address, routing)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
