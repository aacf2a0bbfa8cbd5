"""Teacher-forced quality against fp32 (argmax agreement, mean total variation) on fp32's own
greedy continuations of 8 prompts, 64 positions each.

    python docs/bench-q4k/quality.py
"""
import json, sys
from specdec.bench.measure import agreement_with_fp32, CODE_PROMPTS
from specdec.models import registry
prompts = list(CODE_PROMPTS) + [
    "Explain the difference between a process and a thread in two short paragraphs.",
    "Translate to French: The weather is lovely today, so we will walk to the market after lunch.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "A train leaves at 3 pm at 60 km/h and another at 4 pm at 80 km/h from the same station. When does the second catch up?",
]
print(len(prompts), "prompts", flush=True)
out = agreement_with_fp32(registry.DEFAULT_TARGET, ["q4", "q4k"], prompts, positions=64)
print(json.dumps(out, indent=1))
json.dump(out, open("docs/bench-q4k/quality.json", "w"), indent=1)
