"""llama.cpp's draft-model speculation as a measured peer: ``llama-server -m TARGET -md DRAFT``.

llama-cpp-python has no draft-model API, so this peer runs llama.cpp's own server, built once
from the llama.cpp source that llama-cpp-python 0.3.36 vendors (``make llama-server``: the same
commit as the ``llamacpp_*`` methods, so ``llamacpp_plain`` is its plain decoding). The binary is
found as ``$SPECDEC_LLAMA_SERVER``, ``llama-server`` on the PATH, or where the make target puts
it (:data:`BUILT`).

* ``llamacpp_draft`` — the target GGUF with the draft GGUF (``--draft``; ``-md DRAFT --spec-type
  draft-simple``: this commit loads a ``-md`` draft without the type but does not speculate with
  it), llama.cpp's defaults for how many tokens to draft (``--spec-draft-n-max``,
  ``--spec-draft-p-min``), the same threads, one slot, no prompt cache between runs.

:func:`start` also serves ``benchmarks/serve_bench.py``'s llama.cpp peer (``--parallel N``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

METHODS = ("llamacpp_draft",)
BUILT = Path.home() / ".cache" / "specdec" / "llama.cpp" / "llama-server"
INSTALL_HINT = "make llama-server (builds llama.cpp's server from llama-cpp-python 0.3.36's vendored source)"


def binary() -> Path | None:
    for candidate in (os.environ.get("SPECDEC_LLAMA_SERVER"), shutil.which("llama-server"), BUILT):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def available() -> bool:
    return binary() is not None


def start(target: Path, draft: Path | None, threads: int, context: int = 4096, parallel: int = 1,
          extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """Start ``llama-server`` on a free loopback port and wait until its model is loaded; returns
    (process, base url). ``context`` is the whole KV, shared by the ``parallel`` slots."""
    exe = binary()
    if exe is None:
        raise FileNotFoundError(f"llama-server not found: {INSTALL_HINT}")
    port = free_port()
    # (this commit loads a -md draft but speculates only with an explicit --spec-type)
    spec = ["-md", str(draft), "--spec-type", "draft-simple"] if draft is not None else []
    cmd = [str(exe), "-m", str(target), *spec, "-t", str(threads),
           "-tb", str(threads), "-c", str(context * parallel), "--parallel", str(parallel), "--port", str(port),
           "--host", "127.0.0.1", "--no-webui", *extra]
    return launch(cmd, f"http://127.0.0.1:{port}", "llama-server", 300)


def launch(cmd: list[str], url: str, name: str, seconds: float, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Start a peer server ``cmd`` in a process group of its own and wait until ``url`` answers
    (:func:`wait_healthy`). Its output goes to a log file, never a pipe: a server that logs every
    request would fill a pipe nobody reads within a few dozen requests and then block."""
    import tempfile

    log = tempfile.NamedTemporaryFile("w+", prefix=f"{name.replace(' ', '-')}-", suffix=".log", delete=False)
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    return wait_healthy(process, url, name, seconds, Path(log.name))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(process: subprocess.Popen, url: str, name: str, seconds: float,
                 log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Wait until the server ``process`` answers ``url``/health with 200; a server that exits is a
    one-line error (with the last line of its ``log``, if it has one), one that takes longer is killed."""
    import httpx

    deadline = time.time() + seconds
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with status {process.returncode}: {_last_line(log)}".rstrip(": "))
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"{name} did not start within {seconds:.0f} s")


def _last_line(log: Path | None) -> str:
    """The last non-empty line of a server's ``log`` (nothing without one)."""
    if log is None:
        return ""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


class LlamaServer:
    """One ``llama-server`` with the draft model, started when first used, for single-stream runs."""

    def __init__(self, target: Path, draft: Path | None, threads: int) -> None:
        if draft is None:
            raise ValueError("llamacpp_draft needs a draft model (--draft)")
        self.target, self.draft, self.threads = target, draft, threads
        self.process, self.url = None, None

    def close(self) -> None:
        if self.process is not None:
            stop(self.process)
            self.process = None

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int,
            eos: frozenset[int] = frozenset()) -> dict:
        """Decode ``prompt_ids`` as :meth:`specdec.bench.llamacpp.LlamaCpp.run` does: the answer
        ends after a token of ``eos`` (the stream is closed there, which cancels the rest) or at
        ``max_new_tokens``; the whole distribution at ``temperature`` (no top-k/top-p/min-p)."""
        import httpx

        if self.process is None:
            self.process, self.url = start(self.target, self.draft, self.threads)
        body = {"prompt": prompt_ids, "n_predict": max_new_tokens, "temperature": temperature, "top_k": 0,
                "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0, "seed": seed, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "stream": True}
        ids, timings, first = [], {}, None
        start_time = time.perf_counter()
        with httpx.stream("POST", self.url + "/completion", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                ids += [int(t) for t in chunk.get("tokens", [])]
                first = first or (time.perf_counter() if ids else None)
                timings = chunk.get("timings", timings)
                if chunk.get("stop") or ids and ids[-1] in eos:  # (n_predict ends it at max_new_tokens)
                    break
        return stream_run(ids, start_time, first, eos, max_new_tokens, draft_tokens=timings.get("draft_n"),
                          accepted_draft_tokens=timings.get("draft_n_accepted"))


def stream_run(ids: list[int], start_time: float, first: float | None, eos: frozenset[int], max_new_tokens: int,
               **metrics) -> dict:
    """A peer's streamed answer as a bench run: ``ids`` cut after the first token of ``eos`` (or
    at ``max_new_tokens``), timed from ``start_time`` (``first``: when the first token arrived;
    now if none did); ``metrics``: the peer's own counters to add."""
    seconds = time.perf_counter() - start_time
    ids = ids[: next((i + 1 for i, t in enumerate(ids) if t in eos), max_new_tokens)]
    ttft = (first or time.perf_counter()) - start_time
    return {"token_ids": ids, "metrics": {"generated_tokens": len(ids), "total_s": seconds,
                                          "throughput_tok_s": len(ids) / seconds, "ttft_s": ttft,
                                          "tpot_s": (seconds - ttft) / max(len(ids) - 1, 1), **metrics}}
