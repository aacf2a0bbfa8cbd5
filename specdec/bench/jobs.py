"""``specdec bench``: the project's benchmark — every method side by side, on one machine, in one run.

This module owns the jobs (methods, workloads, running and resuming); :mod:`specdec.bench.report`
writes the Markdown report and :mod:`specdec.bench.plots` the figures.

Methods (``--methods``, comma-separated):

* ``hf_plain``, ``hf_assisted``, ``hf_prompt_lookup`` — transformers ``generate()`` on the same
  weights and dtype (int8: ``quantize_dynamic``), plain / with the draft model / prompt lookup;
* ``plain`` — our plain decoding;
* ``draft``, ``draft_auto``, ``ngram``, ``early_exit``, ``hybrid`` — our speculative variants
  (``draft`` with fixed ``--k``, the others with adaptive k);
* ``head``, ``head_auto``, ``hybrid_head`` — the target's draft head (fixed ``--k`` / adaptive k /
  with lookup (the suffix copy, as chains) when it matches, adaptive k);
* ``suffix``, ``head_tree``, ``hybrid_tree`` — candidate trees (suffix lookup / the head's dynamic
  trees / suffix when it matches, else head trees), node budget chosen each step;
* ``ngram_kN`` / ``draft_kN`` / ``head_kN`` / ``head_tree_kN`` — fixed k = N (for trees: N nodes);
* ``llamacpp_plain``, ``llamacpp_spec`` — llama.cpp on the same GGUF file and threads, plain and
  with its prompt-lookup speculation (optional extra; see :mod:`specdec.bench.llamacpp`). With
  them, the report also compares the two runtimes' cost of evaluating 5 tokens against 1 and how
  far a token's logits move between the two.
* ``llamacpp_draft`` — llama.cpp's draft-model speculation (``llama-server -md``, the draft
  GGUF of ``--draft``; built by ``make llama-server``, see :mod:`specdec.bench.llama_server`).
* ``openvino_plain``, ``openvino_spec``, ``openvino_lookup`` — OpenVINO GenAI on the same GGUF
  files and threads (optional extra; see :mod:`specdec.bench.openvino`).
* ``vllm_plain``, ``vllm_ngram`` — vLLM's CPU backend from a venv of its own, plain and with its
  n-gram speculation (see :mod:`specdec.bench.vllm_server`).

A peer that is not installed is skipped, and one that fails on this machine or these files is
dropped after its first error; the report says which, in one line each. Neither fails the bench.

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
import time
from importlib import resources
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.bench import llama_server, llamacpp, openvino, vllm_server
from specdec.models import loading
from specdec.bench.plots import write_plots
from specdec.bench.report import write_report
from specdec.proposers.suffix import SuffixHistory
from specdec.runtime.native import cpu_name
from specdec.verify.sampling import SamplingParams
from specdec.speculation import METHODS

ALL_METHODS = ["hf_plain", "hf_assisted", "hf_prompt_lookup", "plain", "draft", "draft_auto", "ngram",
               "early_exit", "hybrid", "ngram_k1", "ngram_k2", "ngram_k4", "ngram_k8",
               "draft_k1", "draft_k2", "draft_k4", "draft_k8", "head", "head_auto", "hybrid_head",
               "suffix", "head_tree", "hybrid_tree", "llamacpp_plain", "llamacpp_spec", *llama_server.METHODS,
               *openvino.METHODS, *vllm_server.METHODS]
PEERS = (llamacpp, llama_server, openvino, vllm_server)  # optional runtimes: METHODS, available(), INSTALL_HINT
QUICK_METHODS = ["hf_plain", "hf_assisted", "plain", "draft_auto", "ngram", "hybrid", "ngram_k2", "ngram_k8"]


FIXED_K = ("ngram", "draft", "head", "head_tree")  # methods that also run as NAME_kN (k = N)


def known_method(method: str) -> bool:
    """One of :data:`ALL_METHODS`, ``NAME_kN`` for a :data:`FIXED_K` name, or any key of
    :data:`specdec.speculation.METHODS` with ``_`` for ``-`` (adaptive k), which is how a script
    that registers a method of its own benches it."""
    if method in ALL_METHODS or _registered(method):
        return True
    name, _, k = method.rpartition("_k")
    return name in FIXED_K and k.isdigit() and int(k) >= 1


def load_workloads(include_extra: bool = False) -> dict:
    """The prompt categories; ``extra`` ones (e.g. ``editing``) only with ``include_extra``, so the
    default bench stays the six Spec-Bench-like categories its medians are quoted over."""
    data = json.loads(resources.files("specdec.bench").joinpath("workloads.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_") and (include_extra or not v.get("extra"))}


def _registered(method: str) -> bool:
    """A :data:`~specdec.speculation.METHODS` key (``_`` for ``-``) other than plain's "none"."""
    return method != "none" and method.replace("_", "-") in METHODS


