"""The most any chain proposer could give on this machine: end-to-end ratio bounds from a bench.

Speculation shortens only the decode phase. For each ``plain`` run of a bench (its prefill time
``T0``, its decode time ``D`` over ``N - 1`` tokens after the first, so a step costs
``s = D / (N - 1)``), a proposer whose drafts are accepted with probability ``a`` at every
position (each given the ones before, the i.i.d. model of Leviathan et al.) and that drafts ``k``
tokens per call at ``c`` target steps each commits ``E(k) = (1 - a^(k+1)) / (1 - a)`` tokens per
call for ``r(k + 1) + k c`` steps of time, where ``r(n)`` is the measured cost of a target call
scoring ``n`` positions over a one-position call (`python -m specdec.bench.measure dtypes` prints
it; linear between measured sizes). Its end-to-end ratio on that prompt is

    (T0 + D) / (T0 + D * (r(k + 1) + k c) / E(k)),

with the best ``k <= k_max`` for that ``a`` (the same for every prompt: it depends on ``a``, ``r``
and ``c`` alone). This prints, for a grid of ``a``, the median over the bench's categories of
the per-category medians (the bench's own summary), the decode phase's ratio, and the k chosen.
``a = 1`` with ``c = 0`` bounds every chain proposer at ``k <= k_max``: no head can pass it on
this machine at this answer length. What it leaves out: a copy proposer's long runs are a
proposer with ``a`` near 1 on part of the text, and trees; both are within the ``a = 1`` bound.

    .venv/bin/python benchmarks/speed_ceiling.py docs/head-eval/bench8-q4k-shared-costs-zen3.runs.jsonl \\
        --verify-costs 1:1,5:1.89,9:3.18 --draft-cost 0.04
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from specdec.core import adaptive


def parse_costs(text: str) -> dict[int, float]:
    """``"1:1,5:1.89"`` -> {1: 1.0, 5: 1.89}; n = 1 must be there (the unit)."""
    costs = {int(n): float(c) for n, c in (part.split(":") for part in text.split(","))}
    if costs.get(1) != 1.0:
        raise ValueError("verify_costs must give n = 1 as 1.0 (the unit of a one-position call)")
    if any(n < 1 or c <= 0 for n, c in costs.items()):
        raise ValueError("verify_costs needs positions n >= 1 and positive costs")
    if len(costs) < 2:
        raise ValueError("verify_costs needs a second size: the cost of more positions is what is bounded")
    return costs


def best_k(a: float, costs: dict[int, float], draft_cost: float, k_max: int) -> tuple[int, float]:
    """(k, steps of time per token) at acceptance ``a`` at every position: the choice of
    ``--k auto``'s controller (:func:`specdec.core.adaptive.best_k`) given these costs, r(n)
    interpolated as the controller does (:func:`specdec.core.adaptive.verify_costs`)."""
    accept, verify = [a] * k_max, adaptive.verify_costs(costs, k_max + 1)  # verify[n - 1]: n positions
    k = adaptive.best_k(accept, draft_cost, verify, k_max)
    return k, (verify[k] + k * draft_cost) / adaptive.expected_tokens(accept, k)


def bounds(runs: list[dict], a: float, costs: dict[int, float], draft_cost: float, k_max: int,
           temperature: float) -> dict:
    """End-to-end and decode ratios over ``plain`` at acceptance ``a``: per-category medians and
    their median, as the bench summarises."""
    k, per_token = best_k(a, costs, draft_cost, k_max)
    e2e = defaultdict(list)
    for r in runs:
        m = r["metrics"]
        if r["method"] != "plain" or r["temperature"] != temperature or m["generated_tokens"] < 2:
            continue
        t0, decode = m["ttft_s"], m["total_s"] - m["ttft_s"]
        e2e[r["category"]].append((t0 + decode) / (t0 + decode * per_token))
    cats = {c: statistics.median(v) for c, v in e2e.items()}
    return {"a": a, "k": k, "decode": 1 / per_token, "categories": cats,
            "median": statistics.median(cats.values()) if cats else float("nan")}


def prefill_share(runs: list[dict], temperature: float) -> float:
    """Median over plain runs of prefill time over end-to-end time."""
    shares = [r["metrics"]["ttft_s"] / r["metrics"]["total_s"] for r in runs
              if r["method"] == "plain" and r["temperature"] == temperature and r["metrics"]["total_s"] > 0]
    return statistics.median(shares) if shares else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("runs", type=Path, help="a bench's runs.jsonl with plain runs")
    ap.add_argument("--verify-costs", required=True,
                    help="n:r(n) pairs, a call scoring n positions over a one-position call, e.g. 1:1,5:1.89,9:3.18")
    ap.add_argument("--draft-cost", type=float, default=0.0, help="target steps per drafted token (default: 0)")
    ap.add_argument("--k-max", type=int, default=8, help="the most drafts per call (default: 8, --k auto's)")
    ap.add_argument("--acceptance", default="0.3,0.4,0.5,0.65,0.8,0.9,1.0",
                    help="per-position acceptance values to tabulate (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="which plain runs to read (default: 0)")
    args = ap.parse_args()
    costs = parse_costs(args.verify_costs)
    runs = [json.loads(line) for line in args.runs.read_text().splitlines() if line.strip()]
    if not any(r["method"] == "plain" and r["temperature"] == args.temperature for r in runs):
        raise SystemExit(f"{args.runs}: no plain runs at temperature {args.temperature}")
    print(f"plain runs at T = {args.temperature}: prefill is {prefill_share(runs, args.temperature):.0%} of "
          f"end-to-end time (median); verify costs {costs}, draft cost {args.draft_cost} steps, k <= {args.k_max}")
    rows = [bounds(runs, float(a), costs, args.draft_cost, args.k_max, args.temperature)
            for a in args.acceptance.split(",")]
    cats = sorted(rows[0]["categories"])
    print("| a | k | decode | end to end, median of categories | " + " | ".join(cats) + " |")
    print("|---" * (4 + len(cats)) + "|")
    for row in rows:
        print(f"| {row['a']:.2f} | {row['k']} | {row['decode']:.2f}x | {row['median']:.2f}x | "
              + " | ".join(f"{row['categories'][c]:.2f}x" for c in cats) + " |")


if __name__ == "__main__":
    main()
