"""Building specdec's small C++ kernels: the one registry of their sources and flags
(:data:`KERNEL_SOURCES`), and the build itself.

Each kernel is compiled once per machine with the system's compiler through
``torch.utils.cpp_extension`` and cached under ``$SPECDEC_HOME/kernels``, keyed by its source,
flags and torch version; concurrent first uses build it once (a file lock). The Python wrappers
(:mod:`~specdec.runtime.attention`, :mod:`~specdec.runtime.elementwise`,
:mod:`~specdec.runtime.q4`, :mod:`~specdec.runtime.stack`) call :func:`kernel`; this module
imports none of them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

KERNELS = Path(__file__).with_name("kernels")
# -ffp-contract=off: no multiply-add is fused, so every float operation rounds exactly as in the
# pure-torch references. -fopenmp: at::parallel_for is OpenMP in torch's CPU build (without it
# the kernel runs on one thread); the extension then shares torch's own libgomp.so.1.
BASE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]
# -march=native: the 16-lane loops become one AVX-512 (or two AVX2) operation each; the results
# do not depend on the vector width (lane-wise operations, no reassociation).
VECTOR_FLAGS = ("-march=native", "-mprefer-vector-width=512")
Q4_FLAGS = ("-mavx2", "-mfma", "-mf16c")  # the 4-bit kernel's AVX2 path (AVX-512 paths by target attributes)


@dataclass(frozen=True)
class KernelSource:
    source: str  # kernels/<source>
    depends: tuple[str, ...]  # what it includes (part of the cache key)
    flags: tuple[str, ...]
    needs_avx2: bool = False


KERNEL_SOURCES = {
    "attention": KernelSource("attention.cpp", ("exp16.h", "rope.h"), VECTOR_FLAGS),
    "elementwise": KernelSource("elementwise.cpp", ("exp16.h", "rope.h"), VECTOR_FLAGS),
    "q4": KernelSource("q4.cpp", ("q4_blocks.h", "vnni.h"), Q4_FLAGS, needs_avx2=True),
    "q6k": KernelSource("q6k.cpp", ("vnni.h",), Q4_FLAGS, needs_avx2=True),  # GGUF Q6_K weights exactly
    # GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q5_K weights exactly, and their repack from the file
    "blocks": KernelSource("blocks.cpp", ("vnni.h",), Q4_FLAGS, needs_avx2=True),
    # GGUF Q4_K/Q6_K blocks -> the q4k/q6k tile layouts at load (a byte shuffle; no vector flags)
    "repack": KernelSource("repack.cpp", (), ()),
    # the q4, attention and elementwise kernels' sources, built together: a model's layers in one call
    "stack": KernelSource("stack.cpp", ("q4.cpp", "q4_blocks.h", "vnni.h", "attention.cpp", "elementwise.cpp", "exp16.h", "rope.h"),
                          VECTOR_FLAGS + Q4_FLAGS, needs_avx2=True),
}


def cpu_name() -> str:
    """This CPU's model name and vector ISA flags (every figure names its CPU), from
    /proc/cpuinfo; elsewhere the platform's processor string."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    field = lambda key: next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(key)), "")  # noqa: E731
    isa = [f for f in field("flags").split() if f.startswith(("avx", "amx", "fma", "f16c"))]
    return f"{field('model name')} ({' '.join(isa)})"


def has_avx2() -> bool:
    """Whether this CPU can run the 4-bit kernels (AVX2 or better)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def kernel(name: str):
    """The compiled module of :data:`KERNEL_SOURCES` ``[name]`` (built on first use, cached per
    machine); callers simply call this each time they need it."""
    spec = KERNEL_SOURCES[name]
    if spec.needs_avx2 and not has_avx2():
        raise RuntimeError(f"the {name} kernel needs a CPU with AVX2; use dtype int8")
    return build(name, spec.source, spec.depends, spec.flags)


@functools.cache
def build(stem: str, source: str, depends: tuple[str, ...] = (), flags: tuple[str, ...] = ()):
    """Compile (once per machine) and load (once per process) ``kernels/<source>``; ``depends``
    are headers it includes. Callers simply call this each time they need the module."""
    from torch.utils.cpp_extension import load

    from specdec import cache

    all_flags = BASE_FLAGS + list(flags)
    # (resolved: a cache reached through a link builds from the same paths, so ninja sees no change)
    build_dir = build_directory(stem, source, depends, tuple(all_flags)).resolve()
    key = build_dir.name.rsplit("-", 1)[1]
    build_dir.mkdir(parents=True, exist_ok=True)
    with cache.build_lock(build_dir), _ninja_on_path():
        # torch's own build lock (a plain file, "lock") outlives a build that was killed, and then
        # every later load waits on it forever. We hold the directory's build lock, so no other
        # process is building here: a "lock" file now is stale.
        (build_dir / "lock").unlink(missing_ok=True)
        if not any(build_dir.glob("*.so")):
            cache.notice(f"compiling the {stem} kernel once ({build_dir})")
        # Built from a copy inside the build directory: ninja rebuilds when a source's path
        # changes, so building from the checkout would recompile for every checkout (or test
        # snapshot) that shares this cache. The copy's content is the key's.
        sources = build_dir / "src"
        sources.mkdir(exist_ok=True)
        for name in (source, *depends):
            text = (KERNELS / name).read_bytes()
            if not (sources / name).is_file() or (sources / name).read_bytes() != text:
                (sources / name).write_bytes(text)
        return load(name=f"specdec_{stem}_{key}", sources=[str(sources / source)], extra_cflags=all_flags,
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


def build_directory(stem: str, source: str, depends: tuple[str, ...], all_flags: tuple[str, ...]) -> Path:
    """Where a kernel is built: ``$SPECDEC_HOME/kernels/<stem>-<key>``, keyed by its sources,
    flags, torch version and CPU, and by the torch install it compiles against: the build file
    names torch's include directory, so two environments (say a checkout's .venv and a linked
    one) sharing a cache would otherwise rebuild each other's kernels at every switch."""
    from specdec import cache

    text = b"".join((KERNELS / name).read_bytes() for name in (source, *depends))
    torch_install = os.path.dirname(torch.__file__).encode()
    key = hashlib.sha256(text + " ".join(all_flags).encode() + torch.__version__.encode() + torch_install
                         + _cpu()).hexdigest()[:12]
    return cache.home() / "kernels" / f"{stem}-{key}"


def build_all() -> list[str]:
    """Compile (once per machine) every kernel this CPU can run, so that no later call pays for
    it: the install step (``specdec models install``) calls this; loading a model builds its
    kernels too, so their compile time is load time, never a request's time to first token."""
    built = [name for name, spec in KERNEL_SOURCES.items() if has_avx2() or not spec.needs_avx2]
    for name in built:
        kernel(name)
    return built


def _cpu() -> bytes:
    """What a -march=native build depends on: the CPU's model and feature flags (a shared
    $SPECDEC_HOME on another CPU gets its own build)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return torch.backends.cpu.get_cpu_capability().encode()
    keep = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep).encode()


@contextlib.contextmanager
def _ninja_on_path():
    """torch's extension builder runs ``ninja`` from PATH; the ``ninja`` package installs it next
    to the interpreter's packages, which is not on PATH when the venv is not activated."""
    import ninja

    old = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old
