"""llama.cpp as a measured peer in ``specdec bench``: the same GGUF file, the same threads.

Optional (``pip install -e '.[llamacpp]'`` builds llama-cpp-python from source, a few minutes
here). Methods:

* ``llamacpp_plain`` — llama.cpp's own decoding of the prompt's token ids;
* ``llamacpp_spec`` — llama.cpp with its prompt-lookup speculation (llama-cpp-python's
  ``LlamaPromptLookupDecoding``, ``k`` tokens per step): the peer of our ``ngram`` method.

:func:`block_costs` measures what speculation relies on, for llama.cpp and for specdec side by
side: the time to evaluate 5 new tokens against 1 after a prefix, and how far a token's logits
move between being evaluated alone and as the first of a 5-token block (0 for specdec, whose rows
are batch invariant; for llama.cpp this drift is why its speculative greedy output can differ
from its plain greedy output — the report checks that too).
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path

import torch

METHODS = ("llamacpp_plain", "llamacpp_spec")
INSTALL_HINT = "pip install -e '.[llamacpp]'"


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_file(target: str) -> Path:
    """The GGUF file a target name or path stands for (llama.cpp reads the file itself)."""
    from specdec.models import registry

    spec = registry.resolve(target)
    if spec is not None:
        return spec.gguf_path
    path = Path(target).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ValueError(f"the llama.cpp methods need a GGUF target (a registry name or a .gguf file), got {target!r}")


class LlamaCpp:
    """Two llama.cpp contexts on one GGUF file: plain, and with prompt-lookup speculation."""

    def __init__(self, gguf: Path, threads: int, context: int, k: int) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        common = dict(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=context, verbose=False)
        self.plain = Llama(**common)
        self.spec = Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))
        self.common = common

    def run(self, method: str, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int,
            eos: frozenset[int] = frozenset()) -> dict:
        """Decode ``prompt_ids``; the answer ends after a token of ``eos`` (the end of the model's
        turn, as our methods' answers do) or at ``max_new_tokens``."""
        llm = self.spec if method == "llamacpp_spec" else self.plain
        llm.reset()
        llm.set_seed(seed)
        start = time.perf_counter()
        ids = []
        # top-k/top-p/min-p off and no repetition penalty: the same distribution as our methods
        for token in llm.generate(prompt_ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0,
                                  repeat_penalty=1.0, reset=True):
            ids.append(int(token))
            if len(ids) >= max_new_tokens or ids[-1] in eos:
                break
        seconds = time.perf_counter() - start
        return {"token_ids": ids, "metrics": {"generated_tokens": len(ids), "total_s": seconds,
                                              "throughput_tok_s": len(ids) / seconds}}

    def block_costs(self, prefix: list[int], block: list[int], repeats: int = 7) -> dict:
        """Median ms to evaluate ``block[:1]`` and ``block`` after ``prefix``, and the largest
        logit difference of ``block[0]``'s next-token logits between the two."""
        from llama_cpp import Llama

        llm = Llama(**self.common, logits_all=True)
        llm.reset()
        llm.eval(prefix)
        base = llm.n_tokens
        times, logits = {}, {}
        for n in (1, len(block)):
            samples = []
            for _ in range(repeats):
                llm.n_tokens = base  # eval() drops the KV cache past n_tokens
                t = time.perf_counter()
                llm.eval(block[:n])
                samples.append(time.perf_counter() - t)
            times[n] = statistics.median(samples) * 1e3
            logits[n] = torch.tensor(llm.scores[base]).clone()  # after block[0]
        del llm
        return {"eval_ms": times, "ratio": times[len(block)] / times[1],
                "logit_max_diff": float((logits[1] - logits[len(block)]).abs().max())}


def specdec_block_costs(model, prefix: list[int], block: list[int], repeats: int = 7) -> dict:
    """The same measurement for a specdec model (logits of ``block[0]``'s position alone vs in
    the block: 0 by construction, measured anyway)."""
    cache = model.new_cache(1, len(prefix) + len(block) + 1)
    model(torch.tensor([prefix]), cache)
    base = len(prefix)
    times, logits = {}, {}
    for n in (1, len(block)):
        samples = []
        for _ in range(repeats):
            cache.truncate(base)
            t = time.perf_counter()
            out = model(torch.tensor([block[:n]]), cache)
            samples.append(time.perf_counter() - t)
        times[n] = statistics.median(samples) * 1e3
        logits[n] = out[0, 0].clone()
    return {"eval_ms": times, "ratio": times[len(block)] / times[1],
            "logit_max_diff": float((logits[1] - logits[len(block)]).abs().max())}


def open_file(gguf: Path, threads: int, context: int, logits_all: bool = False):
    """A plain llama.cpp context on ``gguf`` (greedy sampling is the caller's)."""
    from llama_cpp import Llama

    return Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=context,
                 logits_all=logits_all, verbose=False)


def greedy_seconds(llm, prompt_ids: list[int], tokens: int) -> float:
    """Seconds to prefill ``prompt_ids`` and decode ``tokens`` greedy tokens (end to end)."""
    llm.reset()
    start = time.perf_counter()
    for n, _ in enumerate(llm.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True), 1):
        if n >= tokens:
            break
    return time.perf_counter() - start


def forward_scaling(llm, context: int = 200, sizes=(1, 2, 5, 9), repeats: int = 7) -> dict[int, float]:
    """Median seconds of one evaluation of ``n`` new tokens after a ``context``-token prefix, the
    sizes interleaved (as :func:`specdec.bench.measure.forward_scaling`)."""
    g = torch.Generator().manual_seed(0)
    llm.reset()
    llm.eval(torch.randint(0, 10_000, (context,), generator=g).tolist())
    blocks = {n: torch.randint(0, 10_000, (n,), generator=g).tolist() for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats + 1):
        for n in sizes:
            llm.n_tokens = context  # eval() drops the KV cache past n_tokens
            t = time.perf_counter()
            llm.eval(blocks[n])
            if r:
                times[n].append(time.perf_counter() - t)
    return {n: statistics.median(ts) for n, ts in times.items()}


def teacher_forced_logits(llm, ids: torch.Tensor, plen: int) -> torch.Tensor:
    """llama.cpp's logits predicting ``ids[0, plen:]`` (a context opened with ``logits_all``)."""
    llm.reset()
    llm.eval(ids[0].tolist())
    return torch.tensor(llm.scores[plen - 1 : ids.shape[1] - 1]).float()
