"""q4 against q4k in ONE process, alternating per prompt (the machine's memory bandwidth drifts
on a minute scale, so runs of whole benches side by side are confounded by it).

For each prompt of the bench's six categories (first N per category) and each temperature, every
method runs on both runtimes back to back (order flipped every prompt), to EOS, seeded as the
bench. Writes runs.jsonl; prints per method the geo-mean over prompts of q4k/q4 tokens/s, each
runtime's speed-up over its own plain decoding (geo-mean, and code prompts' median), tokens per
call, and greedy identity with each runtime's own plain decoding.

    python docs/bench-q4k/interleaved.py OUT_DIR [prompts per category] [temperatures]
"""
import json, math, statistics, sys
from pathlib import Path

from specdec.bench.jobs import Bench, load_workloads
from specdec.models import registry

out = Path(sys.argv[1])
per = int(sys.argv[2]) if len(sys.argv) > 2 else 3
temps = [float(t) for t in (sys.argv[3] if len(sys.argv) > 3 else "0,0.7").split(",")]
methods = ["plain", "hybrid_head", "draft_k4"]
out.mkdir(parents=True, exist_ok=True)
benches = {d: Bench(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT, d, 96, 4, 8) for d in ("q4", "q4k")}
rows = []
log = open(out / "runs.jsonl", "w")
n = 0
for i in range(per):
    for cat, spec in load_workloads().items():
        if i >= len(spec["prompts"]):
            continue
        for t in temps:
            order = ("q4", "q4k") if n % 2 == 0 else ("q4k", "q4")
            n += 1
            for m in methods:
                if t > 0 and "_k" in m:
                    continue
                for d in order:
                    b = benches[d]
                    r = b.run(m, b.encode(spec["prompts"][i]), t, seed=i, stop_at_eos=True)
                    rec = {"dtype": d, "method": m, "category": cat, "prompt": i, "temperature": t,
                           "token_ids": r["token_ids"], "metrics": r["metrics"]}
                    log.write(json.dumps(rec) + "\n"); log.flush()
                    rows.append(rec)
            print(f"{cat} {i} T={t} done", flush=True)

geo = lambda v: math.exp(statistics.mean(map(math.log, v)))  # noqa: E731
R = {(r["dtype"], r["method"], r["category"], r["prompt"], r["temperature"]): r for r in rows}
for t in temps:
    print(f"\n## T = {t}")
    for m in methods:
        keys = [k[2:] for k in R if k[0] == "q4" and k[1] == m and k[4] == t]
        if not keys:
            continue
        tps = lambda d, k: R[(d, m) + k]["metrics"]["throughput_tok_s"]  # noqa: E731
        line = f"{m:12s} q4k/q4 tok/s {geo([tps('q4k', k) / tps('q4', k) for k in keys]):.3f}"
        for d in ("q4", "q4k"):
            if m == "plain":
                line += f" | {d} TPOT {statistics.median(R[(d, m) + k]['metrics']['tpot_s'] for k in keys) * 1e3:.1f} ms"
                continue
            sp = [tps(d, k) / R[(d, "plain") + k]["metrics"]["throughput_tok_s"] for k in keys]
            code = [s for s, k in zip(sp, keys) if k[0] == "code"]
            tpc = statistics.mean(R[(d, m) + k]["metrics"]["tokens_per_call"] for k in keys)
            same = all(R[(d, m) + k]["token_ids"] == R[(d, "plain") + k]["token_ids"] for k in keys) if t == 0 else "-"
            line += f" | {d}: {geo(sp):.2f}x over its plain (code {statistics.median(code):.2f}x), tpc {tpc:.2f}, greedy identical {same}"
        print(line)
