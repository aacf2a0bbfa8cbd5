"""The q4 kernel's rate on the target's real layers, by rows per call and threads.

Every linear of the default target (28 layers x qkv, o, gate_up, down) is called in turn on M
random rows, so the weights stream from memory as in a forward; the median of 4 timed rounds after
a warm-up gives GMAC/s (M x the layers' in x out products per second). Rounds of 1 and 2 threads
alternate, so the two compare one machine state. It says how far a many-row call (verification,
prefill) is from the core's integer-dot peak, and how well it scales over the cores.

    .venv/bin/python benchmarks/kernel_threads.py --rows 1,5,60 --dtype q4k
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.api import TextGenerator
from specdec.models import registry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--dtype", default="q4k", choices=["q4", "q4k"])
    ap.add_argument("--rows", default="1,5,60", help="rows per call, comma-separated (default: %(default)s)")
    ap.add_argument("--threads", default="1,2,1,2", help="thread counts in the order run (default: %(default)s)")
    args = ap.parse_args()
    model = TextGenerator.load(args.target, None, args.dtype, head=None).target.model
    linears = [lin for block in model.blocks for lin in (block.qkv, block.o, block.gate_up, block.down)]
    macs = sum(lin.in_features * lin.out_features for lin in linears)
    print(f"{args.target} ({args.dtype}): {len(linears)} linears, {macs / 1e9:.2f} GMAC per row")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, lin.in_features) for lin in linears]  # [M, in] per linear
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            times = []
            for _ in range(5):
                t = time.perf_counter()
                for lin, x in zip(linears, xs):
                    lin.forward(x)
                times.append(time.perf_counter() - t)
            seconds = statistics.median(times[1:])
            print(f"rows {rows}, threads {threads}: {seconds * 1e3:.1f} ms, {macs * rows / seconds / 1e9:.1f} GMAC/s")


if __name__ == "__main__":
    main()
