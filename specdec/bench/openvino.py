"""OpenVINO GenAI as a measured peer in ``specdec bench``: the same GGUF files, the same threads.

Optional (``pip install -e '.[openvino]'``: the ``openvino-genai`` wheels, nothing built). Its
``LLMPipeline`` reads a GGUF file directly (its GGUF reader: llama, qwen2 and qwen3 files), so
no conversion to OpenVINO IR is needed and the peer runs the very file specdec runs. Methods:

* ``openvino_plain`` — OpenVINO GenAI's decoding of the prompt's token ids;
* ``openvino_spec`` — its speculative decoding with the draft model (``--draft``), ``k`` draft
  tokens per step. Its ``draft_model`` reads only an OpenVINO IR directory, so with a GGUF draft
  this method fails and the report says why;
* ``openvino_lookup`` — its prompt-lookup decoding (``k`` tokens per step, n-grams up to 3).

Each stops at the end of the model's turn, as specdec's methods do, unless the bench ignores it.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

METHODS = ("openvino_plain", "openvino_spec", "openvino_lookup")
INSTALL_HINT = "pip install -e '.[openvino]'"
NGRAM = 3  # the longest n-gram openvino_lookup matches (ours: speculation.NGRAM)


def available() -> bool:
    return importlib.util.find_spec("openvino_genai") is not None


class OpenVino:
    """Up to three pipelines on one target GGUF file, made when first used: plain, with the
    draft model, with prompt lookup."""

    def __init__(self, target: Path, draft: Path | None, threads: int, k: int) -> None:
        self.target, self.draft, self.k = target, draft, k
        self.properties = {"INFERENCE_NUM_THREADS": threads}
        self._pipes: dict[str, object] = {}

    def _pipe(self, method: str):
        import openvino_genai as ov_genai

        if method not in self._pipes:
            extra = {}
            if method == "openvino_spec":
                if self.draft is None:
                    raise ValueError("openvino_spec needs a draft model (--draft)")
                if self.draft.suffix == ".gguf":  # (its GGUF reader is LLMPipeline's alone)
                    raise ValueError(f"OpenVINO GenAI's draft_model reads an OpenVINO IR directory, not a GGUF file "
                                     f"({self.draft.name}); exporting one needs optimum-intel, whose pins (torch "
                                     f"2.14, transformers 5.5) conflict with this environment")
                extra["draft_model"] = ov_genai.draft_model(str(self.draft), "CPU", **self.properties)
            elif method == "openvino_lookup":
                extra["prompt_lookup"] = True
            self._pipes[method] = ov_genai.LLMPipeline(str(self.target), "CPU", **extra, **self.properties)
        return self._pipes[method]

    def _config(self, method: str, max_new_tokens: int, temperature: float, seed: int, stop_at_eos: bool):
        import openvino_genai as ov_genai

        config = ov_genai.GenerationConfig()
        config.max_new_tokens, config.ignore_eos = max_new_tokens, not stop_at_eos
        config.repetition_penalty = 1.0
        if temperature > 0:  # the whole distribution, as our methods sample (no top-k / top-p)
            config.do_sample, config.temperature, config.top_p, config.rng_seed = True, temperature, 1.0, seed
        if method != "openvino_plain":
            config.num_assistant_tokens = self.k
        if method == "openvino_lookup":
            config.max_ngram_size = NGRAM
        return config

    def run(self, method: str, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int,
            stop_at_eos: bool = True) -> dict:
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        pipe = self._pipe(method)
        config = self._config(method, max_new_tokens, temperature, seed, stop_at_eos)
        ids = np.array([prompt_ids], dtype=np.int64)
        inputs = ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        start = time.perf_counter()
        out = pipe.generate(inputs, config)
        seconds = time.perf_counter() - start
        tokens = [int(t) for t in out.tokens[0]]
        return {"token_ids": tokens, "metrics": {"generated_tokens": len(tokens), "total_s": seconds,
                                                 "throughput_tok_s": len(tokens) / seconds}}
