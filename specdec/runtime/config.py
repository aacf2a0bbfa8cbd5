"""Model configuration read from a Hugging Face config (llama family or Gemma 3 text)."""

from __future__ import annotations

from dataclasses import dataclass, field

LLAMA_FAMILY = {"llama", "qwen2", "mistral"}
GEMMA3 = {"gemma3_text", "gemma3"}


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" (Llama, Qwen2, SmolLM2) or "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_theta: float = 10000.0
    # Gemma 3 only
    rope_local_theta: float = 10000.0
    sliding_window: int | None = None
    layer_is_sliding: tuple[bool, ...] = field(default_factory=tuple)
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    @property
    def is_gemma(self) -> bool:
        return self.arch == "gemma3"

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        model_type = hf.model_type
        if model_type == "gemma3":  # multimodal wrapper: use its text part
            hf = hf.text_config
            model_type = hf.model_type
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        common = dict(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        )
        rope = getattr(hf, "rope_parameters", None) or {}
        if model_type in LLAMA_FAMILY:
            _require_default_rope(rope, model_type)
            return cls(
                arch="llama",
                attention_bias=bool(getattr(hf, "attention_bias", model_type == "qwen2")),
                rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
                **common,
            )
        if model_type in GEMMA3:
            full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
            _require_default_rope(full, model_type)
            _require_default_rope(local, model_type)
            return cls(
                arch="gemma3",
                attention_bias=bool(getattr(hf, "attention_bias", False)),
                rope_theta=float(full.get("rope_theta", 1_000_000.0)),
                rope_local_theta=float(local.get("rope_theta", 10_000.0)),
                sliding_window=hf.sliding_window,
                layer_is_sliding=tuple(t == "sliding_attention" for t in hf.layer_types),
                query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
                final_logit_softcapping=getattr(hf, "final_logit_softcapping", None),
                **common,
            )
        raise ValueError(f"unsupported architecture {model_type!r}: specdec runs llama, qwen2 and gemma3 models")


def _require_default_rope(rope: dict, model_type: str) -> None:
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"{model_type}: rope scaling {kind!r} is not supported yet")
