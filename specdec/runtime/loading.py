"""Load a model by registry name, GGUF file or Hugging Face directory; convert GGUF once, cache it.

GGUF files are dequantized by transformers' GGUF loader (which also rebuilds the tokenizer). That
takes 20-100 s, so it is done once: the result is written as a Hugging Face directory
(``config.json``, ``model.safetensors``, tokenizer files) under ``$SPECDEC_HOME/converted/`` and
every later load reads that directory in seconds. Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from specdec.runtime import registry  # noqa: E402
from specdec.runtime.calibration import cached_calibration  # noqa: E402
from specdec.runtime.config import ModelConfig  # noqa: E402
from specdec.runtime.model import Transformer  # noqa: E402


QUANT_FORMAT = "row-int8-smooth-v1"  # bump when the quantized layout or recipe changes


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: object  # a transformers tokenizer
    source_dir: Path
    load_seconds: float


def _converted_dir(key: str) -> Path:
    return registry.home() / "converted" / key


def converted_dir_for(spec: registry.ModelSpec) -> Path:
    return _converted_dir(f"{spec.name}-{spec.sha256[:12]}")


def _gguf_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def source_dir(name_or_path: str, *, install: bool = False) -> Path:
    """The Hugging Face directory for a registry name, a GGUF file, or an HF directory."""
    spec = registry.resolve(name_or_path)
    if spec is not None:
        if not spec.installed():
            if not install:
                raise FileNotFoundError(
                    f"model {spec.name!r} is not installed: run `specdec models install {spec.name}`"
                )
            registry.install(spec)
        return convert_gguf(spec.gguf_path, converted_dir_for(spec))
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, _converted_dir(f"{path.stem}-{_gguf_key(path)}"))
    if path.is_dir() and (path / "config.json").exists():
        return path
    known = ", ".join(sorted(registry.MODELS) + sorted(registry.ALIASES))
    raise FileNotFoundError(
        f"{name_or_path!r} is neither a known model ({known}), a .gguf file, nor a directory with config.json"
    )


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize ``gguf`` into an HF directory ``out`` (once; later calls return at once)."""
    if (out / "done").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from safetensors.torch import save_file

    print(f"specdec: converting {gguf.name} once (dequantize + tokenizer); later loads use {out}", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if getattr(hf.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.config.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / "done").write_text(json.dumps({"gguf": str(gguf), "converted_at": time.time()}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


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

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load(name_or_path: str, dtype: str = "int8", *, install: bool = False) -> LoadedModel:
    """Load a model for inference. int8 layers are cached on disk after the first build, so a
    second load reads ~1 byte per weight and only repacks it for the kernel."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoTokenizer

    start = time.perf_counter()
    directory = source_dir(name_or_path, install=install)
    hf_config = AutoConfig.from_pretrained(str(directory))
    cfg = ModelConfig.from_hf(hf_config)
    weights = LazyWeights(directory)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    if dtype == "int8":
        key = hashlib.sha256(f"{directory.resolve()}:{QUANT_FORMAT}".encode()).hexdigest()[:16]
        qpath = registry.home() / "quantized" / f"{key}.safetensors"
        if qpath.exists():
            model = Transformer(cfg, weights, dtype, quantized=load_file(str(qpath)))
        else:
            print(f"specdec: quantizing {directory.name} to int8 once (calibrate, quantize); cached at {qpath}", flush=True)
            act_absmax = cached_calibration(directory, registry.home(), cfg, weights, tokenizer)
            model = Transformer(cfg, weights, dtype, act_absmax)
            qpath.parent.mkdir(parents=True, exist_ok=True)
            save_file(model.quantized_state, str(qpath) + ".tmp")
            os.replace(str(qpath) + ".tmp", qpath)
            model.quantized_state = {}
    else:
        model = Transformer(cfg, weights, dtype)
    spec = registry.resolve(name_or_path)
    name = spec.name if spec else str(name_or_path)
    return LoadedModel(name, model, tokenizer, directory, time.perf_counter() - start)
