"""The fit gap: a draft head's acceptance on own-answer batches it trained on against batches it never saw.

A head that accepts far more on its training rows than on unseen rows of the same kind is
memorising them: more passes over the same rows (replay) then buy little on new text, and more
capacity would memorise more, not generalise; new data (or a regulariser) is what helps. A head
with no gap is limited by its capacity or its optimisation instead. This script measures which.

Groups are named slices of the own answers kept in a train-head workdir (the features the target
recorded while it answered; nothing is generated here: a missing batch is skipped):

    .venv/bin/python -m specdec.training.fit_gap --head H.safetensors --workdir /path/to/train-head-workdir \\
        --group old=sharegpt:130-133 --group newest=sharegpt:222-225 --group unseen=sharegpt:237-240 --out gap.json

Per group, per draft position m = 1..passes, teacher-forced, the head reading its own guesses at
steps > 1, only the generated answer scored (as specdec/training/head_eval.py's own answers):
greedy[m] (argmax agreement) and alpha[m] (sum_x min(p, q) at --temperature).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdec.api import TextGenerator
from specdec.models import heads, registry
from specdec.runtime.linear import DEFAULT_DTYPE
from specdec.training import features
from specdec.training.recipe import AnswerSlice
from specdec.training.run import answer_header, init_net, own_answer_dir
from specdec.training.train import Dataset, evaluate


def parse_group(text: str) -> tuple[str, AnswerSlice]:
    """``NAME=SOURCE:FIRST-END`` -> (name, slice)."""
    name, sep, part = text.partition("=")
    if not sep or not name:
        raise ValueError(f"a group is NAME=SOURCE:FIRST-END, got {text!r}")
    return name, AnswerSlice.parse(part)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--dtype", default=DEFAULT_DTYPE, help="the runtime whose features the head reads (default: %(default)s)")
    ap.add_argument("--head", required=True, help="head file")
    ap.add_argument("--workdir", type=Path, required=True, help="the train-head workdir holding the own answers")
    ap.add_argument("--group", action="append", required=True, metavar="NAME=SOURCE:FIRST-END",
                    help="a named slice of own-answer batches (repeat; e.g. seen=sharegpt:222-225)")
    ap.add_argument("--temperature", type=float, default=1.0, help="temperature of alpha (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    try:
        groups = [parse_group(g) for g in args.group]
    except ValueError as e:
        raise SystemExit(f"--group: {e}") from None
    if not Path(args.head).is_file():
        raise SystemExit(f"--head {args.head} is not a file")
    if not args.workdir.is_dir():
        raise SystemExit(f"--workdir {args.workdir} is not a directory")

    gen = TextGenerator.load(args.target, dtype=args.dtype, head=None)
    full_rows = heads.output_rows(gen.target)  # [V, E] fp32
    try:
        net, card = init_net(Path(args.head), gen.target, full_rows)
    except ValueError as e:  # a head made for another target
        raise SystemExit(f"--head: {e}") from None
    net.eval()
    head_cfg = net.cfg
    passes = card.get("train_config", {}).get("passes", 3)
    header = answer_header(gen.encode_chat)
    out = {"head": Path(args.head).name, "temperature": args.temperature, "groups": {}}
    for name, part in groups:
        directory = own_answer_dir(args.workdir, part.source)
        paths = [features.shard_path(directory, b) for b in part.batches]
        data = Dataset([features.load_shard(p) for p in paths if p.exists()])
        if not len(data):
            raise SystemExit(f"--group {name}: no own-answer batches {part} in {directory}")
        start = time.perf_counter()
        scores = evaluate(net, data, list(range(len(data))), passes, full_rows, batch=1, answer_header=header,
                          ends=gen.eos_token_ids, temperature=args.temperature, last_answer_only=True)
        scores |= {"slice": str(part), "batches_found": sum(p.exists() for p in paths),
                   "seconds": round(time.perf_counter() - start, 1)}
        out["groups"][name] = scores
        print(f"{name} ({part}, {scores['slots']} answer slots): greedy {scores['greedy']}  alpha {scores['alpha']}",
              flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
