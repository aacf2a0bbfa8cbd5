"""What the commands share: argument types, the speculation options and their check, prompt reading, UsageError."""

from __future__ import annotations

import argparse
import sys

from specdec.core.adaptive import K_MAX
from specdec.core.rows import MAX_SEED
from specdec.runtime.linear import DEFAULT_DTYPE, DTYPE_CHOICES
from specdec.speculation import METHODS


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer port, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value

def k_value(text: str):
    """--k: :func:`specdec.core.adaptive.check_k` of the text (an integer, or "auto")."""
    from specdec.core.adaptive import check_k

    try:
        return check_k(text if text == "auto" else int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k must be an integer >= 0 or 'auto', got {text!r}") from None

def int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse

def megabytes(text: str) -> float:
    """A memory size in MiB, >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB, got {text!r}") from None
    if not value >= 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def seed_value(text: str) -> int:
    value = int_at_least(0)(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_SEED}, got {value}")
    return value

def speculation_of(args: argparse.Namespace):
    """The :class:`~specdec.speculation.SpeculationConfig` of generate's and serve's options,
    resolved before anything is loaded; options that would be silently ignored are rejected."""
    from specdec.models import heads

    if args.draft is not None and args.proposer not in (None, "draft", "hybrid"):
        raise UsageError(f"--draft has no effect with --proposer {args.proposer}")
    resolve_auto_draft(args)
    has_head = args.head is not None or heads.shipped(args.target) is not None
    spec = _resolve(args, draft=bool(args.draft), head=has_head)  # (speculation.py validates; its errors are usage errors)
    ignored = [
        ("--k", args.k is not None and not spec.speculates, "a proposer (--proposer none decodes plainly)"),
        ("--head", args.head is not None and not spec.uses_head, "--proposer head, hybrid, hybrid-head, head-tree or hybrid-tree"),
        ("--k-max", args.k_max is not None and args.k not in (None, "auto"), "--k auto"),
        ("--draft-dtype", args.draft_dtype is not None and not args.draft, "--draft"),
        ("--exit-layer", args.exit_layer is not None and not spec.uses_exit_layer, "--proposer early-exit (or hybrid without --draft)"),
        ("--ngram-min/--ngram-max", (args.ngram_min, args.ngram_max) != (None, None) and not spec.uses_lookup,
         "--proposer ngram, hybrid or hybrid-head"),
    ]
    for flag, unused, needs in ignored:
        if unused:
            raise UsageError(f"{flag} has no effect without {needs}")
    return spec if args.k is None else spec.with_k(args.k)


def _resolve(args: argparse.Namespace, draft: bool, head: bool):
    from specdec.speculation import SpeculationConfig

    return SpeculationConfig.resolve(args.proposer, draft=draft, head=head, k_max=args.k_max,
                                     ngram=(args.ngram_min, args.ngram_max), exit_layer=args.exit_layer)


def with_default_draft(args: argparse.Namespace, spec):
    """``spec``, or the default's draft model found for it, once every option is validated (just
    before loading): for a target without a draft head, where neither a method nor a draft was
    named, the hybrid over :func:`specdec.speculation.default_draft`'s pick (``args.draft`` set)."""
    from specdec.speculation import default_draft

    if args.draft is not None or args.proposer is not None or not spec.speculates or spec.uses_head:
        return spec
    args.draft = default_draft(args.target, head=False)
    if args.draft is None:
        return spec
    spec = _resolve(args, draft=True, head=False)
    return spec if args.k is None else spec.with_k(args.k)

def resolve_auto_draft(args: argparse.Namespace) -> None:
    """``--draft auto``: replaced by the model :func:`specdec.speculation.auto_draft` finds (None
    when there is none, a usage error where the proposer needs a draft model)."""
    from specdec.speculation import AUTO, auto_draft

    if args.draft != AUTO:
        return
    args.draft = auto_draft(args.target)
    if args.draft is None and args.proposer == "draft":
        raise UsageError("--proposer draft --draft auto: no installed model can draft for this target (see above)")


def read_prompts(prompts: list[str]) -> list[str]:
    """Prompt texts, '-' read from stdin; both must be valid UTF-8."""
    texts = []
    for p in prompts:
        if p == "-":
            if sys.stdin is None or sys.stdin.closed:
                raise UsageError("--prompt -: standard input is closed")
            try:
                p = sys.stdin.buffer.read().decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UsageError(f"--prompt -: standard input is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
        else:
            try:
                p.encode("utf-8")
            except UnicodeEncodeError:  # undecodable argv bytes arrive as lone surrogates
                raise UsageError("--prompt is not valid UTF-8") from None
        texts.append(p)
    return texts

def add_model_options(p: argparse.ArgumentParser) -> None:
    """What decodes: target, proposer and its options, dtypes (shared by generate and serve)."""
    from specdec.models import registry

    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="model name or path to a .gguf file / HF directory (default: %(default)s)")
    p.add_argument("--draft", default=None,
                   help="draft model name or path (the default proposer is then hybrid: lookup, else this model); "
                   "'auto': the smallest installed model with the target's tokenizer, if any (said on stderr)")
    p.add_argument("--proposer", choices=list(METHODS), default=None,
                   help="where drafts come from: the target's draft head, a draft model, n-gram prompt "
                   "lookup, the target's own first layers, hybrid (lookup when the text repeats itself: the suffix "
                   "proposer's copy as chains; else the draft "
                   "model / head / early exit), hybrid-head; candidate trees (several guesses per position, "
                   "verified exactly in one call): suffix (frequent continuations of the text so far), "
                   "head-tree (the head's dynamic trees), hybrid-tree (suffix when it matches, else head trees); "
                   "or none (plain decoding). With a tree proposer --k is the node budget. Default: hybrid, over "
                   "the --draft model if given, else over the draft head when the target has one, else over the "
                   "smallest installed model with the target's tokenizer (as --draft auto); else suffix (lookup alone)")
    p.add_argument("--head", default=None, metavar="PATH",
                   help="draft head file (from `specdec train-head`; default: the one shipped for --target)")
    p.add_argument("--k", type=k_value, default=None,
                   help="draft tokens per step, or 'auto' (default with a proposer): chosen each step from "
                   "measured costs and acceptance, 0 = no speculation when drafts do not pay")
    p.add_argument("--k-max", type=int_at_least(1), default=None, help=f"largest k for --k auto (default: {K_MAX})")
    p.add_argument("--ngram-min", type=int_at_least(1), default=None, help="n-gram/hybrid: shortest context suffix to match (default: 2)")
    p.add_argument("--ngram-max", type=int_at_least(1), default=None, help="n-gram/hybrid: longest context suffix to match (default: 4)")
    p.add_argument("--exit-layer", type=int_at_least(1), default=None,
                   help="early-exit (or hybrid without --draft) draft depth (default: a quarter of the layers)")
    p.add_argument("--seed", type=seed_value, default=0, help=f"random seed in [0, {MAX_SEED}] (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=DEFAULT_DTYPE,
                   help="weights/compute dtype (default: %(default)s, the fastest here; see docs/BENCHMARKS.md)")
    p.add_argument("--draft-dtype", choices=DTYPE_CHOICES, default=None, help="with --draft (default: --dtype)")

class UsageError(ValueError):
    """Options that contradict each other or would be silently ignored."""
