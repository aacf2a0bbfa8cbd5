"""A trained draft head (EAGLE-style) that reads the target's own features.

Input at slot ``s``: the target's last-block output ``h_s`` (the feature of position ``s``) and
the embedding of the token at ``s + 1``, each RMS-normalised (the features carry outliers ~100x
the embeddings' scale), concatenated and projected ``2E -> E`` by ``fc``; then one decoder layer
of the target's shape (its own KV cache, causal attention over the head's earlier slots); its
output ``f_s`` is a guess of ``h_{s+1}``, and the target's final norm and output rows restricted to
a frequency-ranked subset ``S`` of the vocabulary turn it into the draft distribution of the token
at ``s + 2``. Ids outside ``S`` get ``q = 0``: they are never drafted, and exactness is unaffected
(the verifier only ever divides ``p`` by ``q`` where a token was drafted from ``q > 0``).

Drafting k tokens: the committed pairs are fed in one forward (slots ``0..t``); the first draft is
sampled from the last slot's output; each next slot feeds ``(f, draft)`` — the head's own guess in
place of the target's feature, which training teaches it to read (see :class:`HeadNet`). After
verification the head's cache is cut back to the committed pairs, and the target's features of
the accepted tokens (returned by the verification forward at no extra cost) replace the guesses.

Two implementations of the same function: :class:`HeadNet` (differentiable, for training) and
:class:`DraftHead` (the runtime's batch-invariant quantized layers and KV cache, for drafting);
``tests/test_head.py`` checks that they agree.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.proposers.base import Proposal, SingleSource, draft_token, tree_shape
from specdec.runtime.config import ModelConfig
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.linear import LinearBuilder
from specdec.runtime.model import Transformer, apply_rope, rms_norm, rope_tables
from specdec.sampling import SamplingParams, probs_per_row

FORMAT = "specdec-draft-head-v1"
LAYER = "model.layers.0."
_LINEARS = {  # HF-style parameter name -> shape as a function of (E, Hq*D, Hkv*D, I)
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
                           attention_bias=self.attention_bias, rope_theta=self.rope_theta)


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
        self.linears = torch.nn.ParameterDict({n.replace(".", "_"): init(*shape(e, q, kv, i)) for n, shape in _LINEARS.items()})
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

    # -- the state the runtime reads -------------------------------------------------------------
    def export(self) -> dict[str, torch.Tensor]:
        """HF-style tensors of the trainable part (what :func:`save_head` writes)."""
        out = {"fc.weight": self.fc.detach().clone(),
               "feature_norm.weight": self.norm_feature.detach().clone(),
               "embed_norm.weight": self.norm_embed.detach().clone(),
               LAYER + "input_layernorm.weight": self.norm_in.detach().clone(),
               LAYER + "post_attention_layernorm.weight": self.norm_post.detach().clone()}
        for name in _LINEARS:
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
            for name in _LINEARS:
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
        j = i-d from pass m-d). Pass m is only meaningful at slots i >= m-1.
        """
        cfg = self.cfg
        bsz, length, e = hidden.shape
        emb = self.embed[tokens.clamp(min=0)[:, 1:]].float()  # [B, L-1, E] the token after each slot
        emb = torch.cat([emb, emb.new_zeros(bsz, 1, e)], 1)  # [B, L, E] (the last slot has no next token)
        cos, sin = (t[:length].view(1, 1, length, -1) for t in self._rope)
        keys, values, outs = [], [], []
        feats = hidden.float()
        for m in range(1, num_passes + 1):
            if m > 1:  # the previous pass's guess at the slot before
                feats = torch.cat([feats.new_zeros(bsz, 1, e), outs[-1][:, :-1]], 1)
            x = F.linear(self.fc_input(feats, emb), self.fc)  # [B, L, E]
            h = rms_norm(x, self.norm_in, cfg.rms_norm_eps, False)
            q = self._proj(h, "self_attn.q_proj", "q").view(bsz, length, cfg.num_heads, cfg.head_dim).transpose(1, 2)
            k = self._proj(h, "self_attn.k_proj", "k").view(bsz, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
            v = self._proj(h, "self_attn.v_proj", "v").view(bsz, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            rep = cfg.num_heads // cfg.num_kv_heads
            keys.append(k.repeat_interleave(rep, 1))  # [B, Hq, L, D]
            values.append(v.repeat_interleave(rep, 1))
            attn = self._attend(q, keys, values, m)
            x = x + self._proj(attn.transpose(1, 2).reshape(bsz, length, -1), "self_attn.o_proj")
            h = rms_norm(x, self.norm_post, cfg.rms_norm_eps, False)
            mlp = self._proj(F.silu(self._proj(h, "mlp.gate_proj")) * self._proj(h, "mlp.up_proj"), "mlp.down_proj")
            outs.append(x + mlp)
        return outs

    def _attend(self, q: torch.Tensor, keys: list, values: list, m: int) -> torch.Tensor:
        """Attention of pass ``m``'s queries ``[B, H, L, D]``: pass-1 keys at slots <= i-m+1, and
        for d = 0..m-2 the key of slot i-d from pass m-d (see :meth:`passes`)."""
        length = q.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        slots = torch.arange(length)
        scores = [(q @ keys[0].transpose(-1, -2)) * scale]  # [B, H, L, L]
        allowed = slots.view(1, -1) <= slots.view(-1, 1) - (m - 1)  # [L, L]
        scores[0] = scores[0].masked_fill(~allowed, float("-inf"))
        shifted_values = []
        for d in range(m - 1):
            kp, vp = keys[m - 1 - d], values[m - 1 - d]  # pass m-d
            kp = F.pad(kp, (0, 0, d, 0))[:, :, :length]  # slot i holds the key of slot i-d
            vp = F.pad(vp, (0, 0, d, 0))[:, :, :length]
            s = (q * kp).sum(-1, keepdim=True) * scale  # [B, H, L, 1]
            scores.append(s.masked_fill((slots < d).view(1, 1, -1, 1), float("-inf")))
            shifted_values.append(vp)
        probs = torch.softmax(torch.cat(scores, -1), -1)
        out = probs[..., :length] @ values[0]
        for d, vp in enumerate(shifted_values):
            out = out + probs[..., length + d : length + d + 1] * vp
        return out


class DraftHead:
    """The head at inference: quantized, batch invariant, with its own KV cache."""

    def __init__(self, cfg: HeadConfig, state: dict[str, torch.Tensor], vocab_ids: torch.Tensor,
                 target: Transformer, lm_rows: torch.Tensor, dtype: str) -> None:
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
        self.body = Transformer(body_cfg, weights, dtype)
        self.fc = LinearBuilder(dtype)("fc", lambda: state["fc.weight"])
        self.body.quantized_state = {}
        self.norm_feature = state["feature_norm.weight"].to(target.act_dtype)
        self.norm_embed = state["embed_norm.weight"].to(target.act_dtype)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return self.body.new_cache(batch, capacity)

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor, tokens: torch.Tensor, cache: KVCache,
                 **options) -> tuple[torch.Tensor, torch.Tensor]:
        """``features`` ``[B, T, E]`` and the tokens that follow them ``[B, T]`` -> subset logits
        ``[B, T', N]`` and the head's guesses of the next features ``[B, T, E]``. ``options``:
        :meth:`Transformer.forward_embeds`'s (``logit_index``; ``tree_mask``/``positions``/``tree_base``)."""
        act, eps = self.target.act_dtype, self.cfg.rms_norm_eps
        x = self.fc(torch.cat([rms_norm(features.to(act), self.norm_feature, eps, False),
                               rms_norm(self.target.embed[tokens], self.norm_embed, eps, False)], -1))
        return self.body.forward_embeds(x.to(self.target.act_dtype), cache, return_hidden=True, **options)


class HeadProposer(SingleSource):
    """Drafts k tokens per row with a :class:`DraftHead`; returns the processed ``q`` each was
    sampled from (the rows' own temperature / top-k / top-p / min-p, zero outside the subset)."""

    wants_target_hidden = True
    emits_trees = False

    def __init__(self, head: DraftHead, capacity: int) -> None:
        self.head, self.capacity = head, capacity
        self.caught_up = False
        self.cache: KVCache | None = None
        self.params: list[SamplingParams] = []
        self._committed = torch.zeros(0, dtype=torch.long)
        self._feats: list[torch.Tensor] = []
        self._tokens: list[list[int]] = []

    def add(self, prompts: list[list[int]], params: list[SamplingParams], generator: torch.Generator,
            target_hidden: torch.Tensor | None = None) -> None:
        """New rows, with ``target_hidden`` ``[N, L, E]`` the target's features of their prompts
        (from prefill). The pairs (feature t, token t+1) of each prompt are fed now, in one head
        call over just those rows; the last feature waits for the first generated token."""
        if target_hidden is None:
            raise ValueError("the draft head needs the target's prefill features (target_hidden)")
        self.params, self.generator = self.params + list(params), generator
        if self.cache is None:
            self.cache = self.head.new_cache(0, self.capacity)
        start = self.cache.batch
        rows = self.cache.append_rows(len(prompts))
        counts = torch.tensor([len(p) - 1 for p in prompts])  # pairs complete now
        width = int(counts.max())
        if width > 0:
            tokens = torch.tensor([p[1:] + [0] * (width - len(p) + 1) for p in prompts])  # [N, W]
            self.head(target_hidden[:, :width], tokens, rows, logit_index=(counts.clamp(min=1) - 1).unsqueeze(1))
            rows.truncate(counts)
        self.cache.set_lengths(start, rows.lengths)
        self._committed = torch.cat([self._committed, rows.lengths])  # [B] slots of true (feature, token) pairs
        # Per row: features not yet fed to the head, and the tokens that follow them (the token
        # after the last one arrives with the next pending list).
        self._feats += [target_hidden[b, len(p) - 1 : len(p)] for b, p in enumerate(prompts)]
        self._tokens += [[] for _ in prompts]

    def propose(self, pending: list[list[int]], k: int) -> Proposal:
        batch = len(pending)
        self._tokens = [t + p for t, p in zip(self._tokens, pending)]
        if k == 0:
            self.caught_up = False
            return Proposal(torch.zeros(batch, 0, dtype=torch.long), None)
        logits, guess = self._catch_up()
        drafts, probs = [], []
        for i in range(k):
            token, q = draft_token(logits[:, -1], self.params, self.generator, self.head.vocab_ids,
                                   self.head.cfg.target_vocab_size, "draft head")
            drafts.append(token)  # [B, 1]
            if q is not None:
                probs.append(q)  # [B, V]
            if i < k - 1:
                logits, guess = self.head(guess, token, self.cache)
        return Proposal(torch.cat(drafts, 1), torch.stack(probs, 1) if probs else None)

    def _catch_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the queued (target feature, next token) pairs of every row in one head call;
        returns the subset logits at each row's last pair ``[B, 1, N]`` and the head's guess of
        the next feature ``[B, 1, E]`` (what drafting continues from)."""
        batch = len(self._tokens)
        counts = torch.tensor([len(t) for t in self._tokens])  # == len(feats) per row
        self.caught_up = int(counts.max()) > 2
        width = int(counts.max())
        feats = torch.zeros(batch, width, self.head.cfg.hidden_size, dtype=self._feats[0].dtype)
        for b, f in enumerate(self._feats):
            feats[b, : f.shape[0]] = f
        tokens = torch.tensor([t + [0] * (width - len(t)) for t in self._tokens])
        before = self.cache.lengths.clone()
        logits, guesses = self.head(feats, tokens, self.cache, logit_index=(counts - 1).unsqueeze(1))
        self.cache.truncate(before + counts)
        self._committed = before + counts
        guess = guesses.gather(1, (counts - 1).view(-1, 1, 1).expand(-1, 1, guesses.shape[-1]))  # [B, 1, E]
        self._feats = [f[:0] for f in self._feats]
        self._tokens = [[] for _ in range(batch)]
        return logits, guess

    def observe(self, num_accepted: torch.Tensor, target_hidden: torch.Tensor | None = None) -> None:
        """Drop the drafted slots; queue the target's features of the fed token and the accepted
        drafts (``target_hidden`` ``[B, k+1, E]`` from the verification forward)."""
        if target_hidden is None:
            raise ValueError("the draft head needs the target's features of each verified block")
        self.cache.truncate(self._committed)
        self._feats = [torch.cat([f, target_hidden[b, : int(a) + 1]]) for b, (f, a) in
                       enumerate(zip(self._feats, num_accepted))]

    def retain(self, rows: list[int]) -> None:
        self.cache.retain(rows)
        self.params = [self.params[i] for i in rows]
        self._feats = [self._feats[i] for i in rows]
        self._tokens = [self._tokens[i] for i in rows]
        self._committed = self._committed[rows]


class HeadTreeProposer(HeadProposer):
    """Candidate trees from the draft head (EAGLE-2 style dynamic trees), deterministic candidates.

    Depth by depth, the ``width`` best nodes so far (score = product of the head's probabilities
    along the path) are expanded in ONE head call (tree attention over the head's own cache: each
    node sees the committed pairs and its ancestors), each offering its ``width`` most probable
    children. After ``depth`` levels (at most the node budget ``k``), or earlier once no node of
    the newest level scores ``min_score`` (drafting costs a head call per level, and such nodes
    rarely pay for their verification on this CPU), the ``k`` best-scoring nodes form the tree. Scores rank by the head's distribution processed with the row's own sampling
    parameters (the raw distribution for greedy rows, whose processed one is one-hot).

    The candidates are a deterministic function of the committed text, so they are verified as
    such (``probs=None``; :func:`specdec.verify_tree` removes each rejected candidate from the
    target's distribution): exact at every temperature, whatever the head's quality.

    It drafts :class:`HeadProposer`'s chain instead (sampled drafts, or the argmax for greedy
    rows) while every row samples (:func:`~specdec.proposers.base.all_sample`: measured faster at
    T > 0) or when the engine asks for chains (``use_trees``; its
    :class:`~specdec.adaptive.ShapeRace` measures both). ``always_trees``: trees whatever the rows
    and the engine ask (the tests of the tree path under sampling).
    """

    def __init__(self, head: DraftHead, capacity: int, width: int = 4, depth: int = 5, min_score: float = 0.2,
                 always_trees: bool = False) -> None:
        if width < 1 or depth < 1 or not 0 <= min_score <= 1:
            raise ValueError(f"need width >= 1, depth >= 1 and 0 <= min_score <= 1, got {width}, {depth}, {min_score}")
        super().__init__(head, capacity + width * depth)  # the expanded nodes' slots while drafting
        self.width, self.depth, self.min_score = width, depth, min_score
        self.always_trees = always_trees
        self.trees_wanted = True

    @property
    def emits_trees(self) -> bool:
        return tree_shape(self.trees_wanted, self.always_trees, self.params)

    def use_trees(self, on: bool) -> None:
        self.trees_wanted = on

    def _rank_probs(self, subset_logits: torch.Tensor) -> torch.Tensor:
        """``[B, W, N]`` subset logits -> the probabilities candidates are ranked by."""
        if not torch.isfinite(subset_logits).all():
            raise ValueError("the draft head produced non-finite logits")
        ranked = [p if p.temperature > 0 else SamplingParams(temperature=1.0) for p in self.params]
        return probs_per_row(subset_logits, ranked)

    def propose(self, pending: list[list[int]], k: int) -> Proposal:
        if not self.emits_trees:
            return super().propose(pending, k)
        batch = len(pending)
        self._tokens = [t + p for t, p in zip(self._tokens, pending)]
        if k == 0:
            self.caught_up = False
            empty = torch.zeros(batch, 0, dtype=torch.long)
            return Proposal(empty, None, parents=empty.clone(), scores=torch.zeros(batch, 0))
        logits, guess = self._catch_up()  # [B, 1, N], [B, 1, E]
        width = min(self.width, k)
        probs, ids = self._rank_probs(logits).topk(width, dim=-1)  # [B, 1, W]
        tokens, scores = self.head.vocab_ids[ids[:, 0]], probs[:, 0]  # [B, M] nodes so far (M = W)
        parents = torch.full((batch, width), -1, dtype=torch.long)
        base = self.cache.lengths.clone()  # the committed pairs; the expanded nodes go after them
        fed: list[torch.Tensor] = []  # per level: the expanded nodes [B, W], in feeding order
        guesses = guess.new_zeros(batch, 0, guess.shape[-1])  # [B, F, E] the head's guess after each fed node
        level_start = 0
        for level in range(1, min(self.depth, k)):
            if float(scores[:, level_start:].max()) < self.min_score:
                break  # no row has a node worth a deeper level
            # expand the `width` best nodes of the newest level, each offering its `width` best children
            frontier = level_start + scores[:, level_start:].topk(width, dim=1).indices.sort(dim=1).values  # [B, W]
            if level == 1:
                feat = guess.expand(-1, width, -1)  # children of the root continue from its guess
            else:  # a node continues from the guess after its parent (fed one level up)
                parent_slot = (width * (level - 2)) + _position_in(fed[-1], parents.gather(1, frontier))
                feat = guesses.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, guesses.shape[-1]))
            logits, out = self.head(feat, tokens.gather(1, frontier), self.cache,
                                    tree_mask=self._mask(parents, fed, frontier),
                                    positions=(base + level - 1).unsqueeze(1).expand(-1, width), tree_base=base)
            fed.append(frontier)
            guesses = torch.cat([guesses, out], 1)
            probs, ids = self._rank_probs(logits).topk(width, dim=-1)  # [B, W, W]
            level_start = tokens.shape[1]
            tokens = torch.cat([tokens, self.head.vocab_ids[ids].flatten(1)], 1)
            parents = torch.cat([parents, frontier.repeat_interleave(width, dim=1)], 1)
            scores = torch.cat([scores, (scores.gather(1, frontier).unsqueeze(-1) * probs).flatten(1)], 1)
        self.cache.truncate(self._committed)
        return Proposal(tokens, None, parents=parents, scores=scores).prune(k)

    @staticmethod
    def _mask(parents: torch.Tensor, fed: list[torch.Tensor], frontier: torch.Tensor) -> torch.Tensor:
        """``[B, W, F + W]``: which fed nodes (in feeding order) and which new ones each frontier
        node sees — its ancestors and itself."""
        batch, width = frontier.shape
        order = torch.cat(fed + [frontier], 1)  # [B, F + W] node index of each slot
        seen = torch.zeros(batch, width, order.shape[1], dtype=torch.bool)
        node = frontier.clone()
        while True:
            seen |= order.unsqueeze(1) == node.unsqueeze(2)
            node = torch.where(node >= 0, parents.gather(1, node.clamp(min=0)), -1)
            if bool((node < 0).all()):
                return seen


def _position_in(order: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` where each of ``nodes`` ``[B, n]`` stands in ``order`` ``[B, W]``."""
    return (order.unsqueeze(1) == nodes.unsqueeze(2)).long().argmax(-1)


# -- files ---------------------------------------------------------------------------------------

def save_head(path: Path, cfg: HeadConfig, state: dict[str, torch.Tensor], vocab_ids: torch.Tensor,
              info: dict | None = None) -> None:
    """Write the head as safetensors (fp16 weights, int32 vocabulary), config in the metadata."""
    from safetensors.torch import save_file

    from specdec import cache

    tensors = {k: v.to(torch.float16).contiguous() for k, v in state.items()}
    tensors["vocab_ids"] = vocab_ids.to(torch.int32)
    meta = {"format": FORMAT, "config": json.dumps(dataclasses.asdict(cfg)), "info": json.dumps(info or {})}
    cache.write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def read_head(path: Path) -> tuple[HeadConfig, dict[str, torch.Tensor], torch.Tensor, dict]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a specdec draft head ({FORMAT})")
        state = {k: f.get_tensor(k) for k in f.keys()}
    vocab_ids = state.pop("vocab_ids").long()
    # fp16 as stored: each consumer converts one tensor at a time (no fp32 copy of the whole head)
    return HeadConfig(**json.loads(meta["config"])), state, vocab_ids, json.loads(meta["info"])
