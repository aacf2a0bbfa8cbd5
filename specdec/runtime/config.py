"""What a model is: one entry per family, read from a Hugging Face config.

The model code (:mod:`specdec.runtime.model`) branches only on the fields of :class:`ModelConfig`
(norm style, q/k norms, fused projections, rope, sliding windows, softcapping), never on a family
name. A family is a :data:`FAMILIES` entry; every config value the runtime cannot honour is a
:class:`UnsupportedModel` error here, at load time, never silently dropped: a model must not load
into a state that computes something other than its config says.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class UnsupportedModel(ValueError):
    """A model whose architecture, rope scaling or other setting specdec cannot compute exactly."""


# Rope scalings and the parameters each reads (besides rope_theta); see specdec.runtime.rope.
ROPE_KINDS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),  # NTK-aware: equal to default below max_position_embeddings, where specdec stops
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings", "attention_factor"),
    "freq_factors": ("factors",),  # a GGUF file's rope_freqs: each frequency divided by its factor (Llama 3.1+)
}


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of the first ``dim`` dimensions of each head (``dim < head_dim``: partial
    rotary), with base ``theta`` and a scaling ``kind`` of :data:`ROPE_KINDS` and its ``params``."""

    theta: float
    dim: int
    kind: str = "default"
    params: tuple[tuple[str, object], ...] = ()
    max_positions: int = 0  # the model's max_position_embeddings (yarn/longrope derive factors from it)

    def param(self, name: str, default=None):
        return dict(self.params).get(name, default)


@dataclass(frozen=True)
class Family:
    """What a family's blocks look like, beyond what its config says."""

    gemma_norms: bool = False  # RMSNorm weight (1 + w) in fp32, sandwich norms, gelu(tanh), sqrt(E) embedding scale
    qk_norm: bool = False  # RMSNorm over each head's query and key before rope (Qwen3, Gemma 3)
    fused_qkv: bool = False  # one qkv_proj / gate_up_proj weight instead of three / two (Phi-3)
    attention_bias: bool = False  # q/k/v biases when the config does not say (Qwen2)
    local_rope: bool = False  # sliding layers have their own rope (Gemma 3)


FAMILIES = {
    "llama": Family(),
    "mistral": Family(),
    "ministral": Family(),
    "qwen2": Family(attention_bias=True),
    "qwen3": Family(qk_norm=True),
    "phi3": Family(fused_qkv=True),
    "gemma2": Family(gemma_norms=True),
    "gemma3_text": Family(gemma_norms=True, qk_norm=True, local_rope=True),
}
ACTIVATIONS = {False: "silu", True: "gelu_pytorch_tanh"}  # by gemma_norms


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # the Hugging Face model_type, e.g. "llama", "qwen3", "gemma2"
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
    rope: Rope | None = None  # None: default rope, theta 10000, every dimension
    rope_local: Rope | None = None  # sliding layers' rope where it differs (Gemma 3)
    gemma_norms: bool = False
    qk_norm: bool = False
    fused_qkv: bool = False
    sliding_window: int | None = None
    layer_is_sliding: tuple[bool, ...] = field(default_factory=tuple)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.rope is None:
            object.__setattr__(self, "rope", Rope(10000.0, self.head_dim, max_positions=self.max_position_embeddings))
        if not self.layer_is_sliding:
            object.__setattr__(self, "layer_is_sliding", (False,) * self.num_layers)

    @property
    def is_gemma(self) -> bool:
        return self.gemma_norms

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def plain_llama(self) -> bool:
        """Blocks the fused kernels run: llama norms, no q/k norm, full rotary, no softcap, one rope."""
        return not (self.gemma_norms or self.qk_norm or self.attn_logit_softcapping or self.rope_local is not None
                    or self.rope.dim != self.head_dim)

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        model_type = hf.model_type
        if model_type == "gemma3":  # multimodal wrapper: use its text part
            hf = hf.text_config
            model_type = hf.model_type
        family = FAMILIES.get(model_type)
        if family is None:
            raise UnsupportedModel(f"unsupported architecture {model_type!r}: specdec runs {', '.join(sorted(FAMILIES))}")
        _check_unsupported(hf, model_type, family)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        window, sliding = _sliding(hf, model_type)
        ropes = _with_freq_factors(_ropes(hf, model_type, head_dim, family), hf, model_type)
        gemma = family.gemma_norms
        return cls(
            arch=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=_context_length(hf, ropes[0]),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", family.attention_bias)),
            rope=ropes[0],
            rope_local=ropes[1],
            gemma_norms=gemma,
            qk_norm=family.qk_norm,
            fused_qkv=family.fused_qkv,
            sliding_window=window,
            layer_is_sliding=sliding,
            attn_scale=float(hf.query_pre_attn_scalar) ** -0.5 if gemma else None,
            attn_logit_softcapping=getattr(hf, "attn_logit_softcapping", None) or None,
            final_logit_softcapping=getattr(hf, "final_logit_softcapping", None) or None,
        )


