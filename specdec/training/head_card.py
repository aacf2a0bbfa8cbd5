"""Complete a trained head's model card for shipping (issue 29, item 6).

Adds to the JSON card beside ``--head`` (and re-renders its Markdown card):
  machine             the CPU the figures were taken on (model and ISA flags);
  held_out_eval_sets  specdec/training/head_eval.py's held-out acceptance per draft position
                      (ShareGPT conversations and the target's own answers, greedy and sampled);
  bench_acceptance    the head's acceptance per draft position on each of the bench's categories,
                      pooled over its prompts, greedy and sampled (a ``specdec bench --methods head``
                      runs.jsonl), with the median and the pooled first position over categories;
  learning_curve      held-out own-answer acceptance of this head and the heads it descends from,
                      against the chat tokens each had been trained on (head_eval JSONs).

    .venv/bin/python -m specdec.training.head_card --head H.safetensors --eval eval.json \\
        --bench bench/runs.jsonl --bench-command "specdec bench ..." \\
        --curve "shipped:0:e0.json" "ft320:213027:e1.json" ... "H:587000:eval.json"
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

from specdec.runtime.native import cpu_name

from specdec import cache
from specdec.training.run import card_markdown
from specdec.training.train import write_json


def bench_acceptance(runs_path: Path, method: str = "head") -> dict:
    """Per temperature and category: accepted / reached at each draft position, pooled over prompts."""
    runs = [json.loads(line) for line in runs_path.read_text().splitlines() if line.strip()]
    out = {}
    for temp in sorted({r["temperature"] for r in runs if r["method"] == method}):
        cats = {}
        for r in runs:
            if r["method"] != method or r["temperature"] != temp:
                continue
            a = r["metrics"]["acceptance"]
            c = cats.setdefault(r["category"], {"accepted": [], "reached": [], "prompts": 0})
            for key in ("accepted", "reached"):  # runs differ in length (no drafts at all; k up to k_max)
                c[key] = [x + y for x, y in itertools.zip_longest(c[key], a[f"{key}_per_position"], fillvalue=0)]
            c["prompts"] += 1
        table = {name: {"per_position": [round(x / n, 3) if n else None for x, n in zip(c["accepted"], c["reached"])],
                        "calls": c["reached"][0] if c["reached"] else 0, "prompts": c["prompts"]}
                 for name, c in cats.items()}
        firsts = [row["per_position"][0] for row in table.values() if row["per_position"]]  # categories with drafts
        drafted = [c for c in cats.values() if c["reached"]]
        out[str(temp)] = {"categories": table, "median_first": round(statistics.median(firsts), 3) if firsts else None,
                          "pooled_first": round(sum(c["accepted"][0] for c in drafted)
                                                / sum(c["reached"][0] for c in drafted), 3) if drafted else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", type=Path, required=True, help="the head file; its .json card is completed in place")
    ap.add_argument("--eval", type=Path, required=True, help="specdec/training/head_eval.py --out JSON for this head")
    ap.add_argument("--bench", type=Path, required=True, help="runs.jsonl of `specdec bench --methods head` with it")
    ap.add_argument("--bench-command", required=True, help="the bench command line, recorded on the card")
    ap.add_argument("--curve", nargs="+", required=True, metavar="LABEL:CHAT_TOKENS:EVAL_JSON",
                    help="learning-curve points, oldest first (head_eval JSONs with an own-answers set)")
    args = ap.parse_args()
    card_path = args.head.with_suffix(".json")
    card = json.loads(card_path.read_text())
    card["machine"] = cpu_name()
    card["held_out_eval_sets"] = json.loads(args.eval.read_text())["sets"]
    card["bench_acceptance"] = {"command": args.bench_command, "by_temperature": bench_acceptance(args.bench)}
    curve = []
    for point in args.curve:
        label, tokens, path = point.split(":", 2)
        scores = json.loads(Path(path).read_text())["sets"]["own-answers"]["by_temperature"]["1.0"]
        curve.append({"head": label, "chat_tokens": int(tokens), "greedy": scores["greedy"], "alpha": scores["alpha"],
                      "slots": scores["slots"]})
    card["learning_curve"] = curve
    write_json(card_path, card)
    cache.write_atomic(args.head.with_suffix(".md"), lambda tmp: tmp.write_text(card_markdown(card, args.head.name)))
    print(f"completed {card_path} and its .md")


if __name__ == "__main__":
    main()
