"""``specdec bench --scale``: what a 1-8B GGUF file costs to load and run, next to llama.cpp.

For each case (a synthetic shape and mix of :mod:`specdec.models.synthetic`, e.g.
``qwen2.5-7b:q4_k_m``, or a GGUF file's path), each runtime in a fresh process of its own:

* **first load**: Python's start to the first token, the first time the file is seen (the
  file's derived cache entries, hash and config, removed before);
* **later load**: the same, with them cached; then, in that process, the plain decoding time a
  token (TPOT: greedy, the difference between ``1 + n`` and ``1`` generated tokens, the median of
  3 interleaved repeats) and one forward of 1/2/5/9 tokens after 200 (the cost of verifying k
  drafted tokens against one);
* **peak RSS** of that process (``VmHWM``), the draft model loaded too when ``--draft`` is given,
  beside the file's size; the KV cache of a ``--context``-token row is added as computed, since a
  short benchmark prompt never fills it, or with ``--fill`` measured: the process then also
  prefills a ``--context``-token prompt (the draft's cache filled and held beside the target's;
  llama.cpp evaluates the same prompt) and reads its peak again.

llama.cpp (``pip install -e '.[llamacpp]'``) runs the same file, threads and context the same way;
then both run in one process, alternating for 4 rounds (TPOT and the 5-token forward), since
this host's speed drifts between processes minutes apart.
Each case's results are appended to ``scale.jsonl`` in ``--out`` as it finishes (a rerun skips
the cases there) and the table is written to ``scale.md``. Every child process runs under an
address-space limit (``--memory-cap``), so a file that cannot fit fails alone.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

def prompt(vocab: int, n: int = 32) -> list[int]:
    """``n`` token ids (synthetic weights make every prompt alike)."""
    return [(1000 + i) % vocab for i in range(n)]
SIZES = (1, 2, 3, 5, 9)


def case_file(case: str) -> Path:
    """``shape:mix`` -> its synthetic file (written once, under the cache), or a GGUF path."""
    from specdec.models import synthetic

    if ":" in case and not Path(case).exists():
        shape, mix = case.split(":", 1)
        return synthetic.write(shape, mix)
    path = Path(case).expanduser()
    if not path.is_file():
        raise ValueError(f"{case!r} is neither SHAPE:MIX (shapes: {', '.join(list(synthetic.SHAPES) + list(synthetic.HEADERS))}; mixes: "
                         f"{', '.join(synthetic.MIXES)}) nor a GGUF file")
    return path


def run_scale(out: Path, cases: list[str], draft: str | None, context: int, tokens: int, memory_cap: float,
              llamacpp: bool, fill: bool = False) -> list[dict]:
    """Measure every case not yet in ``out/scale.jsonl``; returns all rows and writes ``scale.md``."""
    from specdec.bench import llamacpp as peer
    from specdec.runtime.native import cpu_name

    out.mkdir(parents=True, exist_ok=True)
    done = _rows(out)
    runtimes = ["specdec"] + (["llama.cpp"] if llamacpp and peer.available() else [])
    if llamacpp and not peer.available():
        print(f"llama.cpp is not installed ({peer.INSTALL_HINT}): measuring specdec alone", file=sys.stderr)
    for case in cases:
        path = case_file(case)
        for runtime in runtimes:
            if any(r["case"] == case and r["runtime"] == runtime for r in done):
                continue
            row = {"case": case, "file": str(path), "file_gb": path.stat().st_size / 1e9, "runtime": runtime,
                   "cpu": cpu_name(), "threads": _threads(), "context": context}
            print(f"{case}: {runtime} ...", file=sys.stderr, flush=True)
            if runtime == "specdec":
                from specdec.models import loading

                loading.forget_file(path)
            row["first"] = _child(runtime, path, None, context, tokens, memory_cap, full=False)
            row["later"] = _child(runtime, path, draft if runtime == "specdec" else None, context, tokens, memory_cap,
                                  full=True, fill=fill)
            _append(out, done, row)
        ours = next((r for r in done if r["case"] == case and r["runtime"] == "specdec"), {"later": {"error": ""}})
        if ("llama.cpp" in runtimes and "error" not in ours["later"]
                and not any(r["case"] == case and r["runtime"] == "interleaved" for r in done)):
            print(f"{case}: specdec and llama.cpp interleaved ...", file=sys.stderr, flush=True)
            row = {"case": case, "file": str(path), "file_gb": path.stat().st_size / 1e9, "runtime": "interleaved",
                   "cpu": cpu_name(), "threads": _threads(), "context": context}
            row["later"] = _child("interleaved", path, None, context, tokens, memory_cap, full=True)
            _append(out, done, row)
    (out / "scale.md").write_text(report(done))
    return done


def _append(out: Path, done: list[dict], row: dict) -> None:
    done.append(row)
    with open(out / "scale.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def _rows(out: Path) -> list[dict]:
    path = out / "scale.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _child(runtime: str, path: Path, draft: str | None, context: int, tokens: int, memory_cap: float,
           full: bool, fill: bool = False) -> dict:
    """One measurement in a fresh process; ``wall_to_first_token_s`` counts Python's start."""
    spec = json.dumps({"runtime": runtime, "path": str(path), "draft": draft, "context": context, "tokens": tokens,
                       "full": full, "fill": fill, "threads": _threads()})
    cap = int(memory_cap * 1e9)
    start = time.time()
    run = subprocess.run([sys.executable, "-m", "specdec.bench.scale", spec], capture_output=True, text=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    if run.returncode or not lines:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail) or f"exit {run.returncode}"}
    result = json.loads(lines[-1])
    if "error" in result or "first_token_at" not in result:
        return result
    result["wall_to_first_token_s"] = result.pop("first_token_at") - start
    return result


