"""Store a head trained further from a committed head as a low-rank update of it (issue 29, item 5).

A full head is ~58 MB in fp16, and every shipped version stays in git history; issue 29 caps its
additions to history at ~150 MB. So a stage that starts from a committed head is committed as
that head's file plus ``U V`` per matrix, the truncated SVD of its change
(``specdec.models.heads.save_head_delta``), and ``read_head`` rebuilds it. The change is not low
rank (at rank 256, 0.36-0.61 of each matrix's change is left out), but most of what it buys lies in
its largest directions: mix5 -> mix7 at rank 256 (16 MB against 58) kept 85% of the greedy gain
held out (docs/HEAD-TRAINING.md, 'Stages 8 and 9'). The card beside ``--head`` (``.json``) is copied beside ``--out``
with the storage recorded.

    .venv/bin/python benchmarks/head_delta.py --base mix5.safetensors --head mix6.safetensors \\
        --rank 128 --out mix6-r128.safetensors

``--bits 8`` stores the update's factors in int8 with one scale per direction: half the bytes of
fp16 at the same rank, for ~1% rounding of each direction (``save_head_delta``).

``--out`` must lie beside ``--base`` (a delta names its base by file name and sha256). Prints each
matrix's relative error (the update's energy beyond its ``rank`` largest singular values, and the
rounding of what is kept) and the
file's size; whether a rank keeps the head's acceptance is for ``benchmarks/head_eval.py`` to say.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.models import registry
from specdec.models.heads import read_head, save_head_delta
from specdec.training.train import write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the head file the update is taken against")
    ap.add_argument("--head", type=Path, required=True, help="the head trained further from --base")
    ap.add_argument("--rank", type=int, required=True, help="rank of each matrix's stored update")
    ap.add_argument("--bits", type=int, choices=(8, 16), default=16,
                    help="the update's factors in fp16, or in int8 with a scale per direction (half the bytes)")
    ap.add_argument("--out", type=Path, required=True, help="where to write the delta head (beside --base)")
    args = ap.parse_args()
    if args.out.resolve().parent != args.base.resolve().parent:
        ap.error("--out must lie in the same folder as --base: a delta head finds its base beside it")
    _, state, vocab_ids, card = read_head(args.head)
    errors = save_head_delta(args.out, args.base, state, vocab_ids, args.rank, card, bits=args.bits)
    for name, err in errors.items():
        print(f"{name:40s} relative error {err:.3f}")
    size = args.out.stat().st_size
    print(f"wrote {args.out}: {size / 1e6:.1f} MB against {args.head.stat().st_size / 1e6:.1f} MB in full")
    card_path = args.head.with_suffix(".json")
    if card_path.is_file():
        card = json.loads(card_path.read_text())
        card["stored_as"] = {"base": args.base.name, "rank": args.rank, "bits": args.bits, "bytes": size, "sha256": registry.sha256_of(args.out),
                             "relative_error": {k: round(v, 4) for k, v in errors.items()}}
        write_json(args.out.with_suffix(".json"), card)


if __name__ == "__main__":
    main()
