"""Runtime measurements, each side by side in one process (speculation is measured by
``specdec bench``; the server by ``benchmarks/serve_bench.py``):

    python -m specdec.bench.measure runtime [--target NAME] [--dtype int8] [--tokens 64] [--runs 3]
        our plain decoding vs transformers ``generate()`` at one dtype, and forward-cost scaling
    python -m specdec.bench.measure dtypes --dtypes int8,q4,q4k [--runs 3]
        our dtypes side by side: speed, 1/5/9-token forwards, quality against fp32, and the
        prefill of a 500-token prompt next to transformers int8 and (when installed) llama.cpp
    python -m specdec.bench.measure llamacpp [--tokens 128] [--runs 3] [--out FILE]
        plain decoding next to llama.cpp on the same GGUF file and threads: specdec at the file's
        precision and at q4k, tok/s, 1/2/5/9-token forwards, argmax agreement and TV vs fp32
    python -m specdec.bench.measure step
        where one decoding step's time goes: q4 GEMM vs everything else, op count, host syncs
    python -m specdec.bench.measure fused [--rounds 2]
        a block's fused sublayer (rope + KV write + attention in one call) vs op by op, steps
        interleaved in one process (the machine's memory bandwidth drifts between runs); then
        the draft's 1-token step over the target's, the two alternating
    python -m specdec.bench.measure compile
        torch.compile (inductor) of a block's elementwise sections vs eager: time and bit-identity
    python -m specdec.bench.measure toy [--tokens 100000] [--repeats 3]
        the toy experiment: scalar reference loop vs batched --fast mode

(transformers' assisted generation against our draft model, which ``spec_bench`` used to measure,
is ``specdec bench --methods hf_plain,hf_assisted,plain,draft``.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import specdec.runtime.q4 as q4
from specdec.models import loading
from specdec.api import TextGenerator
from specdec.bench.hf import hf_generate, load_hf
from specdec.bench.prompts import CODE_PROMPTS
from specdec.core.engine import generate
from specdec.models import registry
from specdec.runtime.linear import DEFAULT_DTYPE, DTYPE_CHOICES
from specdec.runtime.native import cpu_name
from specdec.verify.sampling import SamplingParams


def forward_scaling(model, context: int = 200, sizes=(1, 2, 5, 9), repeats: int = 7) -> dict[int, float]:
    """Median seconds of one forward of ``n`` new tokens after a ``context``-token prefix. The
    sizes are interleaved (1, 2, 5, 9, 1, 2, ...): this machine's speed drifts over seconds, and
    timing each size in its own stretch moved the 5-vs-1 ratio by up to 0.25x."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.vocab_size, (1, context), generator=g)
    cache = model.new_cache(1, context + max(sizes) + 1)
    model(prefix, cache, logit_index=torch.tensor([[context - 1]]))
    blocks = {n: torch.randint(0, model.vocab_size, (1, n), generator=g) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats + 1):
        for n in sizes:
            t = time.perf_counter()
            model(blocks[n], cache)
            if r:  # the first round warms up
                times[n].append(time.perf_counter() - t)
            cache.truncate(context)
    return {n: statistics.median(ts) for n, ts in times.items()}


def fp32_reference(target: str, prompts: list[str], positions: int = 48) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """``(ids [1, T], prompt length, fp32 probabilities [positions, V])`` per prompt: fp32's own
    greedy continuation and its distributions along it (teacher-forced quality references)."""
    ref = TextGenerator.load(target, dtype="float32")
    m = ref.target.model
    out = []
    for text in prompts:
        prompt = ref.encode(text, chat=True)
        cont = generate(m, [prompt], SamplingParams(temperature=0.0), positions)[0].token_ids
        ids = torch.tensor([prompt + cont])
        logits = m(ids, m.new_cache(1, ids.shape[1]))[0, len(prompt) - 1 : -1]  # predicts cont
        out.append((ids, len(prompt), torch.softmax(logits.float(), -1)))
    return out


def agreement(logits_of, references) -> dict:
    """Argmax agreement and mean total variation against fp32 of ``logits_of(ids, plen)`` (the
    logits predicting ``ids[plen:]``) over :func:`fp32_reference`'s sequences."""
    agree, tv, n = 0, 0.0, 0
    for ids, plen, p in references:
        q = torch.softmax(logits_of(ids, plen).float(), -1)
        agree += int((q.argmax(-1) == p.argmax(-1)).sum())
        tv += float(0.5 * (q - p).abs().sum(-1).sum())
        n += p.shape[0]
    return {"argmax_agreement": agree / n, "mean_tv": tv / n, "positions": n}


