"""`specdec verify`: prove a speculative configuration exact, or not."""

from __future__ import annotations

import argparse
import json

from specdec.cli.common import UsageError, int_at_least, k_value, read_prompts, resolve_auto_draft, seed_value
from specdec.runtime.linear import DEFAULT_DTYPE, DTYPE_CHOICES
from specdec.speculation import METHODS


def add(sub: argparse._SubParsersAction) -> None:
    from specdec.models import registry

    p = sub.add_parser(
        "verify",
        help="prove that a target/proposer/k/sampling configuration is lossless (exit 0) or not (exit 1; "
        "3: inconclusive)",
        description="Check a speculative configuration on the real models: (a) speculative greedy "
        "output is token-identical to plain greedy output on N prompts; (b) at --temperature with "
        "--top-k, the joint law of the first --depth generated tokens, enumerated from the target's "
        "own conditionals, matches --samples speculative samples through the real engine (Pearson "
        "chi-square); (c) a negative control, the same run with a deliberately wrong verifier, must "
        "be rejected, and the test's power against it is reported. Exit status: 0 exact (all three "
        "hold); 1 NOT exact ((a) or (b) failed); 3 inconclusive (the negative control was not rejected: "
        "this run could not have caught a wrong verifier, e.g. the proposer hardly drafted); 2 bad input.",
    )
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="(default: %(default)s)")
    p.add_argument("--draft", default=None, help="draft model name or path, or 'auto' (implies --proposer draft)")
    p.add_argument("--proposer", choices=list(METHODS), default=None, help="the proposer to check")
    p.add_argument("--k", type=k_value, default=4, help="draft tokens per step or 'auto' (default: %(default)s)")
    p.add_argument("--ngram-min", type=int_at_least(1), default=2)
    p.add_argument("--ngram-max", type=int_at_least(1), default=4)
    p.add_argument("--exit-layer", type=int_at_least(1), default=None)
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of test (b), > 0 (default: %(default)s)")
    p.add_argument("--top-k", type=int_at_least(1), default=4, help="top-k of test (b), at most 16 (default: %(default)s)")
    p.add_argument("--depth", type=int, choices=[1, 2, 3], default=3, help="generated tokens whose joint law is tested (default: %(default)s)")
    p.add_argument("--samples", type=int_at_least(100), default=2000, help="speculative samples for (b) and (c) (default: %(default)s)")
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable; the first one is used for (b)); default: 4 built-in code prompts")
    p.add_argument("--chat", action="store_true", help="wrap the prompts in the chat template")
    p.add_argument("--greedy-tokens", type=int_at_least(1), default=32, help="tokens per prompt for (a) (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=1e-3, help="significance level (default: %(default)s)")
    p.add_argument("--batch", type=int_at_least(1), default=200, help="rows per engine call while sampling (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=DEFAULT_DTYPE, help="(default: %(default)s)")
    p.add_argument("--seed", type=seed_value, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:
    from specdec.api import TextGenerator
    from specdec.bench.prompts import LOOKUP_METHODS, verify_prompts
    from specdec.exactness import format_report, verify_deployment
    from specdec.verify.sampling import SamplingParams

    resolve_auto_draft(args)
    proposer = args.proposer or ("draft" if args.draft else None)
    if proposer is None:
        raise UsageError("choose what to verify: --draft NAME_OR_PATH or --proposer")
    if not 0 < args.alpha < 1:
        raise UsageError(f"--alpha must be in (0, 1), got {args.alpha}")
    if args.temperature <= 0:
        raise UsageError(f"--temperature must be > 0 for the law test, got {args.temperature}")
    SamplingParams(args.temperature, args.top_k)  # range checks before loading
    builtin = verify_prompts(lookup=proposer in LOOKUP_METHODS)
    texts = read_prompts(args.prompt or builtin)
    gen = TextGenerator.load(args.target, args.draft, args.dtype)
    prompts = [gen.encode(t, args.chat) for t in texts]

    spec = gen.speculation(proposer, k=args.k, ngram=(args.ngram_min, args.ngram_max), exit_layer=args.exit_layer)
    report = verify_deployment(gen.target.model, lambda capacity: spec.build(gen, capacity), spec.method, prompts, k=spec.k,
                               temperature=args.temperature, top_k=args.top_k, depth=args.depth,
                               samples=args.samples, greedy_tokens=args.greedy_tokens, alpha=args.alpha,
                               batch=args.batch, seed=args.seed)
    print(json.dumps(report.to_dict()) if args.json else format_report(report))
    return VERIFY_EXIT[report.verdict]

# `specdec verify`'s exit status per verdict (2 stays bad input, as for every command).
VERIFY_EXIT = {"exact": 0, "NOT exact": 1, "inconclusive": 3}
