"""Issue 11's two step ratios for q4 and q4k, all steps alternating in one process (after the same
300-token prefix, median of 40): the 0.5B draft's 1-token step (pruned output layer, as proposers
run it) over the target's 1-token step, and the target's 5-token over its 1-token step.

    python docs/bench-q4k/ratios.py
"""
import statistics, time, torch
from specdec.api import TextGenerator
from specdec.models import registry
from specdec.bench.measure import _after_prefix

runs = []
for dt in ("q4", "q4k"):
    gen = TextGenerator.load(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT, dt, head=None)
    for name, model, n in (("target", gen.target.model, 1), ("target", gen.target.model, 5), ("draft", gen.draft_model()[0], 1)):
        cache, prefix = _after_prefix(model)
        runs.append((dt, name, n, model, cache, prefix, []))
for i in range(45):
    for dt, name, n, model, cache, prefix, times in runs:
        cache.truncate(prefix)
        block = torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(i))
        t = time.perf_counter()
        model(block, cache)
        if i >= 5:
            times.append(time.perf_counter() - t)
med = {(r[0], r[1], r[2]): statistics.median(r[6]) * 1e3 for r in runs}
print("| dtype | target 1 token ms | target 5 tokens ms | draft 1 token ms | 5 / 1 tokens | draft / target |")
print("|---|---|---|---|---|---|")
for dt in ("q4", "q4k"):
    t1, t5, d1 = med[(dt, "target", 1)], med[(dt, "target", 5)], med[(dt, "draft", 1)]
    print(f"| {dt} | {t1:.2f} | {t5:.2f} | {d1:.2f} | {t5 / t1:.2f}x | {d1 / t1:.3f} |")
