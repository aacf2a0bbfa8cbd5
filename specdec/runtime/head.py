"""A draft head's body at inference (EAGLE-style): its config, its weights' names, and
:class:`DraftHead`, the head on the runtime's batch-invariant quantized layers with its own KV
cache.

What the head computes (the same function as the trainable :class:`specdec.training.head_net.HeadNet`;
``tests/test_head.py`` checks that they agree): at slot ``s``, the target's last-block output
``h_s`` and the embedding of the token at ``s + 1``, each RMS-normalised (the features carry
outliers ~100x the embeddings' scale), concatenated and projected ``2E -> E`` by ``fc``; then one
decoder layer of the target's shape (causal attention over the head's earlier slots); its output
``f_s`` is a guess of ``h_{s+1}``, and the target's final norm and output rows restricted to a
frequency-ranked subset ``S`` of the vocabulary turn it into the draft distribution of the token
at ``s + 2``. Ids outside ``S`` get ``q = 0``: they are never drafted, and exactness is
unaffected (the verifier only ever divides ``p`` by ``q`` where a token was drafted from ``q > 0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.runtime.config import ModelConfig, Rope
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.linear import LinearBuilder
from specdec.runtime.model import Transformer, rms_norm

LAYER = "model.layers.0."
LINEARS = {  # HF-style parameter name -> shape as a function of (E, Hq*D, Hkv*D, I)
    "self_attn.q_proj": lambda e, q, kv, i: (q, e),
    "self_attn.k_proj": lambda e, q, kv, i: (kv, e),
    "self_attn.v_proj": lambda e, q, kv, i: (kv, e),
    "self_attn.o_proj": lambda e, q, kv, i: (e, q),
    "mlp.gate_proj": lambda e, q, kv, i: (i, e),
    "mlp.up_proj": lambda e, q, kv, i: (i, e),
    "mlp.down_proj": lambda e, q, kv, i: (e, i),
}



@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    target_vocab_size: int

    @classmethod
    def for_target(cls, cfg: ModelConfig, intermediate_size: int) -> "HeadConfig":
        if cfg.is_gemma:
            raise ValueError("draft heads support llama-family targets (Llama, Qwen2, SmolLM2), not Gemma 3")
        return cls(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, intermediate_size,
                   cfg.rms_norm_eps, cfg.rope_theta, cfg.attention_bias, cfg.vocab_size)

    def model_config(self, vocab: int, max_positions: int) -> ModelConfig:
        """The runtime config of the head's body: one layer, output over the subset ``vocab``."""
        return ModelConfig(arch="llama", vocab_size=vocab, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                           max_position_embeddings=max_positions, tie_word_embeddings=False,
                           attention_bias=self.attention_bias, rope=Rope(self.rope_theta, self.head_dim))


class DraftHead:
    """The head at inference: quantized, batch invariant, with its own KV cache."""

    def __init__(self, cfg: HeadConfig, state: dict[str, torch.Tensor], vocab_ids: torch.Tensor,
                 target: Transformer, lm_rows: torch.Tensor, dtype: str, grids: dict | None = None) -> None:
        """``dtype``: the target's runtime dtype; under ``gguf`` the head (whose weights are not a
        GGUF file's) runs as ``q4k``, as that runtime builds a layer without a file's blocks.
        ``grids``: the q4k decomposition of each stored matrix by parameter name (a q4k head file),
        taken exactly by the q4k runtime."""
        if target.cfg.vocab_size != cfg.target_vocab_size or target.cfg.hidden_size != cfg.hidden_size:
            raise ValueError(
                f"this head was trained for a target with vocabulary {cfg.target_vocab_size} and hidden size "
                f"{cfg.hidden_size}; the target has {target.cfg.vocab_size} and {target.cfg.hidden_size}"
            )
        if vocab_ids.numel() > 1 and not bool((vocab_ids[1:] > vocab_ids[:-1]).all()):
            raise ValueError("a head's vocab_ids must be sorted and unique")
        self.cfg, self.target = cfg, target
        self.vocab_ids = vocab_ids.long()  # [N], sorted
        weights = {k: v for k, v in state.items() if k.startswith(LAYER)}
        weights["model.embed_tokens.weight"] = target.embed  # unused by forward_embeds; shared, no copy
        weights["model.norm.weight"] = target.final_norm
        weights["lm_head.weight"] = lm_rows
        body_cfg = cfg.model_config(len(vocab_ids), target.cfg.max_position_embeddings)
        dtype = "q4k" if dtype == "gguf" else dtype
        self.body = Transformer(body_cfg, weights, dtype, grids=grids or None)
        self.fc = LinearBuilder(dtype, grids=grids or None)("fc", lambda: state["fc.weight"],
                                                            parts=(("fc.weight", cfg.hidden_size),))
        self.body.quantized_state = {}
        self.norm_feature = state["feature_norm.weight"].to(target.act_dtype)
        self.norm_embed = state["embed_norm.weight"].to(target.act_dtype)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return self.body.new_cache(batch, capacity)

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor, tokens: torch.Tensor, cache: KVCache,
                 **options) -> tuple[torch.Tensor, torch.Tensor]:
        """``features`` ``[B, T, E]`` and the tokens that follow them ``[B, T]`` -> subset logits
        ``[B, T', N]`` and the head's guesses of the next features ``[B, T, E]``. ``features`` are
        the target's last-block outputs, or the head's own guesses (later draft steps). ``options``:
        :meth:`Transformer.forward_embeds`'s (``logit_index``; ``tree_mask``/``positions``/``tree_base``)."""
        act, eps = self.target.act_dtype, self.cfg.rms_norm_eps
        features = features.to(act)
        x = self.fc(torch.cat([rms_norm(features, self.norm_feature, eps, False),
                               rms_norm(self.target.embed[tokens], self.norm_embed, eps, False)], -1))
        return self.body.forward_embeds(x.to(self.target.act_dtype), cache, return_hidden=True, **options)
