"""Paired per-prompt speed ratios of bench methods against a baseline, from a bench's runs.jsonl.

A bench alternates methods prompt by prompt, so the ratio of two methods on the same prompt and
temperature cancels most of the machine's drift. This prints, per temperature, the median and
geometric mean of those ratios (end-to-end tokens/s, prefill included) and on how many prompts
the method was faster, with the two-sided sign-test p-value of that count.

    .venv/bin/python benchmarks/paired.py OUT/runs.jsonl --base hybrid_head_g0 --methods hybrid_head
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path


def sign_test(wins: int, n: int) -> float:
    """Two-sided binomial p-value of ``wins`` of ``n`` under a fair coin."""
    tail = sum(math.comb(n, i) for i in range(max(wins, n - wins), n + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(runs: list[dict], base: str, method: str, temperature: float) -> list[float]:
    by = {(r["method"], r["category"], r["prompt"], r["temperature"]): r["metrics"]["throughput_tok_s"] for r in runs}
    return [speed / by[(base, c, p, t)] for (m, c, p, t), speed in sorted(by.items())
            if m == method and t == temperature and (base, c, p, t) in by]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--base", default="plain")
    ap.add_argument("--methods", required=True, help="comma-separated")
    args = ap.parse_args()
    runs = [json.loads(line) for line in args.runs.read_text().splitlines() if line.strip()]
    for t in sorted({r["temperature"] for r in runs}):
        for method in args.methods.split(","):
            ratios = paired(runs, args.base, method, t)
            if not ratios:
                continue
            wins = sum(r > 1 for r in ratios)
            print(f"T = {t}: {method} / {args.base}: median {statistics.median(ratios):.3f}, geometric mean "
                  f"{statistics.geometric_mean(ratios):.3f}, faster on {wins}/{len(ratios)} prompts "
                  f"(sign test p = {sign_test(wins, len(ratios)):.3g})")


if __name__ == "__main__":
    main()
