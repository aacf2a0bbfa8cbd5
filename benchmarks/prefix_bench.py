"""Prefix caching in `specdec serve`: multi-turn chat with a shared system prompt, with and
without the cache.

Each client holds conversations of ``--turns`` turns: the first turn is the shared system prompt
plus one of the bench's user prompts; each later turn resends the whole conversation (the
assistant's answers included, as chat clients do) plus a follow-up question. Greedy, streamed.
Two `specdec serve` processes run side by side on loopback: one with the default prefix cache,
one with ``--prefix-cache-mb 0``; for every (round, clients) level they are measured one after
the other, in alternating order from round to round, and every answer of the one is compared
with the other's (greedy: they must be identical). With ``--replicas N`` the two servers are
instead ``specdec serve --replicas N`` with prefix routing (the default) and with
``--routing balance``, both with the cache: the question is then whether a later turn reaches
the replica that holds its history.

Reported per configuration and concurrency: the median time to first token of first turns and
of later turns, aggregate throughput (completion tokens / wall time), and the prompt tokens
served from the cache, and the later turns that found their whole earlier prompt in the cache
(up to its last partial block: a hit). Results go to ``runs.jsonl`` (resumable) and ``report.md`` in ``--out``.

    .venv/bin/python benchmarks/prefix_bench.py --out prefix-out
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
from serve_bench import engine_counters, finish, start_server, stop_servers  # noqa: E402

from specdec.bench.jobs import load_workloads  # noqa: E402
from specdec.models import registry  # noqa: E402
from specdec.core.prefix_cache import BLOCK  # noqa: E402
from specdec.runtime.linear import DEFAULT_DTYPE  # noqa: E402

SYSTEM = (
    "You are a careful senior software engineer and technical writer working for a company that builds "
    "developer tools. Answer the user's questions accurately and concisely. When you write code, use Python 3 "
    "unless the user asks for another language, follow PEP 8, add type hints, and keep functions small. When "
    "you explain, start with the answer, then give the reasoning in short paragraphs. Prefer concrete examples "
    "to abstract descriptions. If a question is ambiguous, state the assumption you make and answer under it. "
    "Never invent APIs: if you are not sure a function exists, say so. Keep answers under two hundred words "
    "unless the user asks for more detail. Use Markdown for lists and code blocks. Be polite but do not add "
    "filler sentences, greetings or closing remarks. When the user asks for a comparison, use a table with one "
    "row per option. When the user asks for a plan, number the steps. When the user reports an error, ask for "
    "the full traceback only if the cause cannot be narrowed down from what they wrote."
)
FOLLOW_UPS = ["Make that shorter, in three sentences at most.", "Now give one concrete example.",
              "What is the most common mistake people make here?", "Summarize everything in one line."]


def turn(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, usage, text = None, None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                if c["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(c["delta"]["content"])
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    return {"ttft_s": (first or end) - start, "latency_s": end - start, "tokens": usage["completion_tokens"],
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "text": "".join(text)}


def conversation(url: str, user: str, turns: int, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    out = []
    for t in range(turns):
        result = turn(url, messages, max_tokens)
        out.append({**result, "turn": t})
        messages += [{"role": "assistant", "content": result["text"]}, {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
    return out


def run_level(url: str, users: list[str], clients: int, turns: int, max_tokens: int, metrics: str) -> dict:
    before = engine_counters(url, metrics)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        convs = list(pool.map(lambda u: conversation(url, u, turns, max_tokens), users[:clients]))
    wall = time.perf_counter() - start
    after = engine_counters(url, metrics)
    results = [r for c in convs for r in c]
    hits = [b["cached_tokens"] >= a["prompt_tokens"] - BLOCK for c in convs for a, b in zip(c, c[1:])]
    first = [r["ttft_s"] for r in results if r["turn"] == 0]
    later = [r["ttft_s"] for r in results if r["turn"] > 0]
    return {"clients": clients, "turns": turns, "tokens": sum(r["tokens"] for r in results), "wall_s": wall,
            "throughput_tok_s": sum(r["tokens"] for r in results) / wall,
            "median_ttft_first_turn_s": statistics.median(first),
            "median_ttft_later_turns_s": statistics.median(later) if later else None,
            "prompt_tokens": sum(r["prompt_tokens"] for r in results),
            "cached_tokens": sum(r["cached_tokens"] for r in results),
            "later_turn_hits": sum(hits), "later_turns": len(hits),
            "prefill_s": round(after.get("prefill", 0.0) - before.get("prefill", 0.0), 2),
            "texts": [r["text"] for r in results]}


def report(runs: list[dict], configs: tuple[str, str]) -> str:
    """One row per (clients, configuration); ratios against ``configs[1]`` in the same round."""
    ref = configs[1]
    lines = [f"| clients | server | rounds | throughput tok/s | vs {ref} (same round) | TTFT first turn s | "
             f"TTFT later turns s | later-turn TTFT, {ref} / this (same round) | prompt tokens cached | "
             "later turns that hit | engine prefill s | answers identical |", "|" + "---|" * 12]
    by = {(r["round"], r["config"], r["clients"]): r for r in runs}
    for clients in sorted({r["clients"] for r in runs}):
        for config in configs:
            mine = [r for r in runs if (r["config"], r["clients"]) == (config, clients)]
            if not mine:
                continue
            pairs = [(r, by.get((r["round"], ref, clients))) for r in mine]
            pairs = [(a, b) for a, b in pairs if b is not None]
            med = lambda key: statistics.median(r[key] for r in mine if r[key] is not None)  # noqa: E731
            thr = statistics.median(a["throughput_tok_s"] / b["throughput_tok_s"] for a, b in pairs) if pairs else float("nan")
            ttft = (statistics.median(b["median_ttft_later_turns_s"] / a["median_ttft_later_turns_s"] for a, b in pairs)
                    if pairs and mine[0]["turns"] > 1 else float("nan"))
            same = all(a["texts"] == b["texts"] for a, b in pairs)
            hits = f"{sum(r.get('later_turn_hits', 0) for r in mine)} / {sum(r.get('later_turns', 0) for r in mine)}"
            lines.append(f"| {clients} | {config} | {len(mine)} | {med('throughput_tok_s'):.1f} | "
                         f"{thr:.2f}x | {med('median_ttft_first_turn_s'):.2f} | {med('median_ttft_later_turns_s'):.2f} | "
                         f"{ttft:.2f}x | {sum(r['cached_tokens'] for r in mine)} / {sum(r['prompt_tokens'] for r in mine)} | "
                         f"{hits} | {med('prefill_s'):.1f} | {'yes' if same else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--dtype", default=DEFAULT_DTYPE)
    ap.add_argument("--proposer", default="default", help="the servers' proposer: default (`specdec serve`'s) or a name")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--turns", type=int, default=3, help="turns per conversation, each resending the whole history")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every level, the two servers alternating")
    ap.add_argument("--replicas", type=int, default=None,
                    help="compare N Ray Serve replicas with prefix routing against --routing balance "
                    "(pip install -e '.[ray]'; default: one process with the cache against one without)")
    ap.add_argument("--out", type=Path, default=Path("prefix-out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    runs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    done = {(r["round"], r["config"], r["clients"]) for r in runs}
    users = [p if isinstance(p, str) else p[-1]["content"] for name, cat in load_workloads().items()
             for p in cat["prompts"]]
    configs = {"cache": [], "nocache": ["--prefix-cache-mb", "0"]}
    if args.replicas:
        replicas = ["--replicas", str(args.replicas), "--threads-per-replica", "1"]
        configs = {"prefix routing": replicas, "balance routing": [*replicas, "--routing", "balance"]}
    todo = [(rnd, c, int(n)) for rnd in range(args.rounds) for n in args.clients.split(",")
            for c in (list(configs) if rnd % 2 == 0 else list(configs)[::-1]) if (rnd, c, int(n)) not in done]
    servers = {}
    try:
        for config in dict.fromkeys(c for _, c, _ in todo):
            servers[config] = start_server(args, args.proposer, configs[config])
            turn(servers[config][1], [{"role": "user", "content": "hi"}], 4)  # warm-up (not the system prompt)
        for rnd, config, clients in tqdm(todo, desc="prefix bench", unit="level"):
            # every level's conversations are new to the cache (only the system prompt is shared):
            # its own slice of the user prompts, the same for both servers
            levels = [int(n) for n in args.clients.split(",")]
            start = rnd * sum(levels) + sum(levels[: levels.index(clients)])
            mine = (users[start:] + users)[:clients]
            record = {"round": rnd, "config": config, "max_tokens": args.max_tokens, "dtype": args.dtype,
                      "proposer": args.proposer, **run_level(servers[config][1], mine, clients, args.turns, args.max_tokens,
                                 "/cluster/metrics" if args.replicas else "/metrics")}
            with log.open("a") as f:
                f.write(json.dumps(record) + "\n")
            runs.append(record)
    finally:
        stop_servers(servers)
    finish(args.out, report(runs, tuple(configs)))


if __name__ == "__main__":
    main()
