"""`specdec serve` under concurrent clients: throughput and latency, speculative vs plain.

For each server configuration (``--methods``: "default" = what `specdec serve` speculates with
by default, "none" = plain decoding) and each concurrency level (``--clients``), that many
clients each send ``--requests`` streaming chat requests one after another (the bench's
workload prompts, all categories, greedy), and we record per request the time to first token,
the end-to-end latency and the completion tokens (from the final usage chunk). Aggregate
throughput = all completion tokens / wall time of the level. Each configuration runs as its own
`specdec serve` process on loopback, as a user would start it (the clients, in this process,
share the machine's 2 cores with it); where the engine's time went comes from its /metrics.

Every (method, clients) result is appended to ``runs.jsonl`` in ``--out`` as soon as it is
measured and skipped on a rerun (resumable); ``report.md`` is written at the end.

    .venv/bin/python benchmarks/serve_bench.py --out docs/bench-serve
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from tqdm import tqdm

from specdec.bench.jobs import load_workloads
from specdec.models import registry
from specdec.runtime.linear import DEFAULT_DTYPE


def start_server(args, method: str) -> tuple[subprocess.Popen, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "specdec", "serve", "--target", args.target, "--dtype", args.dtype, "--port", str(port),
           *([] if method == "default" else ["--proposer", method]), "--max-batch", str(args.max_batch), "--max-model-len", "1024",
           "--served-model-name", "bench"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"`{' '.join(cmd)}` exited with status {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            server.kill()
            raise TimeoutError("the server did not start")
        time.sleep(0.5)


def engine_seconds(url: str) -> dict[str, float]:
    """The engine's time by phase so far, from the server's Prometheus metrics."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("specdec_engine_seconds_total{"):
            out[line.split('phase="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def one_request(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, usage = None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    return {"ttft_s": (first or end) - start, "latency_s": end - start, "tokens": usage["completion_tokens"],
            "accepted_per_call": usage["speculative"]["accepted_per_call"]}


def run_level(url: str, prompts: list, clients: int, requests: int, max_tokens: int) -> dict:
    jobs = [[prompts[(c * requests + i) % len(prompts)] for i in range(requests)] for c in range(clients)]

    def client(mine):
        return [one_request(url, m, max_tokens) for m in mine]

    before = engine_seconds(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, jobs) for r in rs]
    wall = time.perf_counter() - start
    engine_s = {k: round(v - before.get(k, 0.0), 2) for k, v in engine_seconds(url).items()}
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "throughput_tok_s": tokens / wall,
            "median_ttft_s": statistics.median(r["ttft_s"] for r in results),
            "median_latency_s": statistics.median(r["latency_s"] for r in results),
            "median_request_tok_s": statistics.median(r["tokens"] / r["latency_s"] for r in results),
            "median_accepted_per_call": statistics.median(r["accepted_per_call"] for r in results),
            "engine_time_s": engine_s}  # where the engine's time went during the level


def report(runs: list[dict]) -> str:
    lines = ["| server | clients | requests | tokens | throughput tok/s | vs 1 client | vs plain | median TTFT s | "
             "median latency s | median per-request tok/s | accepted/call |", "|" + "---|" * 11]
    by = {(r["method"], r["clients"]): r for r in runs}
    for r in sorted(runs, key=lambda r: (r["method"], r["clients"])):
        one = by.get((r["method"], 1))
        plain = by.get(("none", r["clients"]))
        lines.append(f"| {r['method']} | {r['clients']} | {r['requests']} | {r['tokens']} | {r['throughput_tok_s']:.1f} | "
                     f"{r['throughput_tok_s'] / one['throughput_tok_s'] if one else float('nan'):.2f}x | "
                     f"{r['throughput_tok_s'] / plain['throughput_tok_s'] if plain else float('nan'):.2f}x | "
                     f"{r['median_ttft_s']:.2f} | {r['median_latency_s']:.1f} | {r['median_request_tok_s']:.1f} | "
                     f"{r['median_accepted_per_call']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--dtype", default=DEFAULT_DTYPE)
    ap.add_argument("--methods", default="none,default",
                    help="comma-separated: none, default (what `specdec serve` uses: hybrid over the head) or a proposer name")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, sent one after another")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("docs/bench-serve"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    runs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    done = {(r["method"], r["clients"]) for r in runs}
    prompts = [p if isinstance(p, list) else [{"role": "user", "content": p}]
               for cat in load_workloads().values() for p in cat["prompts"]]
    todo = [(m, int(c)) for m in args.methods.split(",") for c in args.clients.split(",") if (m, int(c)) not in done]
    bar = tqdm(todo, desc="serve bench", unit="level")
    for method in dict.fromkeys(m for m, _ in todo):
        server, url = start_server(args, method)
        try:
            one_request(url, prompts[0], 8)  # warm-up
            for m, clients in todo:
                if m != method:
                    continue
                bar.set_postfix(method=method, clients=clients)
                record = {"method": method, "max_tokens": args.max_tokens, "dtype": args.dtype,
                          **run_level(url, prompts, clients, args.requests if clients > 1 else 2 * args.requests,
                                      args.max_tokens)}
                with log.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                runs.append(record)
                bar.update()
        finally:
            server.terminate()
            server.wait(60)
    text = report(runs)
    (args.out / "report.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
