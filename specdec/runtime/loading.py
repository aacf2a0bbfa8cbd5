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
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from specdec.runtime import registry  # noqa: E402
from specdec.runtime.calibration import cached_calibration  # noqa: E402
from specdec.runtime.config import ModelConfig  # noqa: E402
from specdec.runtime.model import Transformer  # noqa: E402


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: object  # a transformers tokenizer
    source_dir: Path
    load_seconds: float


def _converted_dir(key: str) -> Path:
    return registry.home() / "converted" / key


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
        return convert_gguf(spec.gguf_path, _converted_dir(f"{spec.name}-{spec.sha256[:12]}"))
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


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    # Some checkpoints (e.g. multimodal Gemma 3) nest the text model; normalise the prefix.
    return {k.replace("model.language_model.", "model."): v for k, v in weights.items()}


def load(name_or_path: str, dtype: str = "int8", *, install: bool = False) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    start = time.perf_counter()
    directory = source_dir(name_or_path, install=install)
    hf_config = AutoConfig.from_pretrained(str(directory))
    cfg = ModelConfig.from_hf(hf_config)
    weights = load_weights(directory)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    act_absmax = None
    if dtype == "int8":
        act_absmax = cached_calibration(directory, registry.home(), cfg, weights, tokenizer)
    model = Transformer(cfg, weights, dtype, act_absmax)
    spec = registry.resolve(name_or_path)
    name = spec.name if spec else str(name_or_path)
    return LoadedModel(name, model, tokenizer, directory, time.perf_counter() - start)
