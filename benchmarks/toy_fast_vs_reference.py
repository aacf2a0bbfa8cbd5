"""Side-by-side timing of the toy experiment: scalar reference loop vs batched --fast mode.

Both simulate the same number of tokens (plain target sampling + speculative sampling) on the seed
pair; the report is the ratio of medians. Usage:

    .venv/bin/python benchmarks/toy_fast_vs_reference.py [--tokens 100000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

from specdec.toy import run_fast, run_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ref, fast = [], []
    for i in range(args.repeats):
        ref.append(run_reference(tokens=args.tokens).seconds)
        fast.append(run_fast(tokens=args.tokens, speculative_seed=303 + i).seconds)
        print(f"run {i + 1}: reference {ref[-1]:.3f} s, fast {fast[-1]:.4f} s")
    r, f = statistics.median(ref), statistics.median(fast)
    print(f"median reference {r:.3f} s, median fast {f:.4f} s, fast/reference speed ratio {r / f:.0f}x")


if __name__ == "__main__":
    main()
