"""The bench's Markdown report: speed-ups per category, acceptance and target calls, time,
the greedy check per runtime, and the llama.cpp comparison."""

from __future__ import annotations

import statistics
from pathlib import Path


def speedups(runs: list[dict], baseline: str) -> dict[tuple[str, str, float], float]:
    """(method, category, temperature) -> median over prompts of throughput / baseline's."""
    base = {(r["category"], r["prompt"], r["temperature"]): r["metrics"]["throughput_tok_s"]
            for r in runs if r["method"] == baseline}
    ratios: dict[tuple[str, str, float], list[float]] = {}
    for r in runs:
        key = (r["category"], r["prompt"], r["temperature"])
        if key in base and base[key] > 0:
            ratios.setdefault((r["method"], r["category"], r["temperature"]), []).append(
                r["metrics"]["throughput_tok_s"] / base[key])
    return {k: statistics.median(v) for k, v in ratios.items()}


# (label, method prefix, plain-decoding reference) of each runtime in the bench
RUNTIMES = (("specdec speculative", "", "plain"), ("transformers assisted / prompt-lookup", "hf_", "hf_plain"),
            ("llama.cpp speculation (prompt lookup, draft model)", "llamacpp_", "llamacpp_plain"),
            ("OpenVINO GenAI speculative / prompt lookup", "openvino_", "openvino_plain"),
            ("vLLM n-gram speculation", "vllm_", "vllm_plain"))


def _runtime(method: str) -> str:
    return next((prefix for _, prefix, _ in RUNTIMES[1:] if method.startswith(prefix)), "")


def _greedy_diffs(runs: list[dict]) -> list[tuple[dict, str]]:
    """(run, description) for each greedy output that differs from its runtime's plain decoding."""
    refs = {prefix: {(r["category"], r["prompt"]): r["token_ids"] for r in runs
                     if r["method"] == reference and r["temperature"] == 0} for _, prefix, reference in RUNTIMES}
    plains = {reference for _, _, reference in RUNTIMES}
    diffs = []
    for r in runs:
        if r["temperature"] != 0 or r["method"] in plains:
            continue
        expected = refs[_runtime(r["method"])].get((r["category"], r["prompt"]))
        if expected is not None and r["token_ids"] != expected:
            first = next((i for i, (a, b) in enumerate(zip(r["token_ids"], expected)) if a != b), min(len(r["token_ids"]), len(expected)))
            diffs.append((r, f"{r['method']} / {r['category']} #{r['prompt']}: differs from its plain decoding at token {first}"))
    return diffs


def _greedy_check_lines(runs: list[dict]) -> list[str]:
    """One verdict per runtime (its speculative methods vs its own plain decoding), each followed
    by the runs that differ."""
    diffs = _greedy_diffs(runs)
    plains = {reference for _, _, reference in RUNTIMES}
    lines = []
    for label, prefix, reference in RUNTIMES:
        refs = {(r["category"], r["prompt"]) for r in runs if r["method"] == reference and r["temperature"] == 0}
        checked = [r for r in runs if r["temperature"] == 0 and r["method"] not in plains
                   and _runtime(r["method"]) == prefix and (r["category"], r["prompt"]) in refs]
        if not checked:
            continue
        bad = [d for r, d in diffs if _runtime(r["method"]) == prefix]
        if bad:
            lines += [f"{label}: {len(bad)} of {len(checked)} greedy runs differ from `{reference}` "
                      f"({len(checked) - len(bad)} identical):"] + [f"- {d}" for d in bad] + [""]
        else:
            lines += [f"{label}: all {len(checked)} greedy runs are token-identical to `{reference}`.", ""]
    return lines or ["No greedy run has a plain-decoding reference in this bench."]


def _peer_lines(results: dict) -> list[str]:
    """The notes (e.g. skipped methods) and the llama.cpp block-cost comparison."""
    lines = [f"> {note}" for note in results.get("notes") or []]
    peer = results.get("peer_costs")
    if peer:
        lines += ["", f"## Evaluating 5 tokens vs 1 (after a {peer['prefix_tokens']}-token prefix)", "",
                  "| runtime | 1 token ms | 5 tokens ms | ratio | max logit change, alone vs in the block |",
                  "|---|---|---|---|---|"]
        for name in ("specdec", "llama.cpp"):
            c = peer[name]
            ms = {int(k): v for k, v in c["eval_ms"].items()}
            lines.append(f"| {name} | {ms[1]:.1f} | {ms[5]:.1f} | {c['ratio']:.2f}x | {c['logit_max_diff']:.3g} |")
    return lines + [""] if lines else []


def _per_position(acceptance: list[dict], positions: int = 4) -> str:
    """Pooled acceptance of the first ``positions`` draft positions over runs' acceptance dicts."""
    reached, accepted = [0] * positions, [0] * positions
    for a in acceptance:
        for i, (r, n) in enumerate(zip(a.get("reached_per_position", []), a.get("accepted_per_position", []))):
            if i < positions:
                reached[i] += r
                accepted[i] += n
    cells = [f"{n / r:.2f}" for n, r in zip(accepted, reached) if r]
    return " / ".join(cells) if cells else "–"


