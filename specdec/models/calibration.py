"""Activation statistics for int8 outlier smoothing, computed once per model and cached.

One fp32 forward over a fixed, built-in text (code, prose, a chat turn) records, for every linear
layer, the max |input| of each channel. The statistics only choose how range is split between
activations and weights (see :mod:`specdec.runtime.linear`); they never make a row depend on
other rows.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from specdec import cache
from specdec.runtime.config import ModelConfig
from specdec.runtime.model import Transformer

CALIBRATION_TEXT = '''<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Write a Python function that merges two sorted lists, and explain its complexity.<|im_end|>
<|im_start|>assistant
def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
    result, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i]); i += 1
        else:
            result.append(b[j]); j += 1
    result.extend(a[i:]); result.extend(b[j:])
    return result

The loop visits each element once, so the running time is O(n + m) and the extra memory is O(n + m).
<|im_end|>
The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined
movable metal type, oil-based inks and a wooden screw press. Within fifty years, presses operated in
more than two hundred cities across Europe, and the price of books fell sharply.
SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON customers.id = orders.customer_id
GROUP BY name ORDER BY orders DESC LIMIT 10;
Translate to French: "The weather is lovely today, let's walk to the river." -> "Il fait très beau
aujourd'hui, allons marcher jusqu'à la rivière." Solve: if 3x + 7 = 22, then 3x = 15 and x = 5.
'''


def calibrate(cfg: ModelConfig, weights: dict[str, torch.Tensor], tokenizer) -> dict[str, torch.Tensor]:
    model = Transformer(cfg, weights, "float32")
    stats: dict[str, torch.Tensor] = {}
    layers = model.linear_layers()
    for name, layer in layers.items():
        # the model calls its linears' forward directly (no Module hooks): wrap forward itself
        def recorded(x, name=name, forward=layer.forward):
            absmax = x.detach().float().reshape(-1, x.shape[-1]).abs().amax(0)
            stats[name] = absmax if name not in stats else torch.maximum(stats[name], absmax)
            return forward(x)

        layer.forward = recorded
    ids = tokenizer(CALIBRATION_TEXT)["input_ids"][: min(1024, cfg.max_position_embeddings)]
    if len(ids) < 64:  # a tokenizer that cannot read the text: use a fixed pseudo-random sequence
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (256,), generator=g).tolist()
    try:
        model(torch.tensor([ids]), model.new_cache(1, len(ids)))
    finally:
        for layer in layers.values():
            del layer.forward  # back to the class's forward
    return stats


def cached_calibration(
    directory: Path, content_key: str, cfg: ModelConfig, weights: dict[str, torch.Tensor], tokenizer
) -> dict[str, torch.Tensor]:
    """Calibration stats for the model in ``directory`` (whose files have the key
    ``content_key``), computed on first use and stored; rebuilt once if the stored file is damaged."""
    from safetensors.torch import load_file, save_file

    key = hashlib.sha256(f"{content_key}:{CALIBRATION_TEXT}".encode()).hexdigest()[:16]
    path = cache.home() / "calibration" / f"{key}.safetensors"

    def build(tmp: Path) -> None:
        stats = calibrate(cfg, weights, tokenizer)
        save_file({k: v.contiguous() for k, v in stats.items()}, str(tmp))

    return cache.cached(path, build, lambda p: load_file(str(p)), "the calibration file")
