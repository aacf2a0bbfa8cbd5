"""`specdec serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from specdec.cli.common import (UsageError, add_model_options, int_at_least, megabytes, port, speculation_of,
                                 with_default_draft)
from specdec.core.prefill import STEP_TOKENS
from specdec.core.prefix_cache import PREFIX_CACHE_MB
from specdec.server.routing import ROUTINGS


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run an OpenAI-compatible HTTP server (continuous batching, exact speculation)",
        description="Serve the target over HTTP: POST /v1/completions and /v1/chat/completions (with "
        "stream: true for server-sent events), GET /v1/models, /health and /metrics (Prometheus). "
        "Requests join and leave the running batch between steps. Greedy answers are those of the "
        "request run alone; a request with a seed is sampled reproducibly (the same answer whatever "
        "else runs). Decoding options are those of `specdec generate`; --seed seeds the streams of "
        "requests that bring no seed.",
    )
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=port, default=8000, help="TCP port, 0 to 65535 (0: any free one) (default: %(default)s)")
    p.add_argument("--max-request-bytes", type=int_at_least(1024), default=4 * 1024 * 1024,
                   help="largest request body; bigger ones get 413 before they are parsed (default: %(default)s, 4 MiB)")
    p.add_argument("--max-batch", type=int_at_least(1), default=16,
                   help="requests decoded together; more wait in the queue (default: %(default)s)")
    p.add_argument("--max-queue", type=int_at_least(1), default=64,
                   help="requests waiting for a batch row; beyond it new requests get 429 (default: %(default)s)")
    p.add_argument("--max-model-len", type=int_at_least(2), default=2048,
                   help="prompt + max_tokens per request; sizes each row's KV cache (default: %(default)s)")
    p.add_argument("--step-tokens", type=int_at_least(0), default=STEP_TOKENS,
                   help="positions one engine step computes (chunked prefill): the running rows' decoding "
                   "block first, then chunks of waiting prompts with the rest, so that a long prompt delays "
                   "the running rows by one chunk a step instead of its whole prefill, and the first of many "
                   "waiting requests starts before the others have prefilled; 0: every joining prompt "
                   "prefills whole in its first step (default: %(default)s)")
    p.add_argument("--prefix-cache-mb", type=megabytes, default=PREFIX_CACHE_MB,
                   help="memory (MiB) for the KV of earlier prompts and answers: a request that starts with "
                   "tokens an earlier one prefilled or generated (a shared system prompt, a conversation's "
                   "history) reuses their KV instead of recomputing it, with identical output; least recently "
                   "used blocks go first; 0 turns it off (default: %(default)s)")
    ray = p.add_argument_group("replicas (Ray Serve; pip install -e '.[ray]')", "Serve the same app as several "
                               "replicas, each one engine with continuous batching; any replica gives the same "
                               "answer (greedy, or with a seed). Each response names its replica (header "
                               "x-specdec-replica); /cluster/health and /cluster/metrics cover them all.")
    ray.add_argument("--replicas", type=int_at_least(1), default=None,
                     help="run N replicas under Ray Serve (without this option: one process, no Ray)")
    ray.add_argument("--min-replicas", type=int_at_least(0), default=None,
                     help="autoscale between --min-replicas and --max-replicas (with --replicas as the start)")
    ray.add_argument("--max-replicas", type=int_at_least(1), default=None, help="see --min-replicas")
    ray.add_argument("--target-ongoing-requests", type=float, default=8.0,
                     help="autoscaling aims at this many requests in flight per replica (default: %(default)s)")
    ray.add_argument("--threads-per-replica", type=int_at_least(1), default=None,
                     help="torch threads (and Ray CPUs) per replica, so that replicas on one machine do not "
                     "oversubscribe its cores (default: cores / replicas)")
    ray.add_argument("--routing", choices=ROUTINGS, default=None,
                     help="prefix: a conversation's turns go to the replica that holds its history's KV (keyed by "
                     "the messages up to the first user message, a completion's first 256 characters, or the "
                     "header x-specdec-route-key); balance: the less loaded of two random replicas, for "
                     "requests that share nothing (default: prefix)")
    ray.add_argument("--ray-address", default=None,
                     help="join a running Ray cluster (`ray start --head` prints its address; default: start a "
                     "local one for this command)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the target's name)")
    p.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:
    from specdec.api import TextGenerator
    from specdec.server import ServeConfig, serve

    spec = speculation_of(args)
    replicated = args.replicas is not None or args.min_replicas is not None or args.max_replicas is not None
    if not replicated:
        for flag, value in (("--threads-per-replica", args.threads_per_replica), ("--ray-address", args.ray_address),
                            ("--routing", args.routing)):
            if value is not None:
                raise UsageError(f"{flag} has no effect without --replicas")
    config = ServeConfig(speculation=spec, max_batch=args.max_batch, max_queue=args.max_queue,
                         max_model_len=args.max_model_len, seed=args.seed, max_request_bytes=args.max_request_bytes,
                         prefix_cache_mb=args.prefix_cache_mb, step_tokens=args.step_tokens or None)
    if replicated:
        return _run_replicas(args, spec, config)
    spec = with_default_draft(args, spec)
    config = replace(config, speculation=spec)
    gen = TextGenerator.load(args.target, args.draft, args.dtype, args.draft_dtype, head=args.head or "auto",
                             context=args.max_model_len)
    print(f"specdec: {spec.describe()}", file=sys.stderr)
    limit = gen.target.model.cfg.max_position_embeddings
    if args.max_model_len > limit:
        raise UsageError(f"--max-model-len {args.max_model_len} exceeds {gen.target.name}'s context length {limit}")
    serve(gen, config, args.host, args.port, args.served_model_name)
    return 0


def _run_replicas(args: argparse.Namespace, spec, config) -> int:
    import os

    from specdec.server.replicas import RayMissing, ReplicaSpec, Scaling, require_ray, serve_replicas

    try:
        require_ray()
    except RayMissing as exc:
        raise UsageError(f"--replicas: {exc}") from None
    replicas = args.replicas if args.replicas is not None else args.min_replicas or 1
    try:  # (the library's checks; its messages name the parameters: min_replicas is --min-replicas)
        scaling = Scaling(replicas, args.min_replicas, args.max_replicas, args.target_ongoing_requests)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    threads = args.threads_per_replica or max(1, (os.cpu_count() or 1) // replicas)
    spec = with_default_draft(args, spec)
    config = replace(config, speculation=spec)
    replica = ReplicaSpec(args.target, args.draft, args.dtype, args.draft_dtype, args.head or "auto", config,
                          args.served_model_name, threads)
    print(f"specdec: {spec.describe()}; {replicas} replica(s) under Ray Serve, {threads} thread(s) each", file=sys.stderr)
    serve_replicas(replica, scaling, args.host, args.port, args.ray_address, args.routing or "prefix")
    return 0