def _method_spec(method: str, k_fixed: int) -> tuple[str, int | str]:
    """(method of :data:`specdec.speculation.METHODS`, k) for the bench's method names."""
    if method == "plain":
        return "none", 0
    if method in ("draft", "head"):
        return method, k_fixed
    if method.endswith("_auto") or _registered(method):
        return method.replace("_auto", "").replace("_", "-"), "auto"
    name, k = method.rsplit("_k", 1)
    return name.replace("_", "-"), int(k)


class Bench:
    def __init__(self, target: str, draft: str, dtype: str, max_new_tokens: int, k: int, k_max: int,
                 head: str | Path | None = "auto"):
        from specdec.api import TextGenerator

        self.gen = TextGenerator.load(target, draft, dtype, head=head)
        self.dtype, self.max_new_tokens, self.k, self.k_max = dtype, max_new_tokens, k, k_max
        self._hf = None
        self._llamacpp = None
        self._llama_server = None
        self._openvino = None
        self._vllm = None
        self.target_name, self.draft_name = target, draft

    def llamacpp(self):
        if self._llamacpp is None:
            from specdec.bench.llamacpp import LlamaCpp, gguf_file

            self._llamacpp = LlamaCpp(gguf_file(self.target_name), torch.get_num_threads(), 4096, self.k)
        return self._llamacpp

    def llama_server(self):
        if self._llama_server is None:
            from specdec.bench.llamacpp import gguf_file

            draft = gguf_file(self.draft_name) if self.draft_name else None
            self._llama_server = llama_server.LlamaServer(gguf_file(self.target_name), draft, torch.get_num_threads())
        return self._llama_server

    def vllm(self):
        if self._vllm is None:
            self._vllm = vllm_server.VllmServer(loading.hf_directory(self.gen.target))
        return self._vllm

    def close(self) -> None:
        """Stop the peer processes this bench started (llama-server, vLLM)."""
        for server in (self._llama_server, self._vllm):
            if server is not None:
                server.close()

    def openvino(self):
        if self._openvino is None:
            from specdec.bench.llamacpp import gguf_file
            from specdec.bench.openvino import OpenVino

            draft = gguf_file(self.draft_name) if self.draft_name else None
            self._openvino = OpenVino(gguf_file(self.target_name), draft, torch.get_num_threads(), self.k)
        return self._openvino

    def hf(self):
        if self._hf is None:
            from specdec.bench.hf import load_hf

            self._hf = (load_hf(loading.hf_directory(self.gen.target), self.dtype),
                        load_hf(loading.hf_directory(self.gen.draft), self.dtype))
        return self._hf

    def encode(self, prompt) -> list[int]:
        return self.gen.encode_chat(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])

    def run(self, method: str, prompt_ids: list[int], temperature: float, seed: int, stop_at_eos: bool = False) -> dict:
        """One run. ``stop_at_eos`` (categories whose answers are whole files, e.g. ``editing``):
        our methods stop where the answer ends, as a user's request does, instead of generating
        past the end-of-turn token (text no longer grounded in the input) up to ``max_new_tokens``."""
        eos = frozenset(self.gen.eos_token_ids) if stop_at_eos else frozenset()
        if method == "llamacpp_draft" or method.startswith(("openvino_", "vllm_")):  # peers that can fail here
            try:
                if method == "llamacpp_draft":
                    return self.llama_server().run(prompt_ids, self.max_new_tokens, temperature, seed, eos)
                if method.startswith("vllm_"):
                    return self.vllm().run(method, prompt_ids, self.max_new_tokens, temperature, seed, eos)
                return self.openvino().run(method, prompt_ids, self.max_new_tokens, temperature, seed, stop_at_eos)
            except Exception as exc:  # its start, its file reader, its device plugin, its HTTP
                raise PeerFailed(f"{method} failed: {type(exc).__name__}: {_last_line(exc)}") from exc
        if method.startswith("llamacpp_"):
            return self.llamacpp().run(method, prompt_ids, self.max_new_tokens, temperature, seed, eos)
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
        # Each run measures one request on its own: the suffix proposers' history of earlier
        # answers is shared by a generator's calls, and would otherwise hold other methods'
        # answers to this very prompt (a greedy answer is then predicted whole).
        self.gen.suffix_history = SuffixHistory()
        spec = self.gen.speculation(proposer, k=k, k_max=self.k_max)
        result = self.gen.generate([prompt_ids], SamplingParams(temperature=temperature), self.max_new_tokens,
                                   speculation=spec, seed=seed,
                                   ignore_eos=not stop_at_eos)[0]  # else every method generates max_new_tokens
        return {"token_ids": result.token_ids, "metrics": result.batch_metrics.to_dict()}