def agreement_with_fp32(target: str, dtypes: list[str], prompts: list[str], positions: int = 48) -> dict[str, dict]:
    """Teacher-forced quality: on fp32's own greedy continuation of each prompt, the fraction of
    positions where each dtype's argmax equals fp32's, and the mean total-variation distance."""
    references = fp32_reference(target, prompts, positions)
    out = {}
    for dtype in dtypes:
        m = TextGenerator.load(target, dtype=dtype).target.model
        out[dtype] = agreement(lambda ids, plen: m(ids, m.new_cache(1, ids.shape[1]))[0, plen - 1 : -1], references)
    return out


def prefill_rate(run, repeats: int = 3) -> float:
    """Median seconds of ``run()`` (one prefill), after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prefill_side_by_side(target: str, dtypes: list[str], tokens: int = 500) -> dict[str, float]:
    """Tokens/s of one ``tokens``-token prefill (random ids, logits of the last position): our
    dtypes, transformers with int8 dynamic quantization, and llama.cpp on the GGUF file if the
    extra is installed — same threads, one process."""
    from specdec.bench import llamacpp

    ids = torch.randint(0, 10_000, (1, tokens), generator=torch.Generator().manual_seed(0))
    out = {}
    source = None
    for dtype in dtypes:
        loaded = TextGenerator.load(target, dtype=dtype).target
        model, source = loaded.model, loading.hf_directory(loaded)
        last = torch.tensor([[tokens - 1]])
        out[f"specdec {dtype}"] = tokens / prefill_rate(lambda: model(ids, model.new_cache(1, tokens), logit_index=last))
    hf = load_hf(source, "int8")
    with torch.inference_mode():
        out["transformers int8"] = tokens / prefill_rate(lambda: hf(ids, logits_to_keep=1))
    if llamacpp.available():
        from llama_cpp import Llama

        threads = torch.get_num_threads()
        llm = Llama(model_path=str(llamacpp.gguf_file(target)), n_threads=threads, n_threads_batch=threads,
                    n_ctx=tokens + 16, verbose=False)

        def run() -> None:
            llm.reset()
            llm.eval(ids[0].tolist())

        out["llama.cpp (same GGUF)"] = tokens / prefill_rate(run)
    return out


def compare_dtypes(target: str, dtypes: list[str], tokens: int, runs: int) -> None:
    """Plain greedy decoding and forward-cost scaling per dtype, side by side in one process."""
    rows = {}
    for dtype in dtypes:
        gen = TextGenerator.load(target, dtype=dtype)
        tps, tpot = [], []
        for run in range(runs):
            prompt = gen.encode(CODE_PROMPTS[run % len(CODE_PROMPTS)], chat=True)
            t = time.perf_counter()
            row = generate(gen.target.model, [prompt], SamplingParams(temperature=0.0), tokens)[0]
            tps.append(tokens / (time.perf_counter() - t))
            tpot.append(row.metrics.to_dict()["tpot_s"])
        rows[dtype] = (statistics.median(tps), statistics.median(tpot), forward_scaling(gen.target.model))
        del gen
    quality = agreement_with_fp32(target, dtypes, CODE_PROMPTS[:2])
    base = rows[dtypes[0]][0]
    print(f"\n## {target}: {tokens} greedy tokens, median of {runs} prompts; forwards after a 200-token context\n")
    print("| dtype | tok/s end to end | TPOT ms | vs " + dtypes[0] + " | 1 token ms | 5 tokens | 9 tokens "
          "| argmax = fp32 | mean TV vs fp32 |\n|---|---|---|---|---|---|---|---|---|")
    for dtype, (t, tp, sc) in rows.items():
        q = quality[dtype]
        print(f"| {dtype} | {t:.2f} | {tp * 1e3:.1f} | {t / base:.2f}x | {sc[1] * 1e3:.1f} | {sc[5] / sc[1]:.2f}x "
              f"| {sc[9] / sc[1]:.2f}x | {q['argmax_agreement']:.1%} | {q['mean_tv']:.3f} |")
    prefill = prefill_side_by_side(target, dtypes)
    print("\n| runtime | prefill of a 500-token prompt, tok/s |\n|---|---|")
    for name, rate in prefill.items():
        print(f"| {name} | {rate:.0f} |")


def versus_llamacpp(target: str, tokens: int, runs: int, threads: int) -> dict:
    """Plain decoding on one GGUF file, same threads, in one process: specdec at the file's own
    precision (``gguf``) and re-quantized (``q4k``), and llama.cpp. End-to-end greedy tok/s
    (prefill included) on the code prompts, run in turn prompt by prompt; the cost of a 1/2/5/9
    token forward after 200 tokens; argmax agreement and mean TV against fp32, teacher-forced."""
    from specdec.bench import llamacpp

    gguf = llamacpp.gguf_file(target)
    gens = {dtype: TextGenerator.load(target, dtype=dtype) for dtype in ("gguf", "q4k")}
    llm = llamacpp.open_file(gguf, threads, 2048)
    prompts = [gens["gguf"].encode(CODE_PROMPTS[r % len(CODE_PROMPTS)], chat=True) for r in range(runs)]
    rates: dict[str, list[float]] = {"gguf": [], "q4k": [], "llama.cpp": []}
    for prompt in prompts:
        for dtype, gen in gens.items():
            t = time.perf_counter()
            generate(gen.target.model, [prompt], SamplingParams(temperature=0.0), tokens)
            rates[dtype].append(tokens / (time.perf_counter() - t))
        rates["llama.cpp"].append(tokens / llamacpp.greedy_seconds(llm, prompt, tokens))
    scaling = {dtype: forward_scaling(gen.target.model) for dtype, gen in gens.items()}
    scaling["llama.cpp"] = llamacpp.forward_scaling(llm)
    del llm
    references = fp32_reference(target, CODE_PROMPTS[:2])
    quality = {dtype: agreement(lambda ids, plen, m=gen.target.model: m(ids, m.new_cache(1, ids.shape[1]))[0, plen - 1 : -1],
                                references) for dtype, gen in gens.items()}
    full = llamacpp.open_file(gguf, threads, 2048, logits_all=True)
    quality["llama.cpp"] = agreement(lambda ids, plen: llamacpp.teacher_forced_logits(full, ids, plen), references)
    return {"target": target, "gguf": str(gguf), "tokens": tokens, "prompts": runs, "threads": threads,
            "cpu": cpu_name(), "tok_s": {k: statistics.median(v) for k, v in rates.items()},
            "tok_s_runs": rates, "forward_s": scaling, "quality_vs_fp32": quality}


def print_versus_llamacpp(r: dict) -> None:
    base = r["tok_s"]["llama.cpp"]
    print(f"\n## {r['target']} plain decoding, {r['tokens']} greedy tokens, median of {r['prompts']} prompts, "
          f"{r['threads']} threads, {r['cpu']}\n")
    print("| runtime | weights | tok/s | vs llama.cpp | 2 / 5 / 9 tokens vs 1 | argmax = fp32 | mean TV vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    names = {"gguf": "the file's (Q4_K, Q6_K exact)", "q4k": "Q6_K re-quantized to 4 bits", "llama.cpp": "the file's"}
    for key, what in names.items():
        sc, q = r["forward_s"][key], r["quality_vs_fp32"][key]
        label = "llama.cpp" if key == "llama.cpp" else f"specdec --dtype {key}"
        print(f"| {label} | {what} | {r['tok_s'][key]:.1f} | {r['tok_s'][key] / base:.2f}x | "
              f"{sc[2] / sc[1]:.2f} / {sc[5] / sc[1]:.2f} / {sc[9] / sc[1]:.2f} | {q['argmax_agreement']:.1%} | {q['mean_tv']:.3f} |")


def runtime_vs_transformers(target: str, dtype: str, tokens: int, runs: int, out: str | None) -> None:
    """Our plain greedy decoding against transformers ``generate()`` at the same dtype, and the
    forward-cost scaling of our runtime."""

    gen = TextGenerator.load(target, dtype=dtype)
    hf = load_hf(loading.hf_directory(gen.target), dtype)
    ours_tps, hf_tps, same = [], [], []
    for run in range(runs):
        prompt = gen.encode(CODE_PROMPTS[run % len(CODE_PROMPTS)], chat=True)
        t = time.perf_counter()
        row = generate(gen.target.model, [prompt], SamplingParams(temperature=0.0), tokens)[0]
        ours_s = time.perf_counter() - t
        hf_ids, hf_s = hf_generate(hf, prompt, tokens)
        ours_tps.append(tokens / ours_s)
        hf_tps.append(tokens / hf_s)
        same.append(row.token_ids == hf_ids)
        print(f"run {run + 1}: ours {ours_tps[-1]:.2f} tok/s, transformers {hf_tps[-1]:.2f} tok/s, same tokens: {same[-1]}")
    scaling = forward_scaling(gen.target.model)
    o, h = statistics.median(ours_tps), statistics.median(hf_tps)
    print(f"\n## {gen.target.name}, {dtype}, {tokens} greedy tokens, median of {runs} runs\n")
    print("| decoder | tok/s | ratio |\n|---|---|---|")
    print(f"| specdec plain | {o:.2f} | {o / h:.2f}x |\n| transformers generate() | {h:.2f} | 1.00x |")
    print("\n| new tokens in one forward (200-token context) | ms | vs 1 token |\n|---|---|---|")
    for n, s in scaling.items():
        print(f"| {n} | {s * 1e3:.1f} | {s / scaling[1]:.2f}x |")
    print(f"\ngreedy outputs identical to transformers in {sum(same)}/{len(same)} runs "
          "(int8 kernels differ: ours quantize activations per row, transformers' per tensor)")
    if out:
        with open(out, "w") as f:
            json.dump({"target": gen.target.name, "dtype": dtype, "tokens": tokens,
                       "ours_tok_s": ours_tps, "hf_tok_s": hf_tps, "forward_s": scaling,
                       "same_tokens": same, "torch": torch.__version__, "cpu": cpu_name()}, f, indent=1)


GEMM = [0.0, 0]  # seconds, calls


class _Timed:
    """The q4 kernel module with each call timed (the profiler does not see pybind calls)."""

    def __init__(self, module) -> None:
        self.module = module

    def q4_linear(self, *args):
        t = time.perf_counter()
        y = self.module.q4_linear(*args)
        GEMM[0] += time.perf_counter() - t
        GEMM[1] += 1
        return y


def _after_prefix(model, tokens: int = 300):
    """A one-row cache holding ``tokens`` random tokens (seed 0), and its lengths to truncate back to."""
    torch.manual_seed(0)
    cache = model.new_cache(1, 2 * tokens)
    model(torch.randint(0, 1000, (1, tokens)), cache)
    return cache, cache.lengths.clone()


def step_profile() -> None:
    """Where one decoding step's time goes, for the default target and draft (default 4-bit dtype), after a
    300-token prefix, one forward over n = 1 and n = 5 new tokens (a plain step and a k = 4
    verification): wall time (median of 9), time inside the q4 kernel (timed around each call),
    torch ops and ``item()`` host syncs (torch.profiler, 5 steps)."""
    build = q4.kernel
    q4.kernel = lambda: _Timed(build())
    gen = TextGenerator.load("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", DEFAULT_DTYPE, head=None)
    print("| model | tokens | wall ms | q4 GEMM ms (calls) | other ms | torch ops | host syncs |")
    print("|---|---|---|---|---|---|---|")
    for name, model in [("1.5B target", gen.target.model), ("0.5B draft", gen.draft.model)]:
        model.use_stack = False  # the per-layer loop, whose kernel calls can be timed one by one
        cache, prefix = _after_prefix(model)
        for n in (1, 5):
            block = torch.randint(0, 1000, (1, n))

            def step():
                cache.truncate(prefix)
                model(block, cache)

            for _ in range(3):
                step()
            times = []
            for _ in range(9):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            wall = statistics.median(times)
            GEMM[0], GEMM[1] = 0.0, 0
            for _ in range(5):
                step()
            gemm, calls = GEMM[0] / 5, GEMM[1] / 5
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step()
            stats = {e.key: e.count for e in prof.key_averages()}
            ops = sum(c for k, c in stats.items() if k.startswith("aten::")) / 5
            syncs = stats.get("aten::item", 0) / 5
            print(f"| {name} | {n} | {wall * 1e3:.1f} | {gemm * 1e3:.1f} ({calls:.0f}) | {(wall - gemm) * 1e3:.1f} "
                  f"| {ops:.0f} | {syncs:.0f} |")


def fused_vs_ops(rounds: int = 2, steps: int = 40) -> None:
    """Default target and draft (q4) after a 300-token prefix: 1- and 5-token forwards with every
    block fused (:meth:`~specdec.runtime.model.Block._forward_fused`) and op by op (both through
    the per-layer loop), alternating step by step so both see the same machine state; median
    wall ms of ``steps`` each."""

    def blocks(fused: bool):
        def setup(model):
            model.use_stack = False
            for b in model.blocks:
                b.fused = fused
        return setup

    _alternate("op by op", blocks(False), "fused", blocks(True), rounds, steps)


def stack_vs_loop(rounds: int = 2, steps: int = 40) -> None:
    """As :func:`fused_vs_ops`, for the layers run as one C++ call (:mod:`specdec.runtime.stack`)
    against the per-layer Python loop over the same fused blocks."""

    def stacked(on: bool):
        def setup(model):
            model.use_stack = on
        return setup

    _alternate("layer loop", stacked(False), "one call", stacked(True), rounds, steps)


def _alternate(before: str, set_before, after: str, set_after, rounds: int, steps: int) -> None:
    gen = TextGenerator.load(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT, DEFAULT_DTYPE, head=None)
    print(f"| round | model | tokens | {before} ms | {after} ms | saved |")
    print("|---|---|---|---|---|---|")
    for rnd in range(1, rounds + 1):
        for name, model in [("1.5B target", gen.target.model), ("0.5B draft (pruned output)", gen.draft_model()[0])]:
            cache, prefix = _after_prefix(model)
            for n in (1, 5):
                block = torch.randint(0, 1000, (1, n))
                times = {False: [], True: []}
                for i in range(steps + 5):
                    for variant, setup in ((True, set_after), (False, set_before)):
                        setup(model)
                        cache.truncate(prefix)
                        t = time.perf_counter()
                        model(block, cache)
                        if i >= 5:  # warm-up
                            times[variant].append(time.perf_counter() - t)
                old, new = (statistics.median(times[v]) * 1e3 for v in (False, True))
                print(f"| {rnd} | {name} | {n} | {old:.2f} | {new:.2f} | {old - new:.2f} ms ({(old - new) / old:.1%}) |", flush=True)
            model.use_stack = True  # the defaults again
            for b in model.blocks:
                b.fused = True
        draft_vs_target(gen, steps)


def draft_vs_target(gen: TextGenerator, steps: int = 40) -> None:
    """Issue 11's draft cost: a 1-token step of the draft model (as proposers run it, pruned
    output layer) over a 1-token step of the target, the two alternating step by step after the
    same 300-token prefix, so that the ratio is taken in one machine state."""
    runs = []
    for model in (gen.target.model, gen.draft_model()[0]):
        cache, prefix = _after_prefix(model)
        runs.append((model, cache, prefix, [], torch.randint(0, 1000, (1, 1))))
    for i in range(steps + 5):
        for model, cache, prefix, times, block in runs:
            cache.truncate(prefix)
            t = time.perf_counter()
            model(block, cache)
            if i >= 5:
                times.append(time.perf_counter() - t)
    target, draft = (statistics.median(r[3]) * 1e3 for r in runs)
    print(f"draft / target 1-token step, alternating: {draft:.2f} / {target:.2f} ms = {draft / target:.3f}", flush=True)


def compile_trial(hidden: int = 1536, intermediate: int = 8960, heads: int = 14, head_dim: int = 128,
                  rows=(1, 5, 9), calls: int = 2000) -> None:
    """Issue 11's torch.compile trial, on the default target's shapes: the sections of a block
    between its kernels (residual add + RMSNorm; SiLU gate; rope), each eager and compiled with
    inductor (``dynamic=True``: one graph for every block size). Per call: microseconds (median of
    3 rounds of ``calls`` calls) and whether the compiled output is bit-identical to eager —
    the runtime keeps a compiled section only if it is both faster and identical."""
    import torch.nn.functional as F

    from specdec.runtime.model import apply_rope, rms_norm

    w = torch.randn(hidden, generator=torch.Generator().manual_seed(0))

    def norm_add(x, o):
        x = x + o
        return rms_norm(x, w, 1e-6, False)

    def gate(gu):
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u

    sections = {"residual + RMSNorm": (norm_add, lambda t: (torch.randn(1, t, hidden) * 3, torch.randn(1, t, hidden))),
                "SiLU gate": (gate, lambda t: (torch.randn(1, t, 2 * intermediate) * 4,)),
                "rope": (apply_rope, lambda t: (torch.randn(1, t, heads + 2, head_dim), torch.randn(1, t, 1, head_dim),
                                                torch.randn(1, t, 1, head_dim)))}

    def per_call(fn, args) -> float:
        for _ in range(50):
            fn(*args)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            times.append((time.perf_counter() - t) / calls * 1e6)
        return statistics.median(times)

    print("| section | rows | eager us | compiled us | compiled/eager | bit-identical |\n|---|---|---|---|---|---|")
    for name, (fn, make) in sections.items():
        compiled = torch.compile(fn, dynamic=True)
        for t in rows:
            args = make(t)
            same = torch.equal(fn(*args), compiled(*args))
            e, c = per_call(fn, args), per_call(compiled, args)
            print(f"| {name} | {t} | {e:.1f} | {c:.1f} | {c / e:.2f} | {'yes' if same else 'no'} |", flush=True)


def toy_fast_vs_reference(tokens: int, repeats: int) -> None:
    """The toy experiment's two modes simulating the same number of tokens (plain target sampling
    + speculative sampling) on the seed pair; the ratio of medians."""
    from specdec.toy import run_fast, run_reference

    ref, fast = [], []
    for i in range(repeats):
        ref.append(run_reference(tokens=tokens).seconds)
        fast.append(run_fast(tokens=tokens, speculative_seed=303 + i).seconds)
        print(f"run {i + 1}: reference {ref[-1]:.3f} s, fast {fast[-1]:.4f} s")
    r, f = statistics.median(ref), statistics.median(fast)
    print(f"median reference {r:.3f} s, median fast {f:.4f} s, fast/reference speed ratio {r / f:.0f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    rt = sub.add_parser("runtime", help="our plain decoding vs transformers generate(), forward scaling")
    rt.add_argument("--target", default=registry.DEFAULT_TARGET)
    rt.add_argument("--dtype", default=DEFAULT_DTYPE, choices=list(DTYPE_CHOICES))
    rt.add_argument("--tokens", type=int, default=64)
    rt.add_argument("--runs", type=int, default=3)
    rt.add_argument("--out", default=None, help="write JSON results here")
    dt = sub.add_parser("dtypes", help="our dtypes side by side: speed, scaling, quality vs fp32, prefill")
    dt.add_argument("--target", default=registry.DEFAULT_TARGET)
    dt.add_argument("--dtypes", default="int8,q4,q4k")
    dt.add_argument("--tokens", type=int, default=64)
    dt.add_argument("--runs", type=int, default=3)
    lc = sub.add_parser("llamacpp", help="plain decoding vs llama.cpp on the same GGUF file: speed, scaling, quality")
    lc.add_argument("--target", default=registry.DEFAULT_TARGET)
    lc.add_argument("--tokens", type=int, default=128)
    lc.add_argument("--runs", type=int, default=3)
    lc.add_argument("--out", default=None, help="also write the measurements as JSON here")
    sub.add_parser("step", help="where one decoding step's time goes (default target and draft, q4)")
    fu = sub.add_parser("fused", help="fused attention sublayer vs op by op, interleaved in one process")
    fu.add_argument("--rounds", type=int, default=2)
    sk = sub.add_parser("stack", help="the layers as one C++ call vs the per-layer loop, interleaved in one process")
    sk.add_argument("--rounds", type=int, default=2)
    sub.add_parser("compile", help="torch.compile of a block's elementwise sections vs eager (time, bit-identity)")
    toy = sub.add_parser("toy", help="the toy experiment: reference loop vs --fast mode")
    toy.add_argument("--tokens", type=int, default=100_000)
    toy.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.what == "runtime":
        runtime_vs_transformers(args.target, args.dtype, args.tokens, args.runs, args.out)
    elif args.what == "dtypes":
        compare_dtypes(args.target, args.dtypes.split(","), args.tokens, args.runs)
    elif args.what == "llamacpp":
        result = versus_llamacpp(args.target, args.tokens, args.runs, torch.get_num_threads())
        print_versus_llamacpp(result)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    elif args.what == "step":
        step_profile()
    elif args.what == "fused":
        fused_vs_ops(args.rounds)
    elif args.what == "stack":
        stack_vs_loop(args.rounds)
    elif args.what == "compile":
        compile_trial()
    else:
        toy_fast_vs_reference(args.tokens, args.repeats)


if __name__ == "__main__":
    main()
