import json, sys, statistics, math, collections
def load(d):
    rows = [json.loads(l) for l in open(f"{d}/runs.jsonl")]
    return {(r['method'], r['category'], r['prompt'], r['temperature']): r for r in rows}
sides = sys.argv[1:]
data = {s: load(s) for s in sides}
cats = ["multi_turn", "translation", "summarization", "qa", "math", "code"]
for s in sides:
    D = data[s]
    methods = sorted({k[0] for k in D} - {"plain"})
    temps = sorted({k[3] for k in D})
    print(f"== {s}: speed-up over plain (median per category, then median of categories) ==")
    for t in temps:
        for m in methods:
            per = {}
            for c in cats:
                v = [D[(m, c, p, t)]['metrics']['throughput_tok_s'] / D[('plain', c, p, t)]['metrics']['throughput_tok_s']
                     for (mm, cc, p, tt) in D if mm == m and cc == c and tt == t and ('plain', c, p, t) in D]
                if v: per[c] = statistics.median(v)
            allp = [D[k]['metrics']['throughput_tok_s'] / D[('plain',) + k[1:]]['metrics']['throughput_tok_s'] for k in D if k[0] == m and k[3] == t]
            tpc = statistics.mean(D[k]['metrics']['tokens_per_call'] for k in D if k[0] == m and k[3] == t)
            print(f"T={t} {m:12s} " + " ".join(f"{c[:5]} {per.get(c, float('nan')):.2f}" for c in cats) + f" | median cat {statistics.median(per.values()):.2f} | geo all {math.exp(statistics.mean(map(math.log, allp))):.2f} | tpc {tpc:.2f}")
    plain_step = statistics.median(D[k]['metrics']['tpot_s'] for k in D if k[0] == 'plain') * 1e3
    print(f"plain TPOT median {plain_step:.1f} ms")
    # greedy identity
    bad = [k for k in D if k[3] == 0.0 and k[0] != 'plain' and D[k]['token_ids'] != D[('plain',) + k[1:]]['token_ids']]
    print("greedy mismatches:", bad)
