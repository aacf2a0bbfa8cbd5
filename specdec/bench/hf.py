"""Hugging Face ``generate()`` baselines on the same weights (plain, assisted, prompt lookup)."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch


def load_hf(directory: Path, dtype: str):
    """The transformers model for one of our converted directories, at ``dtype``.

    int8 means ``torch.ao.quantization.quantize_dynamic`` on the Linear layers (fbgemm, per-tensor
    activation scales) — the stock way to run int8 with transformers on a CPU.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    elif dtype == "int8":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    return model


@torch.inference_mode()
def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                assistant=None, prompt_lookup: bool = False) -> tuple[list[int], float]:
    """Generate exactly ``max_new_tokens`` (EOS suppressed) and return (new ids, seconds)."""
    ids = torch.tensor([prompt_ids])
    kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = 10
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    seconds = time.perf_counter() - start
    return out[0, len(prompt_ids) :].tolist(), seconds
