import statistics, time, torch
from specdec.api import TextGenerator
from specdec.models import registry
from specdec.runtime import stack
from specdec.bench.measure import _after_prefix
gen = TextGenerator.load(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT, "q4", head=None)
mod = stack.kernel()
print("| model | tokens | no prefetch ms | prefetch 16 ms | saved |")
for name, model in [("1.5B target", gen.target.model), ("0.5B draft", gen.draft_model()[0])]:
    cache, prefix = _after_prefix(model)
    for n in (1, 5, 9):
        block = torch.randint(0, 1000, (1, n))
        times = {0: [], 16: []}
        for i in range(45):
            for pk in (16, 0):
                mod.set_prefetch_keys(pk)
                cache.truncate(prefix)
                t = time.perf_counter(); model(block, cache)
                if i >= 5: times[pk].append(time.perf_counter() - t)
        a, b = (statistics.median(times[p]) * 1e3 for p in (0, 16))
        print(f"| {name} | {n} | {a:.2f} | {b:.2f} | {a-b:.2f} ms ({(a-b)/a:.1%}) |", flush=True)
mod.set_prefetch_keys(16)
