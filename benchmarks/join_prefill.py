"""`make bench-join`: 16 cold chat requests with one ~220-token system prompt joining in one step, on the 1.5B at its
default precision: the engine's prefill time and tokens, with the prefix cache (the shared part
prefilled once) and without it, alternating, 2 rounds each."""
import json
import time

from specdec.api import TextGenerator
from specdec.core.engine import new_engine, steps
from specdec.core.prefill import common_prefix
from specdec.core.rows import Request
from specdec.core.prefix_cache import PrefixCache
from specdec.verify.sampling import SamplingParams
from specdec.bench.jobs import load_workloads
gen = TextGenerator.load("qwen2.5-coder-1.5b-instruct")
system = ("You are a careful senior engineer. Answer precisely, show code when it helps, keep answers short, "
          "state assumptions, prefer the standard library, explain trade-offs briefly, never invent APIs, and "
          "say so when something is uncertain. Use Python 3.11 unless asked otherwise. Format code in fenced "
          "blocks with the language named. Mention complexity for algorithms. ") * 2
users = [p for c in load_workloads().values() for p in c["prompts"] if isinstance(p, str)][:16]
prompts = [gen.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": u}]) for u in users]
shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
print(json.dumps({"requests": len(prompts), "shared_prefix_tokens": shared, "prompt_tokens": sum(map(len, prompts))}))
for rnd in range(2):
    for cache in ((True, False) if rnd == 0 else (False, True)):
        engine = new_engine(gen.target.model, max(map(len, prompts)) + 64, k_max=0,
                            prefix_cache=PrefixCache(2**30) if cache else None, max_batch=16)
        rows = [engine.add(Request(p, SamplingParams(temperature=0), 1)) for p in prompts]
        t = time.perf_counter()
        for _ in steps(engine, rows):
            pass
        dt = time.perf_counter() - t
        reused = sum(r.result.metrics.cached_prompt_tokens for r in rows)
        print(json.dumps({"prefix_cache": cache, "round": rnd, "seconds": round(dt, 2),
                          "prefill_s": round(engine.metrics.timings.prefill, 2), "reused_tokens": reused,
                          "prefilled_tokens": sum(map(len, prompts)) - reused}))
