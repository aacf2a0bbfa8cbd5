"""q4 against q4k: the target's and the 0.5B draft's forward over 1, 5, 9 and 16 new tokens after a
300-token prefix, the two runtimes alternating step by step in one process (median of 26).

    python docs/bench-q4k/steps.py
"""
import statistics, time, torch, sys
from specdec.api import TextGenerator
from specdec.models import registry
from specdec.bench.measure import _after_prefix
res = {}
models = {}
for dt in ("q4", "q4k"):
    t0 = time.time()
    gen = TextGenerator.load(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT, dt, head=None)
    print(dt, "loaded in", round(time.time() - t0, 1), "s", flush=True)
    models[dt] = [("target", gen.target.model), ("draft", gen.draft_model()[0])]
print("| model | tokens | q4 ms | q4k ms | q4k/q4 |")
for idx in (0, 1):
    caches = {dt: _after_prefix(models[dt][idx][1]) for dt in models}
    for n in (1, 5, 9, 16):
        block = torch.randint(0, 1000, (1, n))
        times = {dt: [] for dt in models}
        for i in range(30):
            for dt in (("q4", "q4k") if i % 2 else ("q4k", "q4")):
                cache, prefix = caches[dt]
                cache.truncate(prefix)
                t = time.perf_counter(); models[dt][idx][1](block, cache)
                if i >= 4: times[dt].append(time.perf_counter() - t)
        a, b = (statistics.median(times[d]) * 1e3 for d in ("q4", "q4k"))
        print(f"| {models['q4'][idx][0]} | {n} | {a:.2f} | {b:.2f} | {b/a:.3f} |", flush=True)
