"""Inference-only decoder for the families of :mod:`specdec.runtime.config` (Llama 2/3, Mistral,
Qwen2/3, Phi-3, Gemma 2/3), branching only on the config's fields.

Written for decoding: the caller passes a block of ``T`` new tokens per row and a
:class:`~specdec.runtime.kv_cache.KVCache`; the block is written at each row's current length and
the cache advances by ``T``. Attention sees the row's committed slots plus the block: causally by
default, or as any ``tree_mask`` ``[B, T, T]`` over the block (for candidate trees), with
per-token rope positions. Logits can be restricted to some block positions.

Batch invariance: every linear is row-independent (see :mod:`specdec.runtime.linear`), and
attention is computed one query at a time over exactly its visible keys (see
:mod:`specdec.runtime.attention`), so a row's logits are bit-identical (int8, q4) whether it is
decoded alone, verified in a block, prefilled, or batched with other rows.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from specdec.runtime import attention, elementwise, stack
from specdec.runtime import rope as rotary
from specdec.runtime.config import ModelConfig, Rope
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.linear import LinearBuilder, activation_dtype, kv_dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    if not gemma and x.dtype == torch.float32 and weight.dtype == torch.float32:
        if elementwise.supported(x, x.shape[-1]) and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return elementwise.rms_norm(x.contiguous(), weight, eps)  # one call, fixed order, batch invariant
        return F.rms_norm(x, weight.shape, weight, eps)  # training (autograd): torch's fused op
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:  # Gemma multiplies in fp32 by (1 + w) before casting back
        return (out * (1.0 + weight.float())).to(x.dtype)
    return weight * out.to(x.dtype) if weight.dtype == x.dtype else (out * weight.float()).to(x.dtype)


def rope_tables(theta: float, head_dim: int, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and the signed ``sin`` tables ``[P, D]`` of :func:`apply_rope` for the default rope
    (``sin`` with its first half negated, so that rotating is ``x * cos + roll(x, D/2) * sin``)."""
    return rotary.tables(Rope(theta, head_dim), max_pos)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention as in transformers: ``x * cos + rotate_half(x) *
    sin`` with ``rotate_half(x) = [-x2, x1]``. Written as ``x * cos + [x2, x1] * sin_signed``
    (``sin`` from :func:`rope_tables`, first half negated): the same products, since
    ``(-a) * b == a * (-b)`` exactly, in 4 ops instead of 8. x ``[..., D]``; cos/sin broadcastable
    to it, e.g. x ``[B, T, H, D]`` with ``[B, T, 1, D]``. Partial rotary (cos/sin ``[..., R]``,
    R < D): the first R dimensions are rotated, the others pass unchanged."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], -1)
    xf = x.float()
    return (xf * cos + torch.roll(xf, rot // 2, -1) * sin).to(x.dtype)


class Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, weights, prefix: str, dtype: str, layer: int, linear: LinearBuilder):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        w = lambda name: weights[prefix + name]  # noqa: E731
        b = lambda name: weights[prefix + name] if (prefix + name) in weights else None  # noqa: E731

        def cat(*names):
            parts = [w(n) if n.endswith("weight") else b(n) for n in names]
            return None if any(p is None for p in parts) else torch.cat(parts)

        name = f"layers.{layer}."
        heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads, "v": cfg.num_kv_heads}
        inter = cfg.intermediate_size
        if cfg.fused_qkv:  # one stored weight each (Phi-3): q, k, v rows and gate, up rows, in that order
            qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
            self.qkv = linear(name + "qkv", lambda: w("self_attn.qkv_proj.weight"), lambda: b("self_attn.qkv_proj.bias"),
                              parts=((prefix + "self_attn.qkv_proj.weight", qkv_rows),))
            self.gate_up = linear(name + "gate_up", lambda: w("mlp.gate_up_proj.weight"),
                                  parts=((prefix + "mlp.gate_up_proj.weight", 2 * inter),))
        else:
            qkv = [f"self_attn.{p}_proj" for p in "qkv"]
            qkv_parts = tuple((prefix + f"self_attn.{p}_proj.weight", heads[p] * cfg.head_dim) for p in "qkv")
            self.qkv = linear(name + "qkv", lambda: cat(*(p + ".weight" for p in qkv)),
                              lambda: cat(*(p + ".bias" for p in qkv)), parts=qkv_parts)
            self.gate_up = linear(name + "gate_up", lambda: cat("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                                  parts=((prefix + "mlp.gate_proj.weight", inter), (prefix + "mlp.up_proj.weight", inter)))
        self.o = linear(name + "o", lambda: w("self_attn.o_proj.weight"), lambda: b("self_attn.o_proj.bias"),
                        parts=((prefix + "self_attn.o_proj.weight", cfg.hidden_size),))
        self.down = linear(name + "down", lambda: w("mlp.down_proj.weight"), parts=((prefix + "mlp.down_proj.weight", cfg.hidden_size),))
        act = activation_dtype(dtype)
        norm_dtype = torch.float32 if cfg.is_gemma else act
        self.norms = {name: w(name + ".weight").to(norm_dtype) for name in self._norm_names()}
        if cfg.qk_norm:
            self.q_norm = w("self_attn.q_norm.weight").to(norm_dtype)
            self.k_norm = w("self_attn.k_norm.weight").to(norm_dtype)
        self.sliding = cfg.layer_is_sliding[layer]
        # fp32 llama blocks run as seven kernel calls (_forward_fused); the others and bf16 op by op
        self.fused = (cfg.plain_llama and act == torch.float32 and cfg.hidden_size % elementwise.LANES == 0
                      and cfg.intermediate_size % elementwise.LANES == 0)
        self.scale = cfg.scale

    def _norm_names(self) -> list[str]:
        names = ["input_layernorm", "post_attention_layernorm"]
        if self.cfg.is_gemma:
            names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        return names

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norms[name], self.cfg.rms_norm_eps, self.cfg.is_gemma)

    def forward(self, x, cache: KVCache, slots, common_start, rope, visible) -> torch.Tensor:
        if self.fused:
            return self._forward_fused(x, cache, slots, rope["global"], visible["local" if self.sliding else "global"])
        return self._forward_ops(x, cache, slots, common_start, rope, visible)

    def _forward_fused(self, x, cache: KVCache, slots, rope, visible) -> torch.Tensor:
        """x ``[B, T, E]`` fp32 contiguous. The operations of :meth:`_forward_ops` (the same
        bits), with rope, the cache write and attention in one kernel call: a layer costs seven
        calls and little Python (the 0.5B draft's step is ~30% Python and small ops otherwise).
        The linears' ``forward`` is called directly: ``Module.__call__`` costs ~2 us a call, 0.2
        ms of the draft's 24-layer step (nothing here registers hooks; calibration wraps ``forward``)."""
        eps = self.cfg.rms_norm_eps
        keys, values = cache.layer(self.layer)  # [B, Hkv, capacity, D], written in place
        qkv = self.qkv.forward(elementwise.rms_norm(x, self.norms["input_layernorm"], eps))  # [B, T, (Hq + 2 Hkv) D]
        attn = attention.attend_block(qkv, *rope, keys, values, slots, visible, self.scale, self.cfg.num_heads)  # [B, T, Hq D]
        x = x + self.o.forward(attn)
        h = elementwise.rms_norm(x, self.norms["post_attention_layernorm"], eps)
        return x + self.down.forward(elementwise.silu_mul(self.gate_up.forward(h)))  # gate_up [B, T, 2I]

    def _forward_ops(self, x, cache: KVCache, slots, common_start, rope, visible) -> torch.Tensor:
        """Op by op: q/k norms, partial rotary, softcapping, Gemma's norms, and bf16 activations;
        for fp32 llama blocks the reference the fused path is tested against."""
        cfg = self.cfg
        bsz, t, _ = x.shape
        qkv = self.qkv(self._norm("input_layernorm", x))  # [B, T, (Hq + 2 Hkv) D]; every linear returns the activation dtype
        q, k, v = self._rotated_qkv(qkv, rope["local" if self.sliding else "global"])
        cache.write(self.layer, k.transpose(1, 2), v.transpose(1, 2), slots, common_start)  # cast on copy
        keys, values = cache.layer(self.layer)  # [B, Hkv, capacity, D]
        attn = attention.attend(q, keys, values, visible["local" if self.sliding else "global"], self.scale,
                                cfg.attn_logit_softcapping)  # [B, T, Hq, D]
        out = self.o(attn.reshape(bsz, t, cfg.num_heads * cfg.head_dim))
        if cfg.is_gemma:  # sandwich norms around each sublayer
            x = x + self._norm("post_attention_layernorm", out)
            h = self._norm("pre_feedforward_layernorm", x)
        else:
            x = x + out
            h = self._norm("post_attention_layernorm", x)
        gate_up = self.gate_up(h)  # [B, T, 2I]: gate, then up
        if not cfg.is_gemma and gate_up.is_contiguous() and elementwise.supported(gate_up, gate_up.shape[-1]):
            mlp = self.down(elementwise.silu_mul(gate_up))  # one call (fixed-order fp32, batch invariant)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if cfg.is_gemma else F.silu(gate)
            mlp = self.down(act * up)
        if cfg.is_gemma:
            mlp = self._norm("post_feedforward_layernorm", mlp)
        return x + mlp

    def _rotated_qkv(self, qkv: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv`` ``[B, T, (Hq + 2 Hkv) D]`` -> q ``[B, T, Hq, D]``, k and v ``[B, T, Hkv, D]``: q and
        k normalised per head where the family does (Qwen3, Gemma 3), then rotated."""
        cfg = self.cfg
        bsz, t, _ = qkv.shape
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        heads = cfg.num_heads + cfg.num_kv_heads
        cos, sin = rope  # [B, T, 1, R]
        v = qkv[..., q_size + kv_size :].view(bsz, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # q and k normalised separately, then rotated
            q = rms_norm(qkv[..., :q_size].view(bsz, t, cfg.num_heads, cfg.head_dim), self.q_norm, cfg.rms_norm_eps,
                         cfg.is_gemma)
            k = rms_norm(qkv[..., q_size : q_size + kv_size].view(bsz, t, cfg.num_kv_heads, cfg.head_dim),
                         self.k_norm, cfg.rms_norm_eps, cfg.is_gemma)
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
        if qkv.dtype == torch.float32 and qkv.stride(-1) == 1 and cfg.rope.dim == cfg.head_dim:
            qk = elementwise.rope(qkv, cos, sin, heads)  # [B, T, Hq+Hkv, D]: apply_rope's operations, the same bits
        else:
            qk = apply_rope(qkv[..., : q_size + kv_size].view(bsz, t, heads, cfg.head_dim), cos, sin)
        return qk[:, :, : cfg.num_heads], qk[:, :, cfg.num_heads :], v


class Transformer(torch.nn.Module):
    """Decoder-only LM over a :class:`KVCache`. Build with :meth:`from_weights`."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: str = "float32",
        act_absmax: dict[str, torch.Tensor] | None = None,
        quantized: dict[str, torch.Tensor] | None = None,
        grids=None,
        embed=None,
    ) -> None:
        """``weights``: a mapping of Hugging Face parameter names (read lazily where possible).
        ``act_absmax``: per-linear calibrated max |input| per channel (int8 outlier smoothing),
        keyed ``layers.{i}.{qkv,o,gate_up,down}`` and ``lm_head``; see :mod:`specdec.runtime.linear`.
        ``quantized``: int8 layers from the on-disk cache (``self.quantized_state`` of an earlier build).
        ``grids``: q4k only, the exact 4-bit grids of the source file's tensors by parameter name
        (``.get(name)``), used where they reproduce the weights; gguf: the GGUF file itself
        (:class:`specdec.models.gguf_file.GGUFFile`), whose matrices are used as stored.
        ``embed``: the embedding table where it is not ``weights``' fp32 tensor (a GGUF file's
        rows, dequantized as they are looked up: :class:`specdec.models.gguf_file.RowEmbedding`)."""
        super().__init__()
        if cfg.head_dim % attention.LANES:
            raise ValueError(f"head_dim {cfg.head_dim} is not a multiple of {attention.LANES}, which the attention kernel needs")
        attention.kernel()  # built now (once per machine), so their compile time is load time, not a request's
        elementwise.kernel()
        linear = LinearBuilder(dtype, act_absmax, quantized, grids)
        self.cfg, self.dtype_name = cfg, dtype
        self.act_dtype = activation_dtype(dtype)
        embed = weights["model.embed_tokens.weight"] if embed is None else embed
        self.embed = embed.to(self.act_dtype)  # [V, E]: embed[tokens] -> [B, T, E]
        self.embed_scale = math.sqrt(cfg.hidden_size) if cfg.is_gemma else None
        self.blocks = torch.nn.ModuleList(
            Block(cfg, weights, f"model.layers.{i}.", dtype, i, linear) for i in range(cfg.num_layers)
        )
        norm_dtype = torch.float32 if cfg.is_gemma else self.act_dtype
        self.final_norm = weights["model.norm.weight"].to(norm_dtype)
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings or "lm_head.weight" not in weights else "lm_head.weight"
        self.lm_head = linear("lm_head", lambda: weights[head], parts=((head, cfg.vocab_size),))
        self.quantized_state = linear.exported  # int8 tensors built from fp32 here (empty otherwise)
        linear.pack_all()
        self.stack = self._build_stack(self.blocks)
        self.use_stack = True  # tests and measurements compare it with the per-layer loop
        self._rope_len = 0
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def truncated(self, num_layers: int) -> "Transformer":
        """A view running only the first ``num_layers`` blocks, then the final norm and head:
        an early-exit self-draft that shares every weight with this model (no extra memory)."""
        if not 1 <= num_layers <= self.cfg.num_layers:
            raise ValueError(f"early exit needs 1 <= layers <= {self.cfg.num_layers}, got {num_layers}")
        view = object.__new__(Transformer)
        view.__dict__ = dict(self.__dict__)
        view._modules = dict(self._modules)
        view._modules["blocks"] = torch.nn.ModuleList(list(self.blocks)[:num_layers])
        sliding = self.cfg.layer_is_sliding[:num_layers]
        view.cfg = dataclasses.replace(self.cfg, num_layers=num_layers, layer_is_sliding=sliding)
        view.stack = view._build_stack(view.blocks) if self.stack is not None else None
        return view

    def _build_stack(self, blocks):
        """The layers as one C++ call (:mod:`specdec.runtime.stack`) where they allow it, else None."""
        if not stack.eligible(blocks) or len({block.sliding for block in blocks}) != 1:  # one visibility per call
            return None
        return stack.build(blocks, self.cfg.rms_norm_eps, blocks[0].scale, self.cfg.num_heads)

    def with_output_rows(self, rows: torch.Tensor) -> "Transformer":
        """A view whose output layer computes logits for only some token ids: ``rows`` ``[N, E]``
        are those ids' rows of the output matrix (fp32), in the order the logits should come.
        Every other weight is shared (FR-Spec: a draft that only ever proposes frequent tokens
        skips most of its largest matmul)."""
        if rows.dim() != 2 or rows.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"rows must be [N, {self.cfg.hidden_size}], got {tuple(rows.shape)}")
        view = object.__new__(Transformer)
        view.__dict__ = dict(self.__dict__)
        view._modules = dict(self._modules)
        linear = LinearBuilder(self.dtype_name)
        view._modules["lm_head"] = linear("lm_head", lambda: rows)
        linear.pack_all()
        return view

    def linear_layers(self) -> dict[str, torch.nn.Module]:
        """Every linear layer by its calibration name."""
        out = {"lm_head": self.lm_head}
        for i, block in enumerate(self.blocks):
            for name in ("qkv", "o", "gate_up", "down"):
                out[f"layers.{i}.{name}"] = getattr(block, name)
        return out

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        cfg = self.cfg
        return KVCache(cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, capacity, kv_dtype(self.dtype_name))

    def _rope_for(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        need = int(positions.max()) + 1
        if need > self._rope_len:
            size = max(need, 2 * self._rope_len, 256)
            self._rope = {"global": rotary.tables(self.cfg.rope, size)}
            if self.cfg.rope_local is not None:
                self._rope["local"] = rotary.tables(self.cfg.rope_local, size)
            self._rope_len = size
        out = {}
        for name, (cos, sin) in self._rope.items():
            out[name] = (cos[positions].unsqueeze(2), sin[positions].unsqueeze(2))  # [B, T, 1, R], R the rotary dims
        if "local" not in out:
            out["local"] = out["global"]
        return out

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, **options) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append ``tokens`` ``[B, T]`` to ``cache`` and return logits ``[B, T', V]`` (fp32); the
        ``options`` are :meth:`forward_embeds`'s."""
        if tokens.shape[1] == 0:
            raise ValueError("forward needs at least one token")
        x = self.embed[tokens]  # [B, T, E]
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return self.forward_embeds(x, cache, **options)

    @torch.inference_mode()
    def forward_embeds(
        self,
        x: torch.Tensor,
        cache: KVCache,
        *,
        tree_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        logit_index: torch.Tensor | None = None,
        return_hidden: bool = False,
        tree_base: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append input vectors ``x`` ``[B, T, E]`` (embedded tokens, or a draft head's projected
        features) to ``cache`` and return logits ``[B, T', V]`` (fp32).

        tree_mask: ``[B, T, T]`` bool, which block tokens each block token may attend to
            (default: causal). Committed slots are always visible.
        positions: ``[B, T]`` rope positions (default: the slots, i.e. a linear chain).
        logit_index: ``[B, T']`` block indices to compute logits for (default: all T).
        return_hidden: also return the last block's output (before the final norm) at every block
            position, ``[B, T, E]`` — the features a draft head reads; it is computed anyway.
        tree_base: ``[B]`` with ``tree_mask``: the first cache slot of a tree grown over several
            calls (a draft head expanding a candidate tree depth by depth). Slots before it are
            always visible; ``tree_mask`` is then ``[B, T, (lengths - tree_base) + T]`` and covers
            the earlier tree slots too. Default: the cache length (the tree is this block).
        """
        bsz, t, _ = x.shape
        if bsz != cache.batch:
            raise ValueError(f"tokens have batch {bsz} but the cache has {cache.batch}")
        if t == 0:
            raise ValueError("forward needs at least one token")
        slots = cache.block_slots(t)  # [B, T]
        positions = slots if positions is None else positions
        start = cache.lengths  # [B]
        if int(positions.max()) >= self.cfg.max_position_embeddings:
            raise ValueError(
                f"position {int(positions.max())} is beyond the model's context length {self.cfg.max_position_embeddings}"
            )
        visible = self._per_query_visibility(start, positions, tree_mask, t, tree_base)
        rope = self._rope_for(positions)
        common_start = None if self.blocks[0].fused else cache.common_start(slots)  # a host sync; fused blocks need none
        x = x.contiguous()
        if self.stack is not None and self.use_stack and self.blocks[0].fused:
            # every layer in one call: Block._forward_fused's kernels, the same bits
            vis = visible["local" if self.blocks[0].sliding else "global"]  # (a stack's blocks share it)
            n = len(self.blocks)
            x = self.stack.forward(x, cache.k[:n], cache.v[:n], *rope["global"], slots, vis.lo, vis.hi, vis.extra_ptr,
                                   vis.extra)
        else:
            for block in self.blocks:
                x = block.forward(x, cache, slots, common_start, rope, visible)  # (see Block._forward_fused)
        cache.advance(t)
        hidden = x  # [B, T, E]: the last block's output
        if logit_index is not None:
            x = x.gather(1, logit_index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        x = rms_norm(x, self.final_norm, self.cfg.rms_norm_eps, self.cfg.is_gemma)
        logits = self.lm_head(x).float()  # [B, T', V]
        if self.cfg.final_logit_softcapping:
            cap = self.cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return (logits, hidden) if return_hidden else logits

    def _per_query_visibility(self, start, positions, tree_mask, t, tree_base=None) -> dict[str, attention.Visibility]:
        """Each query's visible slots, for "global" and "local" (sliding-window) layers."""
        window = self.cfg.sliding_window
        if tree_mask is None:
            out = {"global": attention.chain(start, t)}
            out["local"] = attention.chain(start, t, window, positions) if window else out["global"]
            return out
        base = start if tree_base is None else tree_base  # [B] first slot of the tree region
        extra = tree_mask.shape[2] - t
        if tree_mask.shape[:2] != (start.shape[0], t) or bool((start - base != extra).any()):
            raise ValueError(
                f"tree_mask must be [B, T, (lengths - tree_base) + T]; got {tuple(tree_mask.shape)} for T={t}, "
                f"lengths {start.tolist()}, tree_base {base.tolist()}"
            )
        if window and extra:
            raise ValueError("a tree region before the block (tree_base) is not supported with sliding-window attention")
        out = {"global": attention.tree(base, tree_mask)}
        out["local"] = attention.tree(base, tree_mask, positions, window) if window else out["global"]
        return out
