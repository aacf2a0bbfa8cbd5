"""`specdec profile`: measured costs and acceptance of a target/proposer pair, and the k they recommend."""

from __future__ import annotations

import argparse
import json

from specdec.core.adaptive import K_MAX
from specdec.cli.common import int_at_least, read_prompts, resolve_auto_draft
from specdec.runtime.linear import DEFAULT_DTYPE, DTYPE_CHOICES
from specdec.speculation import METHODS


def add(sub: argparse._SubParsersAction) -> None:
    from specdec.models import registry

    p = sub.add_parser(
        "profile",
        help="measure costs and acceptance of a target/proposer pair, recommend k",
        description="Measure the target's verification cost for 1..k_max+1 positions, the proposer's "
        "cost per draft token and its acceptance per position on a prompt set; print the k that "
        "maximises expected tokens per second, and the predicted vs measured speed-up.",
    )
    p.add_argument("--target", default=registry.DEFAULT_TARGET)
    p.add_argument("--draft", default=None, help="draft model name or path, or 'auto' (the smallest installed model "
                   "with the target's tokenizer)")
    p.add_argument("--proposer", choices=[m for m in METHODS if m != "none"], default=None,
                   help="default: draft if --draft is given, else ngram")
    p.add_argument("--head", default=None, metavar="PATH",
                   help="draft head for --proposer head/hybrid-head (default: the one shipped for --target)")
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable); default: built-in code prompts")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--k-max", type=int_at_least(1), default=None, help=f"largest k measured (default: {K_MAX})")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=DEFAULT_DTYPE, help="(default: %(default)s)")
    p.add_argument("--exit-layer", type=int_at_least(1), default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:
    from specdec.api import TextGenerator
    from specdec.bench.profile import format_profile, profile
    from specdec.bench.prompts import LOOKUP_METHODS, verify_prompts
    from specdec.verify.sampling import SamplingParams

    resolve_auto_draft(args)
    proposer = args.proposer or ("draft" if args.draft else "ngram")
    params = SamplingParams(temperature=args.temperature)  # validated before loading
    builtin = verify_prompts(lookup=proposer in LOOKUP_METHODS)
    texts = read_prompts(args.prompt or builtin)
    gen = TextGenerator.load(args.target, args.draft, args.dtype, head=args.head or "auto")
    prompts = [gen.encode(t, chat=args.chat or not args.prompt) for t in texts]
    spec = gen.speculation(proposer, k_max=args.k_max, exit_layer=args.exit_layer)
    result = profile(gen, prompts, spec, params, args.max_new_tokens)
    print(json.dumps(result) if args.json else format_profile(result))
    return 0
