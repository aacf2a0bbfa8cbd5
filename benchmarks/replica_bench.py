"""One server process against Ray Serve replicas on the same machine (`specdec serve` against
`specdec serve --replicas N --threads-per-replica T`).

The same load as ``serve_bench.py`` (clients each sending streaming chat requests of the bench's
workload prompts, greedy), against each server configuration, the configurations alternating
from round to round. Reports aggregate throughput and median TTFT per level, and checks that
every answer is the same whichever server (and replica) gave it.

    .venv/bin/python benchmarks/replica_bench.py --out replica-out
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from serve_bench import finish, start_server, stop_servers  # noqa: E402

from specdec.bench.jobs import load_workloads  # noqa: E402
from specdec.models import registry  # noqa: E402
from specdec.runtime.linear import DEFAULT_DTYPE  # noqa: E402


def request(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800)
    r.raise_for_status()
    out = r.json()
    return {"latency_s": time.perf_counter() - start, "tokens": out["usage"]["completion_tokens"],
            "text": out["choices"][0]["message"]["content"], "replica": r.headers.get("x-specdec-replica")}


def run_level(url: str, prompts: list, clients: int, requests: int, max_tokens: int) -> dict:
    jobs = [[prompts[(c * requests + i) % len(prompts)] for i in range(requests)] for c in range(clients)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(lambda mine: [request(url, m, max_tokens) for m in mine], jobs) for r in rs]
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall,
            "median_latency_s": statistics.median(r["latency_s"] for r in results),
            "replicas_seen": len({r["replica"] for r in results}), "texts": [r["text"] for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--dtype", default=DEFAULT_DTYPE)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads-per-replica", type=int, default=1)
    ap.add_argument("--clients", default="4,16")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("replica-out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = [p if isinstance(p, list) else [{"role": "user", "content": p}]
               for cat in load_workloads().values() for p in cat["prompts"]]
    configs = {"1 process": [], f"{args.replicas} replicas": ["--replicas", str(args.replicas), "--threads-per-replica",
                                                               str(args.threads_per_replica)]}
    runs, servers = [], {}
    try:
        for name, extra in configs.items():
            servers[name] = start_server(args, "default", extra)
            request(servers[name][1], prompts[0], 4)
        todo = [(rnd, name, int(c)) for rnd in range(args.rounds) for c in args.clients.split(",")
                for name in (list(configs) if rnd % 2 == 0 else list(configs)[::-1])]
        for rnd, name, clients in tqdm(todo, desc="replica bench", unit="level"):
            runs.append({"round": rnd, "config": name, **run_level(servers[name][1], prompts, clients, args.requests,
                                                                   args.max_tokens)})
            with (args.out / "runs.jsonl").open("a") as f:
                f.write(json.dumps(runs[-1]) + "\n")
    finally:
        stop_servers(servers)
    lines = ["| clients | server | throughput tok/s (median of rounds) | vs 1 process (same round) | median latency s | "
             "replicas that answered | answers identical to 1 process |", "|---|---|---|---|---|---|---|"]
    by = {(r["round"], r["config"], r["clients"]): r for r in runs}
    for clients in sorted({r["clients"] for r in runs}):
        for name in configs:
            mine = [r for r in runs if (r["config"], r["clients"]) == (name, clients)]
            ref = [by[(r["round"], "1 process", clients)] for r in mine]
            lines.append(f"| {clients} | {name} | {statistics.median(r['throughput_tok_s'] for r in mine):.1f} | "
                         f"{statistics.median(a['throughput_tok_s'] / b['throughput_tok_s'] for a, b in zip(mine, ref)):.2f}x | "
                         f"{statistics.median(r['median_latency_s'] for r in mine):.1f} | "
                         f"{max(r['replicas_seen'] for r in mine)} | "
                         f"{'yes' if all(a['texts'] == b['texts'] for a, b in zip(mine, ref)) else 'NO'} |")
    finish(args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