def run_bench(out: Path, methods: list[str], temperatures: list[float], prompts_per_category: int | None,
              target: str, draft: str, dtype: str, max_new_tokens: int, k: int, k_max: int,
              categories: list[str] | None = None, head: str | Path | None = "auto", ignore_eos: bool = False) -> dict:
    """Run (or resume) the bench into ``out``. Answers end where the model ends its turn, as a user
    receives them; ``ignore_eos`` (vLLM's name; the ``editing`` category never does) generates
    ``max_new_tokens`` past it instead — equal lengths for every method, but in the six categories
    at 96 tokens ~43% of the greedy tokens then come after the end of the answer, text no user sees
    (docs/CHANGELOG.md, 'all layers in one call'; the bench's default before that section)."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    done = {}
    if log.exists():
        for line in log.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[(r["method"], r["category"], r["prompt"], r["temperature"])] = r
    workloads = load_workloads(include_extra=bool(categories))
    if categories:
        unknown = [c for c in categories if c not in workloads]
        if unknown:
            raise ValueError(f"unknown categories {unknown}; choose from {', '.join(workloads)}")
        workloads = {c: workloads[c] for c in categories}
    jobs = _job_list(workloads, methods, temperatures, prompts_per_category)
    todo = [j for j in jobs if (j[0], j[1], j[2], j[4]) not in done]
    notes = []
    for peer_module in PEERS:
        if any(m in peer_module.METHODS for m in methods) and not peer_module.available():
            notes.append(f"{', '.join(peer_module.METHODS)} skipped: not installed ({peer_module.INSTALL_HINT}).")
            jobs = [j for j in jobs if j[0] not in peer_module.METHODS]
            todo = [j for j in todo if j[0] not in peer_module.METHODS]
    wants_llamacpp = any(m in llamacpp.METHODS for m in methods) and llamacpp.available()
    bench = Bench(target, draft, dtype, max_new_tokens, k, k_max, head) if todo or wants_llamacpp else None
    try:
        failed = _run_jobs(bench, todo, workloads, ignore_eos, log, done)
    finally:
        if bench is not None:
            bench.close()
    notes += list(failed.values())
    peer = None
    if wants_llamacpp:  # the block-cost comparison, on the first prompt's tokens
        ids = bench.encode(next(iter(workloads.values()))["prompts"][0])
        prefix, block = ids[:-5], ids[-5:]
        peer = {"llama.cpp": bench.llamacpp().block_costs(prefix, block),
                "specdec": llamacpp.specdec_block_costs(bench.gen.target.model, prefix, block),
                "prefix_tokens": len(prefix)}
    runs = [done[(j[0], j[1], j[2], j[4])] for j in jobs if (j[0], j[1], j[2], j[4]) in done]
    env = {"cpu": cpu_name(), "cores": torch.get_num_threads(),
           "python": platform.python_version(), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "dtype": dtype, "target": target,
           "draft": draft, "max_new_tokens": max_new_tokens, "stop_at_eos": not ignore_eos, "k": k, "k_max": k_max,
           "date": time.strftime("%Y-%m-%d %H:%M")}
    results = {"environment": env, "runs": runs, "grounded": {c: s["grounded"] for c, s in workloads.items()},
               "notes": notes, "peer_costs": peer}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(write_report(results, write_plots(runs, out)))
    return results


def _job_list(workloads: dict, methods: list[str], temperatures: list[float],
              prompts_per_category: int | None) -> list[tuple]:
    """``(method, category, prompt index, prompt, temperature)`` in run order. Prompt-major: an
    interrupted run has every category up to the same prompt index. On each prompt the methods
    run back to back, in reversed order every other prompt: this machine's speed drifts within
    minutes, and a fixed order would favour the same methods."""
    jobs = []
    most = max(len(spec["prompts"]) for spec in workloads.values())
    n = 0
    for i in range(min(most, prompts_per_category or most)):
        for category, spec in workloads.items():
            if i >= len(spec["prompts"]):
                continue
            order = methods if n % 2 == 0 else methods[::-1]
            n += 1
            for temp in temperatures:
                for method in order:
                    if temp > 0 and ("_k" in method):
                        continue  # the k sweep is greedy only
                    jobs.append((method, category, i, spec["prompts"][i], temp))
    return jobs


class PeerFailed(RuntimeError):
    """A peer runtime failed on this machine or these files (its message: one line)."""


def _last_line(exc: Exception) -> str:
    """The line of an exception's message that says what failed: its last (OpenVINO's messages
    start with the C++ call chain and end with the cause)."""
    return next((line.strip() for line in reversed(str(exc).splitlines()) if line.strip()), "")[:300]


def _run_jobs(bench, todo: list, workloads: dict, ignore_eos: bool, log: Path, done: dict) -> dict[str, str]:
    """Run ``todo``, appending each run to ``log`` and ``done``; a peer method that fails is
    dropped after its first error. Returns {method: its one-line error}."""
    failed: dict[str, str] = {}
    with open(log, "a") as f:
        for method, category, i, prompt, temp in tqdm(todo, desc="specdec bench", unit="run"):
            if method in failed:
                continue
            stops = not ignore_eos or workloads[category].get("stop_at_eos", False)
            record = {"method": method, "category": category, "prompt": i, "temperature": temp, "stop_at_eos": stops}
            try:
                record.update(bench.run(method, bench.encode(prompt), temp, seed=i, stop_at_eos=stops))
            except PeerFailed as exc:
                failed[method] = str(exc)
                continue
            f.write(json.dumps(record) + "\n")
            f.flush()
            done[(method, category, i, temp)] = record
    return failed
