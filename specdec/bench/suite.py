"""``specdec bench``: the project's benchmark — every method side by side, on one machine, in one run.

Methods (``--methods``, comma-separated):

* ``hf_plain``, ``hf_assisted``, ``hf_prompt_lookup`` — transformers ``generate()`` on the same
  weights and dtype (int8: ``quantize_dynamic``), plain / with the draft model / prompt lookup;
* ``plain`` — our plain decoding;
* ``draft``, ``draft_auto``, ``ngram``, ``early_exit``, ``hybrid`` — our speculative variants
  (``draft`` with fixed ``--k``, the others with adaptive k);
* ``head``, ``head_auto``, ``hybrid_head`` — the target's draft head (fixed ``--k`` / adaptive k /
  with n-gram lookup when it matches, adaptive k);
* ``suffix``, ``head_tree``, ``hybrid_tree`` — candidate trees (suffix lookup / the head's dynamic
  trees / suffix when it matches, else head trees), node budget chosen each step;
* ``ngram_kN`` / ``draft_kN`` / ``head_kN`` / ``head_tree_kN`` — fixed k = N (for trees: N nodes);
* ``llamacpp_plain``, ``llamacpp_spec`` — llama.cpp on the same GGUF file and threads, plain and
  with its prompt-lookup speculation (optional extra; see :mod:`specdec.bench.llamacpp`). Without
  the extra they are skipped and the report says so. With them, the report also compares the two
  runtimes' cost of evaluating 5 tokens against 1 and how far a token's logits move between the two.

Every run is appended to ``runs.jsonl`` in ``--out`` as soon as it finishes, and a rerun skips
runs already there, so an interrupted bench resumes. At the end ``results.json`` (all runs, the
three metric classes, the environment), ``report.md`` and PNG plots are written.

Speed-up is end-to-end tokens per second (prefill included) relative to our plain decoding and
to transformers' plain decoding on the same prompt and temperature; each method's figure per
category is the median over the category's prompts.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from importlib import resources
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.bench import llamacpp
from specdec.sampling import SamplingParams

ALL_METHODS = ["hf_plain", "hf_assisted", "hf_prompt_lookup", "plain", "draft", "draft_auto", "ngram",
               "early_exit", "hybrid", "ngram_k1", "ngram_k2", "ngram_k4", "ngram_k8",
               "draft_k1", "draft_k2", "draft_k4", "draft_k8", "head", "head_auto", "hybrid_head",
               "suffix", "head_tree", "hybrid_tree", "llamacpp_plain", "llamacpp_spec"]
QUICK_METHODS = ["hf_plain", "hf_assisted", "plain", "draft_auto", "ngram", "hybrid", "ngram_k2", "ngram_k8"]


FIXED_K = ("ngram", "draft", "head", "head_tree")  # methods that also run as NAME_kN (k = N)


def known_method(method: str) -> bool:
    if method in ALL_METHODS:
        return True
    name, _, k = method.rpartition("_k")
    return name in FIXED_K and k.isdigit() and int(k) >= 1


def load_workloads() -> dict:
    data = json.loads(resources.files("specdec.bench").joinpath("workloads.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def _method_spec(method: str, k_fixed: int) -> tuple[str | None, int | str]:
    """(proposer, k) for our methods."""
    if method == "plain":
        return None, 0
    if method in ("draft", "head"):
        return method, k_fixed
    if method.endswith("_auto") or method in ("ngram", "early_exit", "hybrid", "hybrid_head", "suffix",
                                              "head_tree", "hybrid_tree"):
        return method.replace("_auto", "").replace("_", "-"), "auto"
    name, k = method.rsplit("_k", 1)
    return name.replace("_", "-"), int(k)


class Bench:
    def __init__(self, target: str, draft: str, dtype: str, max_new_tokens: int, k: int, k_max: int,
                 head: str | Path | None = "auto"):
        from specdec.api import TextGenerator

        self.gen = TextGenerator.load(target, draft, dtype, head=head)
        self.gen.eos_token_ids = set()  # every method generates exactly max_new_tokens
        self.dtype, self.max_new_tokens, self.k, self.k_max = dtype, max_new_tokens, k, k_max
        self._hf = None
        self._llamacpp = None
        self.target_name = target

    def llamacpp(self):
        if self._llamacpp is None:
            from specdec.bench.llamacpp import LlamaCpp, gguf_file

            self._llamacpp = LlamaCpp(gguf_file(self.target_name), torch.get_num_threads(), 4096, self.k)
        return self._llamacpp

    def hf(self):
        if self._hf is None:
            from specdec.bench.hf import load_hf

            self._hf = (load_hf(self.gen.target.source_dir, self.dtype), load_hf(self.gen.draft.source_dir, self.dtype))
        return self._hf

    def encode(self, prompt) -> list[int]:
        return self.gen.encode_chat(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])

    def run(self, method: str, prompt_ids: list[int], temperature: float, seed: int) -> dict:
        if method.startswith("llamacpp_"):
            return self.llamacpp().run(method, prompt_ids, self.max_new_tokens, temperature, seed)
        if method.startswith("hf_"):
            from specdec.bench.hf import hf_generate

            target, draft = self.hf()
            ids, seconds = hf_generate(target, prompt_ids, self.max_new_tokens, temperature, seed,
                                       assistant=draft if method == "hf_assisted" else None,
                                       prompt_lookup=method == "hf_prompt_lookup")
            n = len(ids)
            return {"token_ids": ids, "metrics": {"generated_tokens": n, "total_s": seconds,
                                                  "throughput_tok_s": n / seconds}}
        proposer, k = _method_spec(method, self.k)
        result = self.gen.generate([prompt_ids], SamplingParams(temperature=temperature), self.max_new_tokens,
                                   k=k, seed=seed, proposer=proposer, k_max=self.k_max)[0]
        return {"token_ids": result.token_ids, "metrics": result.batch_metrics.to_dict()}


def run_bench(out: Path, methods: list[str], temperatures: list[float], prompts_per_category: int | None,
              target: str, draft: str, dtype: str, max_new_tokens: int, k: int, k_max: int,
              categories: list[str] | None = None, head: str | Path | None = "auto") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    done = {}
    if log.exists():
        for line in log.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[(r["method"], r["category"], r["prompt"], r["temperature"])] = r
    workloads = load_workloads()
    if categories:
        unknown = [c for c in categories if c not in workloads]
        if unknown:
            raise ValueError(f"unknown categories {unknown}; choose from {', '.join(workloads)}")
        workloads = {c: workloads[c] for c in categories}
    jobs = []
    # Prompt-major order: an interrupted run has every category up to the same prompt index.
    most = max(len(spec["prompts"]) for spec in workloads.values())
    for i in range(min(most, prompts_per_category or most)):
        for category, spec in workloads.items():
            if i >= len(spec["prompts"]):
                continue
            for temp in temperatures:
                for method in methods:
                    if temp > 0 and ("_k" in method):
                        continue  # the k sweep is greedy only
                    jobs.append((method, category, i, spec["prompts"][i], temp))
    todo = [j for j in jobs if (j[0], j[1], j[2], j[4]) not in done]
    notes = []
    wants_llamacpp = any(m in llamacpp.METHODS for m in methods)
    if wants_llamacpp and not llamacpp.available():
        notes.append(f"llama.cpp methods skipped: llama-cpp-python is not installed ({llamacpp.INSTALL_HINT}).")
        jobs = [j for j in jobs if j[0] not in llamacpp.METHODS]
        todo = [j for j in todo if j[0] not in llamacpp.METHODS]
    bench = Bench(target, draft, dtype, max_new_tokens, k, k_max, head) if todo or (wants_llamacpp and not notes) else None
    with open(log, "a") as f:
        for method, category, i, prompt, temp in tqdm(todo, desc="specdec bench", unit="run"):
            record = {"method": method, "category": category, "prompt": i, "temperature": temp}
            record.update(bench.run(method, bench.encode(prompt), temp, seed=i))
            f.write(json.dumps(record) + "\n")
            f.flush()
            done[(method, category, i, temp)] = record
    peer = None
    if wants_llamacpp and not notes:  # the block-cost comparison, on the first prompt's tokens
        ids = bench.encode(next(iter(workloads.values()))["prompts"][0])
        prefix, block = ids[:-5], ids[-5:]
        peer = {"llama.cpp": bench.llamacpp().block_costs(prefix, block),
                "specdec": llamacpp.specdec_block_costs(bench.gen.target.model, prefix, block),
                "prefix_tokens": len(prefix)}
    runs = [done[(j[0], j[1], j[2], j[4])] for j in jobs]
    env = {"cpu": platform.processor() or platform.machine(), "cores": torch.get_num_threads(),
           "python": platform.python_version(), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "dtype": dtype, "target": target,
           "draft": draft, "max_new_tokens": max_new_tokens, "k": k, "k_max": k_max,
           "date": time.strftime("%Y-%m-%d %H:%M")}
    results = {"environment": env, "runs": runs, "grounded": {c: s["grounded"] for c, s in workloads.items()},
               "notes": notes, "peer_costs": peer}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    report = write_report(results, out)
    (out / "report.md").write_text(report)
    return results


def _speedups(runs: list[dict], baseline: str) -> dict[tuple[str, str, float], float]:
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
            ("llama.cpp prompt-lookup speculation", "llamacpp_", "llamacpp_plain"))


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


def write_report(results: dict, out: Path) -> str:
    runs, env = results["runs"], results["environment"]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    categories = list(dict.fromkeys(r["category"] for r in runs))
    temps = sorted({r["temperature"] for r in runs})
    lines = [f"# specdec bench report ({env['date']})", "",
             f"Target `{env['target']}`, draft `{env['draft']}`, dtype {env['dtype']}, {env['max_new_tokens']} new tokens "
             f"per prompt, torch {env['torch']}, transformers {env['transformers']}, {env['cores']} threads. "
             "Speed-up = end-to-end tokens/s (prefill included) over the baseline on the same prompt; median over "
             "the category's prompts.", ""]
    for baseline in ("plain", "hf_plain"):
        if baseline not in methods:
            continue
        sp = _speedups(runs, baseline)
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
              "| method | temperature | accepted/call | acceptance | full-accept rate | target calls/token | tok/s |",
              "|---|---|---|---|---|---|---|"]
    for m in methods:
        for temp in temps:
            rs = [r for r in runs if r["method"] == m and r["temperature"] == temp and "acceptance" in r["metrics"]]
            if not rs or m == "plain":
                continue
            acc = [r["metrics"]["acceptance"] for r in rs]
            lines.append(f"| {m} | {temp} | {statistics.median(a['mean_accepted_per_call'] for a in acc):.2f} | "
                         f"{statistics.median(a['acceptance_rate'] for a in acc):.0%} | "
                         f"{statistics.median(a['full_acceptance_rate'] for a in acc):.0%} | "
                         f"{statistics.median(r['metrics']['target_calls_per_token'] for r in rs):.3f} | "
                         f"{statistics.median(r['metrics']['throughput_tok_s'] for r in rs):.2f} |")
    lines += ["", "## Time (our methods, medians over all prompts)", "",
              "TTFT includes the prefill and the first token; TPOT is the mean time per later token; "
              "draft share is the proposer's part of the total time (the draft's cost).", "",
              "| method | temperature | TTFT ms | TPOT ms | tok/s | draft share |", "|---|---|---|---|---|---|"]
    for m in methods:
        for temp in temps:
            rs = [r for r in runs if r["method"] == m and r["temperature"] == temp and "ttft_s" in r["metrics"]]
            if not rs:
                continue
            med = {key: statistics.median(r["metrics"][key] for r in rs) for key in ("ttft_s", "tpot_s", "throughput_tok_s")}
            share = statistics.median(r["metrics"]["time_breakdown_s"]["draft"] / r["metrics"]["total_s"] for r in rs)
            lines.append(f"| {m} | {temp} | {med['ttft_s'] * 1e3:.0f} | {med['tpot_s'] * 1e3:.1f} | "
                         f"{med['throughput_tok_s']:.2f} | {share:.1%} |")
    lines += ["", "## Greedy check", ""] + _greedy_check_lines(runs) + _peer_lines(results)
    plots = write_plots(runs, out)
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def _save(fig, ax, path: Path, title: str, paths: list[Path]) -> None:
    """Title, lay out, write and close one figure; record its path."""
    import matplotlib.pyplot as plt

    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)


def write_plots(runs: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    sp = _speedups(runs, "plain")
    methods = [m for m in dict.fromkeys(r["method"] for r in runs) if "_k" not in m]
    categories = list(dict.fromkeys(r["category"] for r in runs))
    if sp:
        fig, ax = plt.subplots(figsize=(11, 4.5))
        width = 0.8 / max(1, len(methods))
        for j, m in enumerate(methods):
            vals = [sp.get((m, c, 0.0), 0.0) for c in categories]
            ax.bar([i + j * width for i in range(len(categories))], vals, width, label=m)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(categories))], categories)
        ax.set_ylabel("speed-up vs specdec plain (greedy)")
        ax.legend(fontsize=7, ncol=3)
        _save(fig, ax, out / "speedup_by_category.png", "Speed-up by category and method", paths)
    hists: dict[str, list[int]] = {}
    for r in runs:
        acc = r["metrics"].get("acceptance")
        if acc and acc["verify_calls_with_drafts"]:
            h = hists.setdefault(r["method"], [0] * len(acc["first_rejection_histogram"]))
            h.extend([0] * (len(acc["first_rejection_histogram"]) - len(h)))
            for i, c in enumerate(acc["first_rejection_histogram"]):
                h[i] += c
    if any(sum(h) for h in hists.values()):
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # more methods than the default 10 colours
        for m, h in hists.items():
            if sum(h):
                ax.plot(range(len(h)), [c / sum(h) for c in h], marker="o", label=m)
        ax.set_xlabel("position of the first rejected draft (0 = the first draft)")
        ax.set_ylabel("fraction of rejecting calls")
        ax.legend(fontsize=7)
        _save(fig, ax, out / "first_rejection.png", "First-rejection position", paths)
    sweep: dict[str, dict[int, list[float]]] = {}
    for (m, c, t), v in sp.items():
        if "_k" in m and t == 0:
            name, k = m.rsplit("_k", 1)
            sweep.setdefault(name, {}).setdefault(int(k), []).append(v)
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, ks in sweep.items():
            xs = sorted(ks)
            ax.plot(xs, [statistics.median(ks[x]) for x in xs], marker="o", label=name)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xlabel("k (fixed)")
        ax.set_ylabel("speed-up vs plain (median over categories)")
        ax.legend()
        _save(fig, ax, out / "speedup_vs_k.png", "Speed-up against k", paths)
    return paths
