"""Methods side by side in ONE process, alternating per prompt (the machine's memory bandwidth
drifts on a minute scale, so whole bench runs one after the other compare machine states).

For each prompt (first N per category), every method runs back to back (order flipped every
prompt), to the end of the model's turn, seeded as the bench; one Bench, one runtime. Writes
runs.jsonl; prints per method and category the median speed-up over plain decoding on the same
prompt (end to end, prefill included), the geo-mean over all prompts, the worst category, tokens
per call, and (greedy) whether every run equals plain decoding.

    python docs/bench-q4k/paired.py OUT_DIR --methods plain,hybrid_head --temperature 0.8 \
        --per 4 [--categories multi_turn,math] [--max-new-tokens 96] [--dtype q4k]

``--old-suffix COMMIT``: methods ending in ``_old`` (e.g. ``suffix_old``, ``hybrid_tree_old``) run
with the suffix proposer of that commit (its specdec/proposers/suffix.py, read with git show), so
a change to it is measured against its predecessor in the same process. Methods ending in
``_ngram`` (e.g. ``hybrid_head_ngram``) build their hybrid with n-gram lookup as its lookup side,
as the API did before docs/BENCHMARKS.md §26.
"""
import argparse, importlib.util, json, math, statistics, subprocess, tempfile
from pathlib import Path

import specdec.api as api
from specdec.bench.jobs import Bench, load_workloads
from specdec.models import registry

ap = argparse.ArgumentParser()
ap.add_argument("out", type=Path)
ap.add_argument("--methods", default="plain,hybrid_head")
ap.add_argument("--temperature", type=float, default=0.0)
ap.add_argument("--per", type=int, default=4)
ap.add_argument("--categories", default=None)
ap.add_argument("--max-new-tokens", type=int, default=96)
ap.add_argument("--dtype", default="q4k")
ap.add_argument("--seeds", type=int, default=1, help="runs per prompt (seeds 0..N-1; sampled only)")
ap.add_argument("--old-suffix", default=None, help="commit whose suffix proposer the *_old methods use")
args = ap.parse_args()
NEW_SUFFIX, OLD_SUFFIX = api.SuffixProposer, None
if args.old_suffix:
    source = subprocess.run(["git", "show", f"{args.old_suffix}:specdec/proposers/suffix.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_suffix.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_suffix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    OLD_SUFFIX = module.SuffixProposer


COPY_LOOKUP = api.copy_lookup


def run(m, ids, temperature, seed):
    """One run; ``*_old`` methods with the old suffix proposer (the one place api builds it),
    ``*_ngram`` ones with n-gram lookup in the hybrid."""
    api.SuffixProposer = OLD_SUFFIX if m.endswith("_old") else NEW_SUFFIX
    if m.endswith("_ngram"):
        api.copy_lookup = lambda gen, ngram: api.NgramProposer(*ngram)
    try:
        return bench.run(m.removesuffix("_old").removesuffix("_ngram"), ids, temperature, seed=seed, stop_at_eos=True)
    finally:
        api.SuffixProposer, api.copy_lookup = NEW_SUFFIX, COPY_LOOKUP


methods = args.methods.split(",")
assert methods[0] == "plain", "plain decoding first: the baseline"
work = load_workloads(include_extra=True)
cats = args.categories.split(",") if args.categories else list(load_workloads())
args.out.mkdir(parents=True, exist_ok=True)
bench = Bench(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT, args.dtype, args.max_new_tokens, 4, 8)
rows, n = [], 0
with open(args.out / "runs.jsonl", "w") as log:
    for i in range(args.per):
        for cat in cats:
            prompts = work[cat]["prompts"]
            if i >= len(prompts):
                continue
            ids = bench.encode(prompts[i])
            for seed in range(args.seeds if args.temperature > 0 else 1):
                order = methods if n % 2 == 0 else methods[::-1]
                n += 1
                for m in order:
                    r = run(m, ids, args.temperature, seed + 1000 * i)
                    rec = {"method": m, "category": cat, "prompt": i, "seed": seed, "temperature": args.temperature,
                           "token_ids": r["token_ids"], "metrics": r["metrics"]}
                    log.write(json.dumps(rec) + "\n"); log.flush()
                    rows.append(rec)
            print(f"{cat} {i} done", flush=True)

geo = lambda v: math.exp(statistics.mean(map(math.log, v)))  # noqa: E731
R = {(r["method"], r["category"], r["prompt"], r["seed"]): r for r in rows}
keys = [k[1:] for k in R if k[0] == "plain"]
print(f"\nT = {args.temperature}, {len(keys)} runs per method, dtype {args.dtype}")
print("plain TPOT median", round(1e3 * statistics.median(R[("plain",) + k]["metrics"]["tpot_s"] for k in keys), 1), "ms")
for m in methods[1:]:
    sp = {k: R[(m,) + k]["metrics"]["throughput_tok_s"] / R[("plain",) + k]["metrics"]["throughput_tok_s"] for k in keys}
    per_cat = {c: statistics.median(v for k, v in sp.items() if k[0] == c) for c in cats}
    tpc = statistics.mean(R[(m,) + k]["metrics"]["tokens_per_call"] for k in keys)
    same = all(R[(m,) + k]["token_ids"] == R[("plain",) + k]["token_ids"] for k in keys) if args.temperature == 0 else "-"
    print(f"{m}: geo {geo(list(sp.values())):.3f}x, median of category medians {statistics.median(per_cat.values()):.3f}x, "
          f"worst category {min(per_cat.values()):.3f}x, tokens/call {tpc:.2f}, greedy identical {same}")
    print("   " + ", ".join(f"{c} {v:.2f}x" for c, v in per_cat.items()))