def _check_unsupported(hf, model_type: str, family: Family) -> None:
    """Refuse what the runtime would silently compute differently."""
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
    if act != ACTIVATIONS[family.gemma_norms]:
        raise UnsupportedModel(f"{model_type}: activation {act!r} is not supported (specdec runs "
                               f"{ACTIVATIONS[family.gemma_norms]!r} for this family)")
    if getattr(hf, "mlp_bias", False):
        raise UnsupportedModel(f"{model_type}: MLP biases (mlp_bias) are not supported")
    if getattr(hf, "attn_logit_softcapping", None) and not family.gemma_norms:
        raise UnsupportedModel(f"{model_type}: attention-logit softcapping is supported for Gemma 2 only")


def _sliding(hf, model_type: str) -> tuple[int | None, tuple[bool, ...]]:
    """The sliding window and which layers use it: from ``layer_types`` where the config has them
    (Gemma 2/3, Qwen2/3, Ministral), else every layer when ``sliding_window`` is set (Mistral, Phi-3)."""
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    if types is not None:
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise UnsupportedModel(f"{model_type}: layer types {sorted(unknown)} are not supported")
        sliding = tuple(t == "sliding_attention" for t in types)
    else:
        sliding = (window is not None,) * hf.num_hidden_layers
    if any(sliding) and not window:
        raise UnsupportedModel(f"{model_type}: sliding layers without a sliding_window")
    return (int(window) if any(sliding) else None), sliding


def _ropes(hf, model_type: str, head_dim: int, family: Family) -> tuple[Rope, Rope | None]:
    """The global rope, and the sliding layers' own where the family has one (Gemma 3)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if family.local_rope:
        full, local = params.get("full_attention", {}), params.get("sliding_attention", {})
        return (_rope(full, model_type, head_dim, hf, 1_000_000.0), _rope(local, model_type, head_dim, hf, 10_000.0))
    if "full_attention" in params:  # per-layer-type parameters: equal ones are one rope
        ropes = {_rope(p, model_type, head_dim, hf, 10_000.0) for p in params.values()}
        if len(ropes) != 1:
            raise UnsupportedModel(f"{model_type}: a rope per layer type is supported for Gemma 3 only")
        return ropes.pop(), None
    return _rope(params, model_type, head_dim, hf, getattr(hf, "rope_theta", None) or 10_000.0), None


def _rope(params: dict, model_type: str, head_dim: int, hf, default_theta: float) -> Rope:
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "su":  # the early name of longrope (Phi-3 configs)
        kind = "longrope"
    if kind not in ROPE_KINDS:
        raise UnsupportedModel(f"{model_type}: rope scaling {kind!r} is not supported "
                               f"(specdec supports {', '.join(ROPE_KINDS)})")
    dim = int(head_dim * params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0) or 1.0))
    if dim % 2 or dim <= 0:
        raise UnsupportedModel(f"{model_type}: a rotary dimension of {dim} is not supported")
    kept = tuple(sorted((k, _frozen(v)) for k, v in params.items() if k in ROPE_KINDS[kind] and v is not None))
    if kind in ("yarn", "longrope", "llama3") and "original_max_position_embeddings" not in dict(kept):
        original = getattr(hf, "original_max_position_embeddings", None)
        if original is None:
            raise UnsupportedModel(f"{model_type}: rope scaling {kind!r} needs original_max_position_embeddings")
        kept = tuple(sorted(kept + (("original_max_position_embeddings", int(original)),)))
    theta = float(params.get("rope_theta", default_theta))
    return Rope(theta, dim, kind, kept, int(hf.max_position_embeddings))


def _with_freq_factors(ropes: tuple[Rope, Rope | None], hf, model_type: str) -> tuple[Rope, Rope | None]:
    """A converted GGUF file's per-frequency rope factors (``rope_freq_factors``, written by
    specdec's conversion from the file's ``rope_freqs`` tensor) on the global rope."""
    factors = getattr(hf, "rope_freq_factors", None)
    if not factors:
        return ropes
    rope = ropes[0]
    if rope.kind != "default" or len(factors) != rope.dim // 2:
        raise UnsupportedModel(f"{model_type}: {len(factors)} rope frequency factors on a {rope.kind!r} rope "
                               f"of {rope.dim} dimensions")
    return Rope(rope.theta, rope.dim, "freq_factors", (("factors", tuple(float(f) for f in factors)),),
                rope.max_positions), ropes[1]


def _frozen(value):
    return tuple(value) if isinstance(value, list) else value


def _context_length(hf, rope: Rope) -> int:
    """The positions specdec runs. LongRoPE switches every position to its long factors once a
    sequence passes ``original_max_position_embeddings`` (transformers re-rotates the whole
    sequence), which no KV cache can follow exactly: specdec runs the short factors, up to there."""
    if rope.kind == "longrope":
        return min(int(hf.max_position_embeddings), int(rope.param("original_max_position_embeddings")))
    return int(hf.max_position_embeddings)
