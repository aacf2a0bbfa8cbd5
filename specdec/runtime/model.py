"""Inference-only transformer for the llama family (Llama, Qwen2, SmolLM2) and Gemma 3.

Written for decoding: the caller passes a block of ``T`` new tokens per row and a
:class:`~specdec.runtime.kv_cache.KVCache`; the block is written at each row's current length and
the cache advances by ``T``. Attention sees the row's committed slots plus the block, through an
explicit boolean mask: causal by default, or any ``tree_mask`` ``[B, T, T]`` over the block (for
candidate trees), with per-token rope positions. Logits can be restricted to some block positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specdec.runtime.config import ModelConfig
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.linear import activation_dtype, make_linear


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:  # Gemma multiplies in fp32 by (1 + w) before casting back
        return (out * (1.0 + weight.float())).to(x.dtype)
    return weight * out.to(x.dtype) if weight.dtype == x.dtype else (out * weight.float()).to(x.dtype)


def _rope_tables(theta: float, head_dim: int, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)  # [P, D/2]
    emb = torch.cat([freqs, freqs], -1)  # [P, D]
    return emb.cos(), emb.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, H, T, D]``; cos/sin ``[B, 1, T, D]`` (rotate-half convention, as in transformers)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


# Blocks of at most this many tokens (decode steps, verification of k+1 <= 16 positions) use
# per-query attention, which is bit-exact across block shapes; longer ones (prefill) one batched call.
PER_QUERY_MAX_BLOCK = 16


class Block(torch.nn.Module):
    def __init__(self, cfg, weights, prefix: str, dtype: str, layer: int, act_absmax: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        stat = lambda name: act_absmax.get(f"layers.{layer}.{name}")  # noqa: E731
        w = lambda name: weights[prefix + name]  # noqa: E731
        b = lambda name: weights.get(prefix + name)  # noqa: E731
        qkv_w = torch.cat([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")])
        qkv_b = None
        if b("self_attn.q_proj.bias") is not None:
            qkv_b = torch.cat([b("self_attn.q_proj.bias"), b("self_attn.k_proj.bias"), b("self_attn.v_proj.bias")])
        self.qkv = make_linear(qkv_w, qkv_b, dtype, stat("qkv"))
        self.o = make_linear(w("self_attn.o_proj.weight"), b("self_attn.o_proj.bias"), dtype, stat("o"))
        gate_up_w = torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")])
        self.gate_up = make_linear(gate_up_w, None, dtype, stat("gate_up"))
        self.down = make_linear(w("mlp.down_proj.weight"), None, dtype, stat("down"))
        act = activation_dtype(dtype)
        norm_dtype = torch.float32 if cfg.is_gemma else act
        self.norms = {name: w(name + ".weight").to(norm_dtype) for name in self._norm_names()}
        if cfg.is_gemma:
            self.q_norm = w("self_attn.q_norm.weight").float()
            self.k_norm = w("self_attn.k_norm.weight").float()
        self.sliding = cfg.is_gemma and cfg.layer_is_sliding[layer]

    def _attend_per_query(self, q: torch.Tensor, cache: KVCache, visible, scale: float) -> torch.Tensor:
        """Attention one query at a time over exactly its visible keys.

        Every query row then goes through the same kernel call shape (1 query, S = its visible
        keys) whether it is decoded alone, verified inside a block of k+1, or batched with other
        rows, which makes the result bit-identical across those cases (a batched kernel may sum in
        a different order depending on the block's shape).
        """
        bsz, heads, t, dim = q.shape
        out = q.new_empty(bsz, heads, t, dim)
        k_all, v_all = cache.k[self.layer], cache.v[self.layer]  # [B, Hkv, capacity, D]
        for b in range(bsz):
            for i in range(t):
                sel = visible[b][i]  # (lo, hi) slot range or an index tensor
                if isinstance(sel, tuple):
                    keys, values = k_all[b : b + 1, :, sel[0] : sel[1]], v_all[b : b + 1, :, sel[0] : sel[1]]
                else:
                    keys, values = k_all[b : b + 1, :, sel], v_all[b : b + 1, :, sel]
                out[b : b + 1, :, i : i + 1] = F.scaled_dot_product_attention(
                    q[b : b + 1, :, i : i + 1], keys.to(q.dtype), values.to(q.dtype), scale=scale, enable_gqa=True
                )
        return out

    def _norm_names(self) -> list[str]:
        names = ["input_layernorm", "post_attention_layernorm"]
        if self.cfg.is_gemma:
            names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        return names

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.norms[name], self.cfg.rms_norm_eps, self.cfg.is_gemma)

    def forward(self, x, cache: KVCache, slots, num_slots, rope, masks) -> torch.Tensor:
        cfg = self.cfg
        bsz, t, _ = x.shape
        h = self._norm("input_layernorm", x)
        qkv = self.qkv(h).to(x.dtype)  # [B, T, (Hq + 2 Hkv) D]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q = qkv[..., :q_size].view(bsz, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = qkv[..., q_size : q_size + kv_size].view(bsz, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = qkv[..., q_size + kv_size :].view(bsz, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        if cfg.is_gemma:
            q = _rms_norm(q, self.q_norm, cfg.rms_norm_eps, True)
            k = _rms_norm(k, self.k_norm, cfg.rms_norm_eps, True)
        cos, sin = rope["local" if self.sliding else "global"]
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        cache.write(self.layer, k.to(cache.k.dtype), v.to(cache.v.dtype), slots)
        scale = cfg.query_pre_attn_scalar**-0.5 if cfg.is_gemma else 1.0 / math.sqrt(cfg.head_dim)
        kind = "local" if self.sliding else "global"
        if masks["per_query"] is not None:
            attn = self._attend_per_query(q, cache, masks["per_query"][kind], scale)
        else:
            keys, values = cache.view(self.layer, num_slots)  # [B, Hkv, S, D]
            attn = F.scaled_dot_product_attention(
                q, keys.to(q.dtype), values.to(q.dtype), attn_mask=masks[kind], scale=scale, enable_gqa=True
            )  # [B, Hq, T, D]
        attn = attn.transpose(1, 2).reshape(bsz, t, q_size)
        out = self.o(attn).to(x.dtype)
        if cfg.is_gemma:
            out = self._norm("post_attention_layernorm", out)
            x = x + out
            h = self._norm("pre_feedforward_layernorm", x)
        else:
            x = x + out
            h = self._norm("post_attention_layernorm", x)
        gate, up = self.gate_up(h).to(x.dtype).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if cfg.is_gemma else F.silu(gate)
        mlp = self.down(act * up).to(x.dtype)
        if cfg.is_gemma:
            mlp = self._norm("post_feedforward_layernorm", mlp)
        return x + mlp


class Transformer(torch.nn.Module):
    """Decoder-only LM over a :class:`KVCache`. Build with :meth:`from_weights`."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: str = "float32",
        act_absmax: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``act_absmax``: per-linear calibrated max |input| per channel (int8 outlier smoothing),
        keyed ``layers.{i}.{qkv,o,gate_up,down}`` and ``lm_head``; see :mod:`specdec.runtime.linear`."""
        super().__init__()
        act_absmax = act_absmax or {}
        self.cfg, self.dtype_name = cfg, dtype
        self.act_dtype = activation_dtype(dtype)
        self.embed = weights["model.embed_tokens.weight"].to(self.act_dtype)  # [V, E]
        self.embed_scale = math.sqrt(cfg.hidden_size) if cfg.is_gemma else None
        self.blocks = torch.nn.ModuleList(
            Block(cfg, weights, f"model.layers.{i}.", dtype, i, act_absmax) for i in range(cfg.num_layers)
        )
        norm_dtype = torch.float32 if cfg.is_gemma else self.act_dtype
        self.final_norm = weights["model.norm.weight"].to(norm_dtype)
        head = weights.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = weights["model.embed_tokens.weight"]
        self.lm_head = make_linear(head, None, dtype, act_absmax.get("lm_head"))
        self._rope_len = 0
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

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
        return KVCache(cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, capacity, self.act_dtype)

    def _rope_for(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        need = int(positions.max()) + 1
        if need > self._rope_len:
            size = max(need, 2 * self._rope_len, 256)
            self._rope = {"global": _rope_tables(self.cfg.rope_theta, self.cfg.head_dim, size)}
            if self.cfg.is_gemma:
                self._rope["local"] = _rope_tables(self.cfg.rope_local_theta, self.cfg.head_dim, size)
            self._rope_len = size
        out = {}
        for name, (cos, sin) in self._rope.items():
            out[name] = (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))  # [B, 1, T, D]
        if "local" not in out:
            out["local"] = out["global"]
        return out

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        *,
        tree_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        logit_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``tokens`` ``[B, T]`` to ``cache`` and return logits ``[B, T', V]`` (fp32).

        tree_mask: ``[B, T, T]`` bool, which block tokens each block token may attend to
            (default: causal). Committed slots are always visible.
        positions: ``[B, T]`` rope positions (default: the slots, i.e. a linear chain).
        logit_index: ``[B, T']`` block indices to compute logits for (default: all T).
        """
        bsz, t = tokens.shape
        if bsz != cache.batch:
            raise ValueError(f"tokens have batch {bsz} but the cache has {cache.batch}")
        if t == 0:
            raise ValueError("forward needs at least one token")
        slots = cache.block_slots(t)  # [B, T]
        positions = slots if positions is None else positions
        start = cache.lengths  # [B]
        num_slots = int(slots.max()) + 1
        if int(positions.max()) >= self.cfg.max_position_embeddings:
            raise ValueError(
                f"position {int(positions.max())} is beyond the model's context length {self.cfg.max_position_embeddings}"
            )
        masks = self._masks(start, slots, positions, num_slots, tree_mask)
        x = self.embed[tokens]  # [B, T, E]
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rope = self._rope_for(positions)
        for block in self.blocks:
            x = block(x, cache, slots, num_slots, rope, masks)
        cache.advance(t)
        if logit_index is not None:
            x = x.gather(1, logit_index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        x = _rms_norm(x, self.final_norm, self.cfg.rms_norm_eps, self.cfg.is_gemma)
        logits = self.lm_head(x).float()  # [B, T', V]
        if self.cfg.final_logit_softcapping:
            cap = self.cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _masks(self, start, slots, positions, num_slots, tree_mask) -> dict:
        bsz, t = slots.shape
        if t <= PER_QUERY_MAX_BLOCK:
            return {"per_query": self._per_query_visibility(start, positions, tree_mask, t)}
        key_slot = torch.arange(num_slots).view(1, 1, num_slots)  # [1, 1, S]
        in_prefix = key_slot < start.view(bsz, 1, 1)  # [B, 1, S]
        offset = key_slot - start.view(bsz, 1, 1)  # [B, 1, S] index into the block
        in_block = (offset >= 0) & (offset < t)
        if tree_mask is None:
            block_ok = offset <= torch.arange(t).view(1, t, 1)  # causal within the block, [B, T, S]
        else:
            idx = offset.clamp(0, t - 1).expand(bsz, t, num_slots)
            block_ok = tree_mask.gather(2, idx)
        visible = in_prefix | (in_block & block_ok)  # [B, T, S]
        masks = {"global": visible.unsqueeze(1)}
        if self.cfg.is_gemma and self.cfg.sliding_window:
            key_pos = key_slot.expand(bsz, 1, num_slots).clone()  # prefix slots hold their own positions
            block_pos = positions.unsqueeze(1)  # [B, 1, T]
            key_pos = torch.where(in_block, block_pos.gather(2, offset.clamp(0, t - 1)), key_pos)
            near = positions.unsqueeze(2) - key_pos < self.cfg.sliding_window  # [B, T, S]
            masks["local"] = (visible & near).unsqueeze(1)
        else:
            masks["local"] = masks["global"]
        masks["per_query"] = None
        return masks

    def _per_query_visibility(self, start, positions, tree_mask, t) -> dict:
        """For each (row, block index): the visible slots, as a contiguous (lo, hi) range for
        chains or an index tensor for trees; "local" also applies Gemma's sliding window."""
        window = self.cfg.sliding_window if self.cfg.is_gemma else None
        out: dict[str, list] = {"global": [], "local": []}
        for b in range(start.shape[0]):
            s0 = int(start[b])
            row_g, row_l = [], []
            for i in range(t):
                if tree_mask is None:
                    row_g.append((0, s0 + i + 1))
                    if window:
                        row_l.append((max(0, int(positions[b, i]) - window + 1), s0 + i + 1))
                else:
                    block = torch.nonzero(tree_mask[b, i]).flatten() + s0
                    idx = torch.cat([torch.arange(s0), block])
                    row_g.append(idx)
                    if window:
                        key_pos = torch.cat([torch.arange(s0), positions[b, block - s0]])
                        row_l.append(idx[int(positions[b, i]) - key_pos < window])
            out["global"].append(row_g)
            out["local"].append(row_l if window else row_g)
        return out