def write_report(results: dict, plots: list[Path]) -> str:
    """The Markdown report of a bench's ``results`` (see :func:`specdec.bench.jobs.run_bench`),
    linking the figures ``plots`` (written next to it)."""
    runs, env = results["runs"], results["environment"]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    categories = list(dict.fromkeys(r["category"] for r in runs))
    temps = sorted({r["temperature"] for r in runs})
    threads = f"{env['cores']} threads" + (f" on {env['cpu']}" if env.get("cpu") else "")  # (older runs: no CPU)
    lines = [f"# specdec bench report ({env['date']})", "",
             f"Target `{env['target']}`, draft `{env['draft']}`, dtype {env['dtype']}, "
             + (f"answers up to {env['max_new_tokens']} tokens, ending at the end of the model's turn"
                if env.get("stop_at_eos") else f"{env['max_new_tokens']} new tokens per prompt (past the end of the answer: --ignore-eos)")
             + f", torch {env['torch']}, transformers {env['transformers']}, {threads}. "
             "Speed-up = end-to-end tokens/s (prefill included) over the baseline on the same prompt; median over "
             "the category's prompts.", ""]
    for baseline in ("plain", "hf_plain"):
        if baseline not in methods:
            continue
        sp = speedups(runs, baseline)
        for temp in temps:
            ms = [m for m in methods if any((m, c, temp) in sp for c in categories)]
            lines += [f"## Speed-up vs {baseline}, temperature {temp}", "",
                      "| method | " + " | ".join(categories) + " | all |", "|---" * (len(categories) + 2) + "|"]
            for m in ms:
                cells = [f"{sp[(m, c, temp)]:.2f}x" if (m, c, temp) in sp else "–" for c in categories]
                vals = [sp[(m, c, temp)] for c in categories if (m, c, temp) in sp]
                lines.append(f"| {m} | " + " | ".join(cells) + f" | {statistics.median(vals):.2f}x |")
            lines.append("")
    lines += ["## Acceptance and target calls (our speculative methods, all prompts)", "",
              "Acceptance per position: a_i = accepted at draft position i / calls that reached i (every earlier "
              "draft accepted), pooled over the prompts — the a_i of `specdec profile` and the adaptive controller.", "",
              "| method | temperature | accepted/call | acceptance | full-accept rate | acceptance per position | "
              "target calls/token | tok/s |",
              "|---|---|---|---|---|---|---|---|"]
    for m in methods:
        for temp in temps:
            rs = [r for r in runs if r["method"] == m and r["temperature"] == temp and "acceptance" in r["metrics"]]
            if not rs or m == "plain":
                continue
            acc = [r["metrics"]["acceptance"] for r in rs]
            lines.append(f"| {m} | {temp} | {statistics.median(a['mean_accepted_per_call'] for a in acc):.2f} | "
                         f"{statistics.median(a['acceptance_rate'] for a in acc):.0%} | "
                         f"{statistics.median(a['full_acceptance_rate'] for a in acc):.0%} | "
                         f"{_per_position(acc)} | "
                         f"{statistics.median(r['metrics']['target_calls_per_token'] for r in rs):.3f} | "
                         f"{statistics.median(r['metrics']['throughput_tok_s'] for r in rs):.2f} |")
    lines += _time_lines(runs, methods, temps)
    lines += ["", "## Greedy check", ""] + _greedy_check_lines(runs) + _peer_lines(results)
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def _time_lines(runs: list[dict], methods: list[str], temps: list[float]) -> list[str]:
    """The time table: every method that reports its TTFT (a peer's run has no draft share)."""
    lines = ["", "## Time (medians over all prompts)", "",
             "TTFT includes the prefill and the first token; TPOT is the mean time per later token; "
             "draft share is the proposer's part of the total time (the draft's cost; ours only).", "",
             "| method | temperature | TTFT ms | TPOT ms | tok/s | draft share |", "|---|---|---|---|---|---|"]
    for m in methods:
        for temp in temps:
            rs = [r for r in runs if r["method"] == m and r["temperature"] == temp and "ttft_s" in r["metrics"]]
            if not rs:
                continue
            med = {key: statistics.median(r["metrics"][key] for r in rs) for key in ("ttft_s", "tpot_s", "throughput_tok_s")}
            ours = all("time_breakdown_s" in r["metrics"] for r in rs)
            share = statistics.median(r["metrics"]["time_breakdown_s"]["draft"] / r["metrics"]["total_s"]
                                      for r in rs) if ours else None
            lines.append(f"| {m} | {temp} | {med['ttft_s'] * 1e3:.0f} | {med['tpot_s'] * 1e3:.1f} | "
                         f"{med['throughput_tok_s']:.2f} | {'–' if share is None else f'{share:.1%}'} |")
    return lines
