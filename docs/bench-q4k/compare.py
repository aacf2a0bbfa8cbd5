"""q4 against q4k, same code, runs alternated (q4-1, q4k-1, q4k-2, q4-2; argv[1]: the prefix, requant or exact): per method, tokens/s
of each prompt (end to end, to EOS) for q4k over q4 (geo-mean over prompts), each side's
speed-up over its own plain decoding, tokens per call, plain TPOT."""
import json, math, statistics, sys
from pathlib import Path

here = Path(__file__).parent


def load(d):
    rows = [json.loads(l) for l in open(here / d / "runs.jsonl")]
    return {(r["method"], r["category"], r["prompt"], r["temperature"]): r for r in rows}


def geo(v):
    return math.exp(statistics.mean(map(math.log, v)))


prefix = sys.argv[1] if len(sys.argv) > 1 else "exact"
pairs = [(f"{prefix}-q4-1", f"{prefix}-q4k-1"), (f"{prefix}-q4-2", f"{prefix}-q4k-2")]
for a, b in pairs:
    A, B = load(a), load(b)
    print(f"== {b} / {a} ==")
    for m in sorted({k[0] for k in A}):
        keys = [k for k in A if k[0] == m and k in B]
        abs_ratio = geo([B[k]["metrics"]["throughput_tok_s"] / A[k]["metrics"]["throughput_tok_s"] for k in keys])
        line = f"{m:12s} q4k/q4 tok/s {abs_ratio:.3f}"
        if m != "plain":
            for name, D in ((a, A), (b, B)):
                sp = geo([D[k]["metrics"]["throughput_tok_s"] / D[("plain",) + k[1:]]["metrics"]["throughput_tok_s"] for k in keys])
                code = [D[k]["metrics"]["throughput_tok_s"] / D[("plain",) + k[1:]]["metrics"]["throughput_tok_s"] for k in keys if k[1] == "code"]
                tpc = statistics.mean(D[k]["metrics"]["tokens_per_call"] for k in keys)
                line += f" | {name}: over plain {sp:.2f}x (code {statistics.median(code):.2f}x), tpc {tpc:.2f}"
        else:
            for name, D in ((a, A), (b, B)):
                line += f" | {name} TPOT {statistics.median(D[k]['metrics']['tpot_s'] for k in keys) * 1e3:.1f} ms"
        print(line)
    bad = [k for D in (A, B) for k in D if k[3] == 0.0 and k[0] != "plain" and D[k]["token_ids"] != D[("plain",) + k[1:]]["token_ids"]]
    same = sum(A[k]["token_ids"] == B[k]["token_ids"] for k in A if k[0] == "plain")
    print("greedy mismatches with own plain:", bad, f"| plain q4 == plain q4k on {same}/{sum(1 for k in A if k[0]=='plain')} prompts")
