"""Speculative decoding benchmark: the default pair vs our plain decoding vs transformers.

In one process, on the same code prompts and weights: specdec speculative (draft model, fixed k),
specdec plain, transformers ``generate()`` plain and assisted with the same draft — all at
``--dtype`` (int8 = transformers + ``quantize_dynamic``), plus transformers assisted generation in
fp32 as the reference the issue sets. Reports the three metric classes and speed ratios.

Usage: ``python -m specdec.bench.spec_bench [--tokens 64] [--k 4] [--prompts 2] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specdec.api import TextGenerator
from specdec.bench.hf import hf_generate, load_hf
from specdec.bench.prompts import CODE_PROMPTS
from specdec.models import registry
from specdec.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--draft", default=registry.DEFAULT_DRAFT)
    ap.add_argument("--dtype", default="int8", choices=["int8", "float32"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--skip-hf-fp32", action="store_true", help="skip the (slow) fp32 transformers assisted run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    gen = TextGenerator.load(args.target, args.draft, dtype=args.dtype)
    gen.eos_token_ids = set()  # every method generates exactly --tokens tokens
    hf_t, hf_d = load_hf(gen.target.source_dir, args.dtype), load_hf(gen.draft.source_dir, args.dtype)
    hf32 = None if args.skip_hf_fp32 or args.dtype == "float32" else (
        load_hf(gen.target.source_dir, "float32"), load_hf(gen.draft.source_dir, "float32"))
    prompts = [gen.encode(p, chat=True) for p in CODE_PROMPTS[: args.prompts]]
    runs = []
    for temp in [float(t) for t in args.temperatures.split(",")]:
        params = SamplingParams(temperature=temp)
        for i, prompt in enumerate(prompts):
            row = {"temperature": temp, "prompt": i}
            spec = gen.generate([prompt], params, args.tokens, k=args.k, seed=i)[0]
            plain = gen.generate([prompt], params, args.tokens, k=0, seed=i)[0]
            row["spec"] = spec.batch_metrics.to_dict()
            row["plain"] = plain.batch_metrics.to_dict()
            row["spec_equals_plain"] = spec.token_ids == plain.token_ids
            _, s = hf_generate(hf_t, prompt, args.tokens, temp, seed=i)
            row["hf_plain_tok_s"] = args.tokens / s
            _, s = hf_generate(hf_t, prompt, args.tokens, temp, seed=i, assistant=hf_d)
            row["hf_assisted_tok_s"] = args.tokens / s
            if hf32 is not None:
                _, s = hf_generate(hf32[0], prompt, args.tokens, temp, seed=i, assistant=hf32[1])
                row["hf_assisted_fp32_tok_s"] = args.tokens / s
            runs.append(row)
            print(json.dumps({k: (v["throughput_tok_s"] if isinstance(v, dict) else v) for k, v in row.items()}), flush=True)
    _report(runs, args, gen)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "runs": runs}, f, indent=1)


def _report(runs, args, gen) -> None:
    print(f"\n## {gen.target.name} + draft {gen.draft.name}, k={args.k}, {args.dtype}, {args.tokens} tokens, code prompts\n")
    print("| temperature | specdec spec tok/s | specdec plain | HF plain | HF assisted | HF assisted fp32 | spec/plain | spec/HF assisted | spec/HF assisted fp32 | accepted/call | full-accept rate | calls/token | draft s | verify s | greedy identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for temp in sorted({r["temperature"] for r in runs}):
        rs = [r for r in runs if r["temperature"] == temp]
        med = lambda f: statistics.median(f(r) for r in rs)  # noqa: E731
        spec, plain = med(lambda r: r["spec"]["throughput_tok_s"]), med(lambda r: r["plain"]["throughput_tok_s"])
        hfp, hfa = med(lambda r: r["hf_plain_tok_s"]), med(lambda r: r["hf_assisted_tok_s"])
        hf32 = med(lambda r: r.get("hf_assisted_fp32_tok_s", float("nan")))
        acc = med(lambda r: r["spec"]["acceptance"]["mean_accepted_per_call"])
        full = med(lambda r: r["spec"]["acceptance"]["full_acceptance_rate"])
        cpt = med(lambda r: r["spec"]["target_calls_per_token"])
        d = med(lambda r: r["spec"]["time_breakdown_s"]["draft"])
        v = med(lambda r: r["spec"]["time_breakdown_s"].get("target_forward", r["spec"]["time_breakdown_s"].get("verify")))
        same = "yes" if temp == 0 and all(r["spec_equals_plain"] for r in rs) else ("no" if temp == 0 else "n/a")
        print(f"| {temp} | {spec:.2f} | {plain:.2f} | {hfp:.2f} | {hfa:.2f} | {hf32:.2f} | {spec / plain:.2f}x | {spec / hfa:.2f}x | "
              f"{spec / hf32:.2f}x | {acc:.2f} | {full:.0%} | {cpt:.3f} | {d:.2f} | {v:.2f} | {same} |")


if __name__ == "__main__":
    main()
