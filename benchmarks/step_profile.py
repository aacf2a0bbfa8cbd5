"""Where one decoding step's time goes: q4 GEMM kernel vs everything else, op count, host syncs.

For the default target and draft (q4), after a 300-token prefix, one forward over n = 1 and n = 5
new tokens (a plain step and a k = 4 verification): wall time (median of 9), time inside the q4
kernel (timed around each call), torch ops and ``item()`` host syncs (torch.profiler, 5 steps).
Usage (models installed: ``specdec models install``):

    .venv/bin/python benchmarks/step_profile.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import specdec.runtime.q4 as q4
from specdec.api import TextGenerator

GEMM = [0.0, 0]  # seconds, calls


class _Timed:
    """The q4 kernel module with each call timed (the profiler does not see pybind calls)."""

    def __init__(self, module) -> None:
        self.module = module

    def q4_linear(self, *args):
        t = time.perf_counter()
        y = self.module.q4_linear(*args)
        GEMM[0] += time.perf_counter() - t
        GEMM[1] += 1
        return y


def main() -> None:
    build = q4.kernel
    q4.kernel = lambda: _Timed(build())
    gen = TextGenerator.load("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "q4", head=None)
    print("| model | tokens | wall ms | q4 GEMM ms (calls) | other ms | torch ops | host syncs |")
    print("|---|---|---|---|---|---|---|")
    for name, model in [("1.5B target", gen.target.model), ("0.5B draft", gen.draft.model)]:
        torch.manual_seed(0)
        cache = model.new_cache(1, 600)
        model(torch.randint(0, 1000, (1, 300)), cache)
        prefix = cache.lengths.clone()
        for n in (1, 5):
            block = torch.randint(0, 1000, (1, n))

            def step():
                cache.truncate(prefix)
                model(block, cache)

            for _ in range(3):
                step()
            times = []
            for _ in range(9):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            wall = statistics.median(times)
            GEMM[0], GEMM[1] = 0.0, 0
            for _ in range(5):
                step()
            gemm, calls = GEMM[0] / 5, GEMM[1] / 5
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step()
            stats = {e.key: e.count for e in prof.key_averages()}
            ops = sum(c for k, c in stats.items() if k.startswith("aten::")) / 5
            syncs = stats.get("aten::item", 0) / 5
            print(f"| {name} | {n} | {wall * 1e3:.1f} | {gemm * 1e3:.1f} ({calls:.0f}) | {(wall - gemm) * 1e3:.1f} "
                  f"| {ops:.0f} | {syncs:.0f} |")


if __name__ == "__main__":
    main()
