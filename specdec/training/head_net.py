"""The trainable draft head (fp32, autograd): the same function as the runtime's
:class:`specdec.runtime.head.DraftHead` (see that module for what it computes), written so that
one forward gives every draft step's output at every slot (training-time test)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specdec.runtime.head import LAYER, LINEARS, HeadConfig
from specdec.runtime.model import apply_rope, rms_norm, rope_tables


class HeadNet(torch.nn.Module):
    """The trainable head (fp32, autograd). Frozen parts are the target's: ``embed`` [V, E],
    ``final_norm`` [E] and ``lm_rows`` [N, E] (its output rows for the subset ``vocab_ids``)."""

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor, embed: torch.Tensor, final_norm: torch.Tensor,
                 lm_rows: torch.Tensor, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        e, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        g = torch.Generator().manual_seed(seed)
        init = lambda *shape: torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.02)  # noqa: E731
        self.fc = init(e, 2 * e)
        self.linears = torch.nn.ParameterDict({n.replace(".", "_"): init(*shape(e, q, kv, i)) for n, shape in LINEARS.items()})
        self.biases = torch.nn.ParameterDict(
            {p: torch.nn.Parameter(torch.zeros(n)) for p, n in (("q", q), ("k", kv), ("v", kv))} if cfg.attention_bias else {}
        )
        self.norm_feature = torch.nn.Parameter(torch.ones(e))
        self.norm_embed = torch.nn.Parameter(torch.ones(e))
        self.norm_in = torch.nn.Parameter(torch.ones(e))
        self.norm_post = torch.nn.Parameter(torch.ones(e))
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=False)
        self.embed, self.final_norm, self.lm_rows = embed, final_norm.float(), lm_rows.float()
        self._rope = rope_tables(cfg.rope_theta, cfg.head_dim, 4096)

    def set_vocab(self, vocab_ids: torch.Tensor, lm_rows: torch.Tensor) -> None:
        """Draft another subset of ids (``lm_rows`` [N, E]: the target's rows for ``vocab_ids``).
        Nothing trained depends on the subset: the layer's output is scored by the target's own rows."""
        self.vocab_ids, self.lm_rows = vocab_ids.long(), lm_rows.float()

    # -- the state the runtime reads -------------------------------------------------------------
    def export(self) -> dict[str, torch.Tensor]:
        """HF-style tensors of the trainable part (what :func:`save_head` writes)."""
        out = {"fc.weight": self.fc.detach().clone(),
               "feature_norm.weight": self.norm_feature.detach().clone(),
               "embed_norm.weight": self.norm_embed.detach().clone(),
               LAYER + "input_layernorm.weight": self.norm_in.detach().clone(),
               LAYER + "post_attention_layernorm.weight": self.norm_post.detach().clone()}
        for name in LINEARS:
            out[LAYER + name + ".weight"] = self.linears[name.replace(".", "_")].detach().clone()
        for p, b in self.biases.items():
            out[LAYER + f"self_attn.{p}_proj.bias"] = b.detach().clone()
        return out

    def load_export(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.fc.copy_(state["fc.weight"])
            self.norm_feature.copy_(state["feature_norm.weight"])
            self.norm_embed.copy_(state["embed_norm.weight"])
            self.norm_in.copy_(state[LAYER + "input_layernorm.weight"])
            self.norm_post.copy_(state[LAYER + "post_attention_layernorm.weight"])
            for name in LINEARS:
                self.linears[name.replace(".", "_")].copy_(state[LAYER + name + ".weight"])
            for p, b in self.biases.items():
                b.copy_(state[LAYER + f"self_attn.{p}_proj.bias"])

    # -- forward ---------------------------------------------------------------------------------
    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's final norm of its features ``[..., E]`` (what its output layer reads)."""
        return rms_norm(hidden.float(), self.final_norm, self.cfg.rms_norm_eps, False)

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's own logits over the subset from its features ``[..., E]`` -> ``[..., N]``."""
        return F.linear(self.normed(hidden), self.lm_rows)

    def fc_input(self, feats: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        return torch.cat([rms_norm(feats, self.norm_feature, eps, False), rms_norm(emb, self.norm_embed, eps, False)], -1)

    def _proj(self, x: torch.Tensor, name: str, bias: str | None = None) -> torch.Tensor:
        b = self.biases[bias] if bias is not None and bias in self.biases else None
        return F.linear(x, self.linears[name.replace(".", "_")], b)

    def passes(self, hidden: torch.Tensor, tokens: torch.Tensor, num_passes: int) -> list[torch.Tensor]:
        """Outputs ``f`` ``[B, L, E]`` of draft steps 1..``num_passes`` at every slot, as drafting
        would produce them with teacher-forced tokens.

        Pass 1 at slot i reads ``(h_i, x_{i+1})`` and attends to pass 1 at slots <= i: the first
        draft after a committed prefix. Pass m reads ``(f^{m-1}_{i-1}, x_{i+1})`` — the previous
        step's guess at the slot before — and attends to what the cache holds at that draft step:
        true pairs (pass 1) at slots <= i-m+1 and passes 2..m at slots i-m+2..i (the key of slot
        j = i-d from pass m-d). Pass m is only meaningful at slots i >= m-1 (zeros before).
        Computed as the drafting chain from every slot (:meth:`chains`).
        """
        bsz, length = hidden.shape[:2]
        anchors = torch.arange(length).expand(bsz, length)  # the chain from every slot
        outs = self.chains(hidden, tokens, anchors, num_passes)  # step m of chain a sits at slot a+m-1
        shift = [min(m, length) for m in range(num_passes)]  # pass m+1 of slot i: chain i-m
        return [torch.cat([out.new_zeros(bsz, d, out.shape[-1]), out[:, : length - d]], 1) for d, out in zip(shift, outs)]

    def chains(self, hidden: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
               num_passes: int) -> list[torch.Tensor]:
        """Outputs ``[B, n, E]`` of draft steps 1..``num_passes`` along the drafting chains that
        start at slots ``anchors`` ``[B, n]`` (-1: no chain), as drafting computes them with
        teacher-forced tokens: step m of the chain from anchor a sits at slot s = a+m-1 and equals
        :meth:`passes`'s pass m there (tests/test_head.py checks chains from some slots against those from every slot, and the
        runtime head against :meth:`passes`).

        Why it is the same function: pass m at slot s reads the previous pass's output at s-1 (the
        chain's step m-1) and the token after s, and attends to pass-1 keys at slots <= s-m+1 = a
        and to the keys of passes m, m-1, .., 2 at slots s, s-1, .., a+1 — the chain's own steps.
        So a chain needs, outside itself, only pass 1's keys and values at slots <= a, which come
        from the layer's input projection alone (``fc``, then k/v). Every slot pays that (~6M of
        the layer's ~29M multiply-adds); the rest (queries, attention output, MLP, the output rows)
        is paid only along the chains: training on a fraction of the slots' chains costs about
        that fraction of the layer, with the same expected loss.
        """
        cfg = self.cfg
        bsz, length = hidden.shape[:2]
        e, hd, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads
        rep = cfg.num_heads // kvh
        n = anchors.shape[1]
        a = anchors.clamp(min=0)  # [B, n]
        emb = self.embed[tokens.clamp(min=0)[:, 1:]].float()  # [B, L-1, E] the token after each slot
        emb = torch.cat([emb, emb.new_zeros(bsz, 1, e)], 1)  # [B, L, E]
        cos, sin = (t[:length] for t in self._rope)  # [L, D]
        at = lambda t, idx: t.gather(1, idx.unsqueeze(-1).expand(-1, -1, t.shape[-1]))  # noqa: E731  [B, n, C]

        # pass 1's keys and values at every slot: what every chain attends to
        x = F.linear(self.fc_input(hidden.float(), emb), self.fc)  # [B, L, E]
        h = rms_norm(x, self.norm_in, cfg.rms_norm_eps, False)
        prefix_k = self._proj(h, "self_attn.k_proj", "k").view(bsz, length, kvh, hd).transpose(1, 2)  # [B, kvh, L, D]
        prefix_k = apply_rope(prefix_k, cos.view(1, 1, length, -1), sin.view(1, 1, length, -1))
        prefix_v = self._proj(h, "self_attn.v_proj", "v").view(bsz, length, kvh, hd).transpose(1, 2)
        allowed = torch.arange(length).view(1, 1, length) <= a.unsqueeze(-1)  # [B, n, L] slots <= anchor
        allowed = allowed.view(bsz, 1, 1, n, length)

        chain_k, chain_v, outs = [], [], []
        for m in range(1, num_passes + 1):
            s = (a + m - 1).clamp(max=length - 1)  # [B, n] the step's slot (clamped past the end: not trained)
            if m == 1:
                x_m, h_m = at(x, s), at(h, s)  # [B, n, E]
            else:
                x_m = F.linear(self.fc_input(outs[-1], at(emb, s)), self.fc)  # [B, n, E]
                h_m = rms_norm(x_m, self.norm_in, cfg.rms_norm_eps, False)
            cos_s, sin_s = cos[s].unsqueeze(2), sin[s].unsqueeze(2)  # [B, n, 1, D]
            q = apply_rope(self._proj(h_m, "self_attn.q_proj", "q").view(bsz, n, kvh * rep, hd), cos_s, sin_s)
            q = q.view(bsz, n, kvh, rep, hd).permute(0, 2, 3, 1, 4)  # [B, kvh, rep, n, D], head = kv * rep + r
            if m > 1:  # this step's own key: pass 1's is among the prefix's
                k = apply_rope(self._proj(h_m, "self_attn.k_proj", "k").view(bsz, n, kvh, hd), cos_s, sin_s)
                chain_k.append(k.permute(0, 2, 1, 3).unsqueeze(2))  # [B, kvh, 1, n, D]
                chain_v.append(self._proj(h_m, "self_attn.v_proj", "v").view(bsz, n, kvh, hd).permute(0, 2, 1, 3).unsqueeze(2))
            attn = self._attend_chain(q, prefix_k, prefix_v, allowed, chain_k, chain_v)  # [B, kvh, rep, n, D]
            attn = attn.permute(0, 3, 1, 2, 4).reshape(bsz, n, -1)  # [B, n, Hq D], head = kv * rep + r
            x_m = x_m + self._proj(attn, "self_attn.o_proj")
            h_m = rms_norm(x_m, self.norm_post, cfg.rms_norm_eps, False)
            outs.append(x_m + self._proj(F.silu(self._proj(h_m, "mlp.gate_proj")) * self._proj(h_m, "mlp.up_proj"), "mlp.down_proj"))
        return outs

    @staticmethod
    def _attend_chain(q, prefix_k, prefix_v, allowed, chain_k, chain_v) -> torch.Tensor:
        """Grouped attention of chain queries ``[B, kvh, rep, n, D]`` over the prefix keys
        ``[B, kvh, L, D]`` where ``allowed`` ``[B, 1, 1, n, L]`` and the chain's own keys
        ``[B, kvh, 1, n, D]`` each."""
        bsz, kvh, rep, n, hd = q.shape
        scale = 1.0 / math.sqrt(hd)
        prefix = (q.reshape(bsz, kvh, rep * n, hd) @ prefix_k.transpose(-1, -2)).view(bsz, kvh, rep, n, -1) * scale
        scores = [prefix.masked_fill(~allowed, float("-inf"))] + [(q * k).sum(-1, keepdim=True) * scale for k in chain_k]
        probs = torch.softmax(torch.cat(scores, -1), -1)  # [B, kvh, rep, n, L + m-1]
        length = prefix_k.shape[2]
        out = (probs[..., :length].reshape(bsz, kvh, rep * n, length) @ prefix_v).view(bsz, kvh, rep, n, hd)
        for j, v in enumerate(chain_v):
            out = out + probs[..., length + j : length + j + 1] * v
        return out