def peak_rss() -> int:
    """This process's peak resident bytes (VmHWM: its own address space's high-water mark).
    Not ``getrusage``'s ru_maxrss: Linux carries that over from the parent a child was forked
    from, so a bench child of a driver holding 8 GB reported 8 GB whatever it used itself."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _measure_specdec(spec: dict) -> dict:
    import statistics

    import torch

    from specdec.bench.measure import forward_scaling
    from specdec.core.engine import generate
    from specdec.models import loading, memory
    from specdec.verify.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    t = time.perf_counter()
    target = loading.load(spec["path"], context=spec["context"])
    result = {"load_s": time.perf_counter() - t, "precision": target.precision}
    ids = prompt(target.model.vocab_size)
    with torch.inference_mode():
        generate(target.model, [ids], greedy, 1)
        result["first_token_at"] = time.time()
        if not spec["full"]:
            return {**result, "peak_rss_gb": peak_rss() / 1e9}
        kv = memory.kv_bytes(target.model.cfg, spec["context"], target.model.dtype_name)
        if spec["draft"]:
            draft = loading.load(spec["draft"], role="draft", context=spec["context"])
            kv += memory.kv_bytes(draft.model.cfg, spec["context"], draft.model.dtype_name)
            generate(draft.model, [ids], greedy, 2)
        n = spec["tokens"]
        seconds = {1: [], 1 + n: []}
        for _ in range(3):
            for count in seconds:
                t = time.perf_counter()
                generate(target.model, [ids], greedy, count)
                seconds[count].append(time.perf_counter() - t)
        tpot = (statistics.median(seconds[1 + n]) - statistics.median(seconds[1])) / n
        forward = forward_scaling(target.model, sizes=SIZES)
        result.update(tpot_ms=tpot * 1e3, forward_ms={k: v * 1e3 for k, v in forward.items()},
                      peak_rss_gb=peak_rss() / 1e9, kv_gb=kv / 1e9)
        if spec.get("fill"):
            result.update(_fill_specdec(target.model, draft.model if spec["draft"] else None, spec["context"]))
    return result


def _fill_specdec(target, draft, context: int) -> dict:
    """Peak RSS with the context full: the draft's cache filled to ``context`` tokens (by its own
    forwards, in :data:`~specdec.core.prefill.STEP_TOKENS` chunks) and held while the target
    prefills a ``context``-token prompt through the engine in chunks of the same size, as
    ``specdec generate`` and the server do (a whole 4k prompt in one call held ~1 GB of a 7B's
    intermediates at once)."""
    import torch

    from specdec.core.engine import new_engine, steps
    from specdec.core.prefill import STEP_TOKENS
    from specdec.core.rows import Request
    from specdec.verify.sampling import SamplingParams

    t, held = time.perf_counter(), None
    if draft is not None:
        held = draft.new_cache(1, context)
        ids = torch.tensor([prompt(draft.vocab_size, context - 1)])  # [1, context - 1]
        for a in range(0, ids.shape[1], STEP_TOKENS):
            block = ids[:, a : a + STEP_TOKENS]
            draft(block, held, logit_index=torch.tensor([[block.shape[1] - 1]]))
    engine = new_engine(target, context, None, token_budget=STEP_TOKENS)  # prefilled in chunks, as TextGenerator does
    row = engine.add(Request(prompt(target.vocab_size, context - 1), SamplingParams(temperature=0.0), 1))
    for _ in steps(engine, [row]):
        pass
    return {"filled_peak_rss_gb": peak_rss() / 1e9, "fill_s": time.perf_counter() - t, "filled_held": held is not None}


def _measure_llamacpp(spec: dict) -> dict:
    import statistics

    from specdec.bench import llamacpp as peer

    t = time.perf_counter()
    llm = peer.open_file(Path(spec["path"]), spec["threads"], spec["context"])
    result = {"load_s": time.perf_counter() - t}
    ids = prompt(llm.n_vocab())
    peer.greedy_seconds(llm, ids, 1)
    result["first_token_at"] = time.time()
    if not spec["full"]:
        return {**result, "peak_rss_gb": peak_rss() / 1e9}
    n = spec["tokens"]
    seconds = {1: [], 1 + n: []}
    for _ in range(3):
        for count in seconds:
            seconds[count].append(peer.greedy_seconds(llm, ids, count))
    tpot = (statistics.median(seconds[1 + n]) - statistics.median(seconds[1])) / n
    forward = peer.forward_scaling(llm, sizes=SIZES)
    result.update(tpot_ms=tpot * 1e3, forward_ms={k: v * 1e3 for k, v in forward.items()}, peak_rss_gb=peak_rss() / 1e9)
    if spec.get("fill"):
        t = time.perf_counter()
        llm.reset()
        llm.eval(prompt(llm.n_vocab(), spec["context"] - 1))
        result.update(filled_peak_rss_gb=peak_rss() / 1e9, fill_s=time.perf_counter() - t)
    return result


def _measure_interleaved(spec: dict, rounds: int = 4) -> dict:
    """Both runtimes in one process, alternating round by round (this host's speed drifts over
    minutes, so separate processes' ratios move): TPOT and the 5-token forward against 1."""
    import torch

    from specdec.bench import llamacpp as peer
    from specdec.bench.measure import forward_scaling
    from specdec.core.engine import generate
    from specdec.models import loading
    from specdec.verify.sampling import SamplingParams

    greedy, n = SamplingParams(temperature=0.0), spec["tokens"]
    target = loading.load(spec["path"], context=spec["context"])
    llm = peer.open_file(Path(spec["path"]), spec["threads"], spec["context"])
    ids = prompt(target.model.vocab_size)

    def ours(count: int) -> float:
        t = time.perf_counter()
        generate(target.model, [ids], greedy, count)
        return time.perf_counter() - t

    out = {"tpot_ms": {"specdec": [], "llama.cpp": []}, "forward_5_vs_1": {"specdec": [], "llama.cpp": []}}
    with torch.inference_mode():
        ours(2), peer.greedy_seconds(llm, ids, 2)  # warm-up
        for _ in range(rounds):
            out["tpot_ms"]["specdec"].append((ours(1 + n) - ours(1)) / n * 1e3)
            out["tpot_ms"]["llama.cpp"].append((peer.greedy_seconds(llm, ids, 1 + n) - peer.greedy_seconds(llm, ids, 1)) / n * 1e3)
            for name, f in (("specdec", forward_scaling(target.model, sizes=(1, 5), repeats=3)),
                            ("llama.cpp", peer.forward_scaling(llm, sizes=(1, 5), repeats=3))):
                out["forward_5_vs_1"][name].append(f[5] / f[1])
    return out


def report(rows: list[dict]) -> str:
    """The markdown table, one line a case and runtime, with llama.cpp's ratio where it ran."""
    lines = [f"CPU: {rows[0]['cpu']}, {rows[0]['threads']} threads, context {rows[0]['context']}" if rows else "",
             "",
             "| case | file GB | runtime | first load s | later load s | peak RSS GB (+ KV at context) | "
             "TPOT ms | tok/s vs llama.cpp | 2 / 3 / 5 / 9 tokens vs 1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in (r for r in rows if r["runtime"] != "interleaved"):
        first, later = row["first"], row["later"]
        if "error" in first or "error" in later:
            lines.append(f"| {row['case']} | {row['file_gb']:.2f} | {row['runtime']} | refused or failed: "
                         f"{first.get('error') or later.get('error')} | | | | | |")
            continue
        peer = next((r for r in rows if r["case"] == row["case"] and r["runtime"] == "llama.cpp"
                     and "tpot_ms" in r["later"]), None)
        ratio = f"{peer['later']['tpot_ms'] / later['tpot_ms']:.2f}x" if peer else "-"
        f = {int(k): v for k, v in later["forward_ms"].items()}
        scaling = " / ".join(f"{f[n] / f[1]:.2f}" if n in f else "-" for n in (2, 3, 5, 9))
        kv = f" (+{later['kv_gb']:.2f})" if "kv_gb" in later else ""
        if "filled_peak_rss_gb" in later:  # measured with the context full, not added
            kv = f"; {later['filled_peak_rss_gb']:.2f} with {row['context']} filled"
        lines.append(f"| {row['case']} | {row['file_gb']:.2f} | {row['runtime']} | {first['wall_to_first_token_s']:.1f} | "
                     f"{later['wall_to_first_token_s']:.1f} | {later['peak_rss_gb']:.2f}{kv} | {later['tpot_ms']:.0f} | "
                     f"{ratio} | {scaling} |")
    return "\n".join(lines + _interleaved(rows)) + "\n"


def _interleaved(rows: list[dict]) -> list[str]:
    """The second table: both runtimes in one process, medians over the alternating rounds."""
    import statistics

    pairs = [r for r in rows if r["runtime"] == "interleaved"]
    if not pairs:
        return []
    lines = ["", "Interleaved in one process (medians of the rounds):", "",
             "| case | specdec TPOT ms | llama.cpp TPOT ms | tok/s vs llama.cpp | 5 tokens vs 1: specdec / llama.cpp |",
             "|---|---|---|---|---|"]
    for row in pairs:
        r = row["later"]
        if "error" in r:
            lines.append(f"| {row['case']} | failed: {r['error']} | | | |")
            continue
        t = {k: statistics.median(v) for k, v in r["tpot_ms"].items()}
        f = {k: statistics.median(v) for k, v in r["forward_5_vs_1"].items()}
        lines.append(f"| {row['case']} | {t['specdec']:.0f} | {t['llama.cpp']:.0f} | {t['llama.cpp'] / t['specdec']:.2f}x | "
                     f"{f['specdec']:.2f} / {f['llama.cpp']:.2f} |")
    return lines


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch

    torch.set_num_threads(spec["threads"])
    from specdec.models.loading import ModelLoadError

    measure = {"specdec": _measure_specdec, "llama.cpp": _measure_llamacpp,
               "interleaved": _measure_interleaved}[spec["runtime"]]
    try:
        result = measure(spec)
    except ModelLoadError as exc:  # a refusal (does not fit, unsupported): the row says it in one line
        result = {"error": str(exc)}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
