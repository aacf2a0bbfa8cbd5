"""Paired summary of these bench runs (BENCHMARKS §18): python analyze.py base-1 main-1 base-2 main-2.
Per run: the plain step, and per method the end-to-end speed-up over plain in the same run, tokens per
target call, draft time per drafted token as a fraction of the plain step, greedy identity."""
import json, sys, statistics, glob, collections
for d in sys.argv[1:]:
    runs = [json.loads(l) for l in open(f"{d}/runs.jsonl")]
    by = collections.defaultdict(dict)
    for r in runs:
        by[r["method"]][(r["category"], r["prompt"], r["temperature"])] = r
    plain = by["plain"]
    step = statistics.median(r["metrics"]["time_breakdown_s"]["target_forward"] / max(1, r["metrics"]["target_calls"] - 1) for r in plain.values())
    out = [f"{d.split('/')[-1]}: plain step {step*1e3:.1f} ms, tok/s {statistics.median(r['metrics']['generated_tokens']/r['metrics']['total_s'] for r in plain.values()):.1f}"]
    for m, rs in by.items():
        if m == "plain": continue
        sp = [plain[k]["metrics"]["total_s"] / r["metrics"]["total_s"] for k, r in rs.items()]
        same = sum(r["token_ids"] == plain[k]["token_ids"] for k, r in rs.items())
        a = [r["metrics"] for r in rs.values()]
        dcost = statistics.median(x["time_breakdown_s"]["draft"] / max(1, x["acceptance"]["drafted_tokens"]) for x in a) / step
        tpc = statistics.median(x["tokens_per_call"] for x in a)
        out.append(f"  {m}: speed-up median {statistics.median(sp):.2f} (per prompt {' '.join('%.2f' % s for s in sp)}), tok/call {tpc:.2f}, draft/token {dcost:.2f} of a step, identical {same}/{len(rs)}")
    print("\n".join(out))
