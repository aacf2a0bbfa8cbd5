"""In-process reproduction of serve_bench: C clients x R requests each, sequential per client,
through one Engine (as the server's Scheduler builds it); default vs none alternating."""
import sys, time, json, statistics
import torch
from specdec.api import TextGenerator, resolve_proposer
from specdec.engine import Engine, Request
from specdec.sampling import SamplingParams
from specdec.bench.jobs import load_workloads
from specdec.models import registry

dtype = sys.argv[1] if len(sys.argv) > 1 else "q4k"
clients = int(sys.argv[2]) if len(sys.argv) > 2 else 4
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
reqs = int(sys.argv[4]) if len(sys.argv) > 4 else 3
torch.manual_seed(0)
gen = TextGenerator.load(registry.DEFAULT_TARGET, dtype=dtype)
prompts = [p if isinstance(p, list) else [{"role": "user", "content": p}]
           for cat in load_workloads().values() for p in cat["prompts"]]
ids = [gen.encode_chat(m) for m in prompts]
capacity = 1024 + 8 + 2

def run(method, offset):
    kind = resolve_proposer(None if method == "default" else method, draft=False, head=True)
    prop = gen.make_proposer(kind, capacity) if kind else None
    eng = Engine(gen.target.model, prop, capacity=capacity, k="auto" if prop else 0, k_max=8,
                 eos_token_ids=gen.eos_token_ids, seed=0, max_batch=16)
    queue = {c: [ids[(offset + c * reqs + i) % len(ids)] for i in range(reqs)] for c in range(clients)}
    owner = {}
    def submit(c):
        if queue[c]:
            r = eng.add(Request(queue[c].pop(0), SamplingParams(temperature=0.0), 96))
            owner[id(r)] = c
    for c in range(clients):
        submit(c)
    steps, tokens = [], 0
    t0 = time.perf_counter()
    while eng.busy:
        ts = time.perf_counter()
        changed = eng.step()
        st = dict(eng.timer.step)
        steps.append({"B": len(eng.rows), "t": time.perf_counter() - ts, **{k: round(v, 4) for k, v in st.items()}})
        for r in changed:
            if r.done:
                tokens += len(r.token_ids)
                submit(owner[id(r)])
    wall = time.perf_counter() - t0
    acc = eng.metrics.acceptance
    return {"method": method, "wall": wall, "tokens": tokens, "tok_s": tokens / wall, "calls": eng.metrics.target_calls,
            "accepted": acc.accepted, "drafted": acc.drafted,
            "phases": {k: round(v, 3) for k, v in vars(eng.metrics.timings).items() if isinstance(v, float)},
            "controllers": {k: (getattr(c, 'draft_cost', None), {n: round(v*1000, 2) for n, v in sorted(c.verify_cost.items())}) for k, c in (eng.controllers or {}).items()},
            "steps": steps}

run("none", 0)  # warm-up
out = []
for rep in range(reps):
    for m in (("none", "default") if rep % 2 == 0 else ("default", "none")):
        r = run(m, rep)
        out.append(r)
        print(m, rep, f"{r['tok_s']:.1f} tok/s", r["tokens"], r["calls"], r["accepted"], r["drafted"], r["phases"], flush=True)
json.dump(out, open(f"/tmp/sim/sim-{dtype}-{clients}.json", "w"))
