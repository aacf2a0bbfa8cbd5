"""Widen a trained head's drafted ids without training, to measure what coverage buys (issue 29).

A head's output is scored by the target's own output rows for the ids it drafts
(``specdec.models.heads``), so a head can draft more ids than it was trained on: the new rows are
the target's, and only the head's last hidden state decides how they rank. This writes a full
head (fp16) whose ``vocab_ids`` are ``--head``'s plus the ids the own answers in ``--answers``
use most that it lacks (:func:`specdec.training.run.widened_vocab`, what ``train-head
--widen-vocab`` does before training), for ``benchmarks/head_eval.py`` to compare with the head
as it was. Pass the training answers' folders only, never the held-out ones.

    .venv/bin/python benchmarks/widen_vocab.py --head mix13.safetensors --size 24576 \\
        --answers WORKDIR/own-answers WORKDIR/own-answers-sharegpt --out mix13-v24576.safetensors

Stop 52 (docs/HEAD-TRAINING.md, 'Stage 15'): mix13 at 20,480 -> 24,576 / 32,768 ids raised the
coverage of the target's argmax on held-out own answers 93.3% -> 94.8% / 96.2% and acceptance
only +0.005 greedy, +0.001 sampled, so the shipped head kept its ids.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors import safe_open

from specdec.models.heads import read_head, save_head
from specdec.training.run import widened_vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", type=Path, required=True, help="the trained head (a full or a delta file)")
    ap.add_argument("--size", type=int, required=True, help="how many ids the widened head drafts")
    ap.add_argument("--answers", type=Path, nargs="+", required=True,
                    help="own-answer feature folders whose token ids are counted (training folders only)")
    ap.add_argument("--out", type=Path, required=True, help="where to write the widened head (full, fp16)")
    args = ap.parse_args()
    cfg, state, ids, card = read_head(args.head)
    rows = []
    for folder in args.answers:
        shards = sorted(folder.glob("features-*.safetensors"))
        if not shards:
            ap.error(f"no feature shards in {folder}")
        for path in shards:
            with safe_open(str(path), framework="pt") as f:
                rows.extend(f.get_tensor("tokens"))  # [n, L] int32, -1 past each row's end
    new = widened_vocab(ids, rows, args.size, cfg.target_vocab_size)
    print(f"{sum(int((r >= 0).sum()) for r in rows)} tokens counted; drafted ids {ids.numel()} -> {new.numel()}")
    save_head(args.out, cfg, state, new, dict(card, widened_without_training={"from": ids.numel(), "to": args.size}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
