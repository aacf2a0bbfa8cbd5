"""How well the draft head's confidence predicts acceptance on the bench's prompts: the figures
behind ``specdec.speculation.HEAD_MIN_SCORE`` (where a head chain stops under adaptive k).

The head drafts fixed chains of ``--k`` tokens for one prompt at a time (batch 1, as the bench).
Before each draft the top probability of the head's raw distribution is recorded (whatever the
row's temperature) — what the chain gate multiplies along the chain. Then the verification says
how many drafts were accepted. The report bins the steps by the first draft's confidence and by
the chain's score at position 2 (the product of the two top probabilities) and gives the
acceptance in each bin: a calibrated head has acceptance close to the bin's confidence, and the
bins where it is far below a verified position's cost (~0.1 of a target step here) are where
cutting the chain pays.

    .venv/bin/python benchmarks/head_confidence.py --temperature 0 --prompts-per-category 4 --out conf-t0.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from specdec.api import TextGenerator
from specdec.bench.jobs import load_workloads
from specdec.engine import generate
from specdec.models import registry
from specdec.proposers.head import HeadProposer
from specdec.sampling import SamplingParams

BINS = [0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


class RecordingHead(HeadProposer):
    """A head proposer that records the confidence of every drafted position (the chain gate's
    per-position factor) and the accepted count of every step. ``min_score`` is set just above 0
    so that the gate computes its factors, and never cuts."""

    def __init__(self, head, capacity: int) -> None:
        super().__init__(head, capacity, min_score=1e-30)
        self.steps: list[dict] = []

    def propose(self, pending, k, tree=False):
        self.steps.append({"conf": [], "accepted": None})
        return super().propose(pending, k, tree)

    def _confidence(self, subset_logits: torch.Tensor) -> torch.Tensor:
        conf = super()._confidence(subset_logits)
        self.steps[-1]["conf"].append(float(conf[0]))
        return conf

    def observe(self, num_accepted, target_hidden=None) -> None:
        if self.steps and self.steps[-1]["accepted"] is None:
            self.steps[-1]["accepted"] = int(num_accepted[0])
        super().observe(num_accepted, target_hidden)


def calibration(steps: list[dict], position: int, product: bool) -> list[dict]:
    """Acceptance per confidence bin at ``position`` (1-based) over the steps that reached it."""
    out = []
    for lo, hi in zip(BINS, BINS[1:]):
        reached = accepted = 0
        for s in steps:
            if len(s["conf"]) < position or s["accepted"] is None or s["accepted"] < position - 1:
                continue
            c = math.prod(s["conf"][:position]) if product else s["conf"][position - 1]
            if lo <= c < hi or (hi == 1.0 and c == 1.0):
                reached += 1
                accepted += s["accepted"] >= position
        if reached:
            out.append({"bin": [lo, hi], "steps": reached, "accepted": accepted, "acceptance": accepted / reached})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--head", default="auto", help="head file (default: the one shipped for --target)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--k", type=int, default=4, help="drafts per step (default: %(default)s)")
    ap.add_argument("--prompts-per-category", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None, help="write every step and the tables as JSON here")
    args = ap.parse_args()

    gen = TextGenerator.load(args.target, head=args.head)
    head = gen.draft_head()
    params = SamplingParams(temperature=args.temperature)
    steps = []
    for category, spec in load_workloads().items():
        for i, prompt in enumerate(spec["prompts"][: args.prompts_per_category]):
            ids = gen.encode_chat(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
            proposer = RecordingHead(head, len(ids) + args.max_new_tokens + args.k + 1)
            generate(gen.target.model, [ids], params, args.max_new_tokens, proposer=proposer, k=args.k, seed=i,
                     eos_token_ids=gen.eos_token_ids)
            steps += [dict(s, category=category) for s in proposer.steps if s["conf"]]
    tables = {"position 1": calibration(steps, 1, False), "position 2, own": calibration(steps, 2, False),
              "position 2, product": calibration(steps, 2, True)}
    print(f"{len(steps)} steps, temperature {args.temperature}, k = {args.k}")
    for name, rows in tables.items():
        print(f"\n{name}: confidence bin -> acceptance (steps)")
        for r in rows:
            print(f"  [{r['bin'][0]:.2f}, {r['bin'][1]:.2f}): {r['acceptance']:.2f} ({r['steps']})")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "tables": tables,
                                        "steps": steps}, indent=1))


if __name__ == "__main__":
    main()
