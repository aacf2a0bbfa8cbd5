"""`specdec bench`: every method side by side on the built-in workloads."""

from __future__ import annotations

import argparse

from specdec.core.adaptive import K_MAX
from specdec.cli.common import int_at_least
from specdec.runtime.linear import DEFAULT_DTYPE, DTYPE_CHOICES


def add(sub: argparse._SubParsersAction) -> None:
    from specdec.bench.jobs import ALL_METHODS, QUICK_METHODS
    from specdec.models import registry

    p = sub.add_parser(
        "bench",
        help="benchmark every method side by side (ours and transformers) across task categories",
        description="Run the project's benchmark: transformers generate() (plain, assisted, prompt "
        "lookup) and specdec (plain, draft, n-gram, early exit, hybrid, adaptive k) on the built-in "
        "prompts of 6 categories, greedy and sampled. Writes results.json, report.md and PNG plots "
        "to --out; an interrupted run resumes from the runs already in --out/runs.jsonl.",
    )
    p.add_argument("--out", default="bench-out", help="output directory (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="1 prompt per category, 32 tokens, fewer methods (< 10 minutes)")
    p.add_argument("--methods", default=None, help=f"comma-separated; all: {','.join(ALL_METHODS)}; quick: {','.join(QUICK_METHODS)}")
    p.add_argument("--temperature", default="0,0.7", help="comma-separated temperatures (default: %(default)s)")
    p.add_argument("--prompts-per-category", type=int, default=None, help="default: all 8 (1 with --quick)")
    p.add_argument("--categories", default=None, help="comma-separated prompt categories: multi_turn, translation, summarization, qa, math, code, "
                        "and the extra 'editing' (rename/convert a 20-30-line module; run only when named) "
                        "(default: the six)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 64 (32 with --quick)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate --max-new-tokens past the end of each answer (equal lengths for every method, but "
                        "text no user receives; 'editing' always stops). Default: answers end where the model ends its turn")
    p.add_argument("--target", default=registry.DEFAULT_TARGET)
    p.add_argument("--draft", default=registry.DEFAULT_DRAFT)
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=DEFAULT_DTYPE, help="(default: %(default)s, as generate)")
    p.add_argument("--head", default=None, metavar="PATH",
                   help="draft head for the head methods (default: the one shipped for --target)")
    p.add_argument("--k", type=int, default=4, help="k of the fixed-k 'draft' and 'head' methods (default: %(default)s)")
    p.add_argument("--k-max", type=int_at_least(1), default=K_MAX, help="largest k of the auto methods (default: %(default)s)")
    scale = p.add_argument_group("scale mode (--scale): load and run cost of 1-8B GGUF files, next to llama.cpp")
    scale.add_argument("--scale", default=None, metavar="CASES",
                       help="comma-separated SHAPE:MIX (synthetic real-shape files, written once under the cache; e.g. "
                            "qwen2.5-7b:q4_k_m,llama-3.1-8b:q4_k_m) or GGUF paths: first and later load time, peak RSS, "
                            "TPOT and the 2/3/5/9-token forward against 1, each runtime in its own process. Writes "
                            "scale.jsonl (resumable) and scale.md to --out; with --draft loaded beside the target")
    scale.add_argument("--context", type=int_at_least(64), default=4096, help="context of the KV cache counted (default: %(default)s)")
    scale.add_argument("--memory-cap", type=float, default=None, metavar="GB",
                       help="address-space limit of each measured process (default: 90%% of this machine's memory)")
    scale.add_argument("--no-llamacpp", action="store_true", help="measure specdec alone")
    scale.add_argument("--fill", action="store_true",
                       help="measure the peak RSS with the --context filled (a --context-token prompt prefilled, "
                            "the draft's cache held beside the target's) instead of adding the KV cache as computed; "
                            "minutes a case at 7-8B")
    spec = p.add_argument_group("speculate mode (--speculate): speculation at 1-8B at a controlled acceptance")
    spec.add_argument("--speculate", default=None, metavar="CASES",
                      help="comma-separated SHAPE:MIX or GGUF paths (as --scale), each run with --draft (a "
                           "registry name, a GGUF file or SHAPE:MIX): a bench proposer runs the draft but proposes "
                           "the target's own greedy continuation, a fraction a of its positions right; measures c, "
                           "v(2..9), plain and speculative speed for k = 1..8 and adaptive k (3 seeds, medians), "
                           "beside the chain formula and llama.cpp's plain speed (--max-new-tokens, default 128). "
                           "Writes speculate.jsonl (resumable) and speculate.md to --out")
    spec.add_argument("--acceptance", default="0.3,0.6,0.7,0.8,0.9", metavar="A,...",
                      help="per-token acceptances to run (default: %(default)s)")
    p.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.scale:
        return run_scale(args)
    if args.speculate:
        return run_speculate(args)

    from specdec.bench.jobs import ALL_METHODS, QUICK_METHODS, known_method, run_bench

    methods = args.methods.split(",") if args.methods else (QUICK_METHODS if args.quick else ALL_METHODS)
    unknown = [m for m in methods if not known_method(m)]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(ALL_METHODS)}, or ngram/draft/head/"
                         "head_tree with a fixed k as NAME_kN (e.g. head_tree_k6)")
    temps = [float(t) for t in args.temperature.split(",")]
    per_cat = args.prompts_per_category or (1 if args.quick else None)
    tokens = args.max_new_tokens or (32 if args.quick else 64)
    out = Path(args.out)
    categories = args.categories.split(",") if args.categories else None
    run_bench(out, methods, temps, per_cat, args.target, args.draft, args.dtype, tokens, args.k, args.k_max, categories,
              head=args.head or "auto", ignore_eos=args.ignore_eos)
    print((out / "report.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'report.md'} and plots in {out}")
    return 0


def run_speculate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec.bench.controlled import run_speculate as measure

    acceptances = [float(a) for a in args.acceptance.split(",")]
    if any(not 0.0 <= a < 1.0 for a in acceptances):
        raise ValueError(f"--acceptance values must be in [0, 1), got {args.acceptance}")
    out = Path(args.out)
    measure(out, args.speculate.split(","), args.draft, acceptances, args.max_new_tokens or 128, not args.no_llamacpp)
    print((out / "speculate.md").read_text())
    print(f"wrote {out / 'speculate.jsonl'} and {out / 'speculate.md'}")
    return 0


def run_scale(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from specdec.bench.scale import run_scale as measure

    cap = args.memory_cap or 0.9 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    out = Path(args.out)
    measure(out, args.scale.split(","), args.draft or None, args.context, args.max_new_tokens or 32, cap,
            not args.no_llamacpp, fill=args.fill)
    print((out / "scale.md").read_text())
    print(f"wrote {out / 'scale.jsonl'} and {out / 'scale.md'}")
    return 0
