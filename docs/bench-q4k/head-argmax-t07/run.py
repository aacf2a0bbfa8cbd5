import math, statistics, sys, json
import specdec.proposers.head as H
from specdec.proposers.base import draft_token as sampled_draft
from specdec.runtime import elementwise
from specdec.bench.jobs import Bench, load_workloads
from specdec.models import registry
from specdec.sampling import SamplingParams

def argmax_draft(logits, params, generator, vocab_ids, vocab_size, who):
    best = elementwise.argmax(logits)
    return (best if vocab_ids is None else vocab_ids[best]).unsqueeze(1), None

T = float(sys.argv[1]); per = int(sys.argv[2]); seeds = int(sys.argv[3]); kind = sys.argv[4] if len(sys.argv) > 4 else "hybrid-head"
b = Bench(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT, "q4k", 96, 4, 8)
gen = b.gen
rows = []; n = 0
confs = ["plain", "sampled", "argmax"]
for i in range(per):
    for cat, spec in load_workloads().items():
        ids = b.encode(spec["prompts"][i])
        for s in range(seeds):
            order = confs if n % 2 == 0 else confs[::-1]; n += 1
            for c in order:
                H.draft_token = argmax_draft if c == "argmax" else sampled_draft
                r = gen.generate([ids], SamplingParams(temperature=T), 96, k=0 if c == "plain" else "auto", seed=s + 100 * i,
                                 proposer="none" if c == "plain" else kind)[0]
                m = r.batch_metrics.to_dict()
                rows.append({"c": c, "cat": cat, "i": i, "s": s, "tps": m["throughput_tok_s"], "tpc": m["tokens_per_call"]})
geo = lambda v: math.exp(statistics.mean(map(math.log, v)))
P = {(r["cat"], r["i"], r["s"]): r for r in rows if r["c"] == "plain"}
for c in confs[1:]:
    mine = [r for r in rows if r["c"] == c]
    sp = [r["tps"] / P[(r["cat"], r["i"], r["s"])]["tps"] for r in mine]
    cats = {}
    for r, x in zip(mine, sp): cats.setdefault(r["cat"], []).append(x)
    print(c, f"geo {geo(sp):.3f}", "median-of-cats", round(statistics.median(statistics.median(v) for v in cats.values()), 3), "tpc", round(statistics.mean(r["tpc"] for r in mine), 2), " ".join(f"{k} {statistics.median(v):.2f}" for k, v in cats.items()))
json.dump(rows, open(f"/tmp/sim/argmax-{T}-{kind}.json", "w"))
