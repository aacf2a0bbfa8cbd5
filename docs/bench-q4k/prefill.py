"""q4 against q4k: one prefill of 30 / 100 / 300 / 500 random tokens (logits of the last position),
alternating in one process, median of 5.

    python docs/bench-q4k/prefill.py
"""
import statistics, time, torch
from specdec.api import TextGenerator
from specdec.models import registry
m = {d: TextGenerator.load(registry.DEFAULT_TARGET, None, d, head=None).target.model for d in ("q4", "q4k")}
for n in (30, 100, 300, 500):
    ids = torch.randint(0, 10000, (1, n), generator=torch.Generator().manual_seed(0))
    last = torch.tensor([[n - 1]])
    t = {d: [] for d in m}
    for i in range(5):
        for d in (("q4", "q4k") if i % 2 else ("q4k", "q4")):
            s = time.perf_counter(); m[d](ids, m[d].new_cache(1, n), logit_index=last); t[d].append(time.perf_counter() - s)
    a, b = (statistics.median(t[d]) * 1e3 for d in ("q4", "q4k"))
    print(f"| {n} | {a:.0f} ms ({n/a*1e3:.0f} tok/s) | {b:.0f} ms ({n/b*1e3:.0f} tok/s) | {b/a:.3f} |", flush=True)
