"""Train a draft head on stored target features: distillation, checkpoints, resume, evaluation.

Labels are the target's own distribution at the next position (computed from the stored features
by its final norm and output rows, restricted to the head's vocabulary subset — the best a head
that can only draft from that subset can do is match ``p`` there). Each batch trains draft steps
1..``passes`` at every slot (:meth:`HeadNet.passes`): later steps read the head's own guesses, as
they do when drafting. The schedule is a pure function of the step number (the data order of epoch
e is a permutation seeded by (seed, e)), so a run resumed from a checkpoint continues exactly as
the uninterrupted run would have.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdec import cache
from specdec.runtime.head import HeadConfig
from specdec.training.head_net import HeadNet


@dataclass(frozen=True)
class TrainConfig:
    vocab_size: int = 16384  # the head's output subset (frequency-ranked ids)
    intermediate_size: int = 4096
    passes: int = 3  # draft steps trained per slot
    steps: int = 600
    batch_sequences: int = 4
    lr: float = 1e-3
    warmup: int = 20
    seed: int = 0
    checkpoint_every: int = 25
    held_out_every: int = 20  # every n-th sequence is held out for evaluation
    # 0: full soft labels over the subset (the target's p, every id). k > 0: the target's top-k
    # ids and probabilities (renormalised), with the loss logsumexp(z) - sum_k p_k z_k computed
    # only at the slots that are trained (see :func:`pass_losses`): ~3x fewer bytes moved per step.
    label_top_k: int = 0
    answers_only: bool = False  # train only the slots that predict an assistant's token
    # with label_top_k: train the drafting chains of this share of the slots, drawn anew each step
    # (pass_losses_top_k): ~this share of the layer's cost per token, the same expected loss
    chain_share: float = 1.0


def split(num_sequences: int, every: int) -> tuple[list[int], list[int]]:
    held = [i for i in range(num_sequences) if i % every == every - 1]
    return [i for i in range(num_sequences) if i % every != every - 1], held


def vocab_subset(token_rows: list[torch.Tensor], size: int, always: set[int], vocab: int,
                 frequent_share: float = 1.0) -> torch.Tensor:
    """The ids a head drafts, sorted: ``always`` (end-of-turn ids), then the most frequent ids of
    the training tokens (ties by id) up to ``frequent_share`` of ``size``, then the lowest unused
    ids. A byte-level BPE numbers its merges in the order it learned them, so low ids are the
    frequent pieces of the tokenizer's own (multilingual) corpus: the fill is a prior for text the
    training tokens lack. On the bench's greedy answers a 16,384-id subset of ShareGPT tokens
    covers 0.883 of the target's tokens at share 1 and 0.890 at 0.75; on held-out own answers
    (what the share was chosen on) 0.910 and 0.919 (docs/HEAD-TRAINING.md)."""
    if not 0 < frequent_share <= 1:
        raise ValueError(f"frequent_share must be in (0, 1], got {frequent_share}")
    counts = Counter()
    for row in token_rows:
        counts.update(row[row >= 0].tolist())
    ranked = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    chosen = list(dict.fromkeys([i for i in always if i < vocab] + ranked))[: max(1, int(size * frequent_share))]
    if len(chosen) < size:  # fill with the lowest unused ids (all of the rest for a small corpus)
        used = set(chosen)
        chosen += [i for i in range(vocab) if i not in used][: size - len(chosen)]
    return torch.tensor(sorted(chosen))


class Dataset:
    """Sequences of (tokens [L] long, features [L, E] fp16) from the feature shards."""

    def __init__(self, shards: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.rows = []
        for tokens, hidden in shards:
            for t, h in zip(tokens, hidden):
                n = int((t >= 0).sum())
                self.rows.append((t[:n].long(), h[:n]))

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded tokens ``[B, L]`` (-1), features ``[B, L, E]`` fp32, lengths ``[B]``."""
        width = max(self.rows[i][0].shape[0] for i in indices)
        e = self.rows[indices[0]][1].shape[1]
        tokens = torch.full((len(indices), width), -1, dtype=torch.long)
        feats = torch.zeros(len(indices), width, e)
        for b, i in enumerate(indices):
            t, h = self.rows[i]
            tokens[b, : t.shape[0]], feats[b, : t.shape[0]] = t, h.float()
        return tokens, feats, torch.tensor([self.rows[i][0].shape[0] for i in indices])


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU (``cpuinfo``: the text of /proc/cpuinfo, read when None) multiplies bf16
    natively, with AVX-512 BF16 or AMX: there, matmuls under bf16 autocast ran 2.4x fp32's (Zen 4:
    333 against 138 GFLOP/s). Elsewhere bf16 is emulated, far slower than fp32 (AVX2 Zen 3: 5
    steps did not finish in 600 s, fp32 trains at 71 tokens/s), so training stays in fp32."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(f in cpuinfo.split() for f in ("avx512_bf16", "amx_bf16"))


BF16 = native_bf16()


def precision() -> str:
    """Which training path runs here (for model cards and throughput reports)."""
    return "bf16 autocast (fp32 master weights)" if BF16 else "fp32 (no native bf16 on this CPU)"


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=BF16)


def order(train_ids: list[int], step: int, batch: int, seed: int) -> list[int]:
    """The sequences of ``step``: epoch e walks a permutation seeded by (seed, e)."""
    per_epoch = max(1, len(train_ids) // batch)
    epoch, pos = divmod(step, per_epoch)
    perm = torch.randperm(len(train_ids), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return [train_ids[int(i)] for i in perm[pos * batch : (pos + 1) * batch]]


def pass_losses(net: HeadNet, tokens, feats, lengths, passes: int) -> list[torch.Tensor]:
    """Mean distillation cross-entropy of each draft step over its valid slots."""
    with _autocast():  # matmuls in bf16 where native (native_bf16), softmaxes in fp32
        with torch.no_grad():
            labels = torch.softmax(net.target_logits(feats[:, 1:]).float(), -1)  # [B, L-1, N] p at slot i+1
        outs = net.passes(feats, tokens, passes)
        slots = torch.arange(tokens.shape[1] - 1)
        losses = []
        for m, out in enumerate(outs, start=1):
            logq = torch.log_softmax(net.target_logits(out[:, :-1]).float(), -1)  # [B, L-1, N]
            valid = (slots.view(1, -1) >= m - 1) & (slots.view(1, -1) + 1 < lengths.view(-1, 1))  # [B, L-1]
            ce = -(labels * logq).sum(-1)
            losses.append((ce * valid).sum() / valid.sum().clamp(min=1))
    return losses


def answer_mask(tokens: torch.Tensor, header: list[int], ends: set[int], last_only: bool = False) -> torch.Tensor:
    """``[B, L]`` bool: the positions of ``tokens`` ``[B, L]`` (-1 padded) inside an assistant's
    turn — after each occurrence of the chat template's assistant header ``header`` (e.g.
    ``<|im_start|>assistant\n``) up to and including the end-of-turn token (one of ``ends``), which
    the head must learn to draft too. ``last_only``: the last assistant turn of each row alone —
    the target's own answer in a row it generated, whose multi-turn context may hold a
    human-written assistant turn."""
    n = len(header)
    if n == 0 or tokens.shape[1] < n:
        return torch.zeros(tokens.shape, dtype=torch.bool)
    hdr = torch.tensor(header)
    windows = tokens.unfold(1, n, 1)  # [B, L-n+1, n]
    starts = (windows == hdr).all(-1)  # [B, L-n+1] a header begins here
    is_end = torch.zeros(tokens.shape, dtype=torch.bool)
    for e in ends:
        is_end |= tokens == e
    length = tokens.shape[1]
    opens = torch.zeros(tokens.shape, dtype=torch.bool)  # the first position of an answer
    opens[:, n:] = starts[:, : length - n]
    idx = torch.arange(length).expand_as(tokens)
    last_open = torch.where(opens, idx, -1).cummax(1).values  # [B, L]
    last_end = torch.where(is_end, idx, -1).cummax(1).values
    end_before = torch.cat([torch.full_like(last_end[:, :1], -1), last_end[:, :-1]], 1)  # strictly before i
    out = (last_open >= 0) & (last_open > end_before)  # an answer opened and not yet ended (its end kept)
    if last_only:
        out = out & (last_open == last_open[:, -1:])  # opened by the row's last header
    return out & (tokens >= 0)


def pass_losses_top_k(net: HeadNet, tokens, feats, lengths, passes: int, k: int,
                      trained: torch.Tensor | None = None, chain_share: float = 1.0,
                      generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """:func:`pass_losses` with the target's top-``k`` labels, computed only where it trains,
    along drafting chains from a random ``chain_share`` of the slots.

    Slot i of pass m predicts the token at i+2 (see :meth:`HeadNet.passes`); its label is the
    target's distribution there, read from the feature at i+1. ``trained`` ``[B, L]`` marks the
    positions whose token is learned (None: all). With ``p`` the target's top-k probabilities
    renormalised over ids ``t_1..t_k`` and ``z`` the head's subset logits, cross-entropy is
    ``-sum_j p_j log softmax(z)_{t_j} = logsumexp(z) - sum_j p_j z_{t_j}``: one reduction over
    the subset, no full-size product.

    Pass m's slots are reached as step m of the chain from anchor a = i-m+1
    (:meth:`HeadNet.chains`). Each row trains the chains of ``ceil(chain_share x n)`` of its n
    anchors (those with a labelled step), drawn uniformly without replacement by ``generator``:
    every labelled slot of pass m is then in the sample with (up to the rounding of the counts)
    the same probability, so each pass's mean loss estimates the mean over all its slots (a ratio
    estimate: the number of sampled slots varies a little, its bias shrinks as 1/n), at about
    ``chain_share`` of the layer's cost (all but its input projection). ``chain_share = 1``: every chain, the loss
    over every labelled slot."""
    if not 0 < chain_share <= 1:
        raise ValueError(f"chain_share must be in (0, 1], got {chain_share}")
    bsz, length = tokens.shape
    slots = torch.arange(length - 1)
    inside = slots.view(1, -1) + 1 < lengths.view(-1, 1)  # [B, L-1] a label exists
    if trained is not None:
        inside = inside & _slots_learned(trained)
    has_step = torch.zeros_like(inside)  # [B, L-1] anchor a: some step m of its chain is labelled
    for m in range(1, passes + 1):
        has_step[:, : length - m] |= inside[:, m - 1 :]
    anchors = _draw_anchors(has_step, chain_share, generator)  # [B, n]
    rows = torch.arange(bsz).view(-1, 1).expand_as(anchors)  # [B, n]
    steps = []  # per pass: the slot of each chain's step m [B, n], and whether it is trained
    for m in range(1, passes + 1):
        s = anchors + m - 1
        valid = (anchors >= 0) & (s < length - 1)
        steps.append((s, valid & inside.gather(1, s.clamp(0, length - 2))))
    with _autocast():
        with torch.no_grad():  # the target's top-k at each slot some step predicts, read from the feature after it
            needed = torch.zeros_like(inside)
            for s, valid in steps:
                needed[rows[valid], s[valid]] = True
            top = torch.topk(net.target_logits(feats[:, 1:][needed]).float(), k, dim=-1)  # [n, k]
            probs = torch.softmax(top.values, -1)
            slot_index = torch.full(inside.shape, -1, dtype=torch.long)
            slot_index[needed] = torch.arange(int(needed.sum()))
        outs = net.chains(feats, tokens, anchors, passes)  # passes x [B, n, E]
        losses = []
        for out, (s, valid) in zip(outs, steps):
            if not bool(valid.any()):
                losses.append(out.sum() * 0.0)
                continue
            z = net.target_logits(out[valid]).float()  # [n_m, N]
            row = slot_index[rows[valid], s[valid]]
            ce = torch.logsumexp(z, -1) - (probs[row] * z.gather(-1, top.indices[row])).sum(-1)
            losses.append(ce.mean())
    return losses


def _draw_anchors(candidates: torch.Tensor, share: float, generator: torch.Generator | None) -> torch.Tensor:
    """``[B, n]`` slot indices (-1 padded): ``ceil(share x c_b)`` of each row's ``c_b`` candidate
    slots (``candidates`` ``[B, S]`` bool), uniformly without replacement, in increasing order."""
    counts = candidates.sum(1)  # [B]
    if share < 1:
        counts = torch.ceil(counts * share).long()
    keys = torch.rand(candidates.shape, generator=generator) if share < 1 else torch.zeros(candidates.shape)
    keys = torch.where(candidates, keys, 2.0)  # non-candidates last
    n = max(1, int(counts.max()))
    picked = keys.argsort(dim=1, stable=True)[:, :n]  # [B, n] the first c_b are drawn
    picked = torch.where(torch.arange(n).view(1, -1) < counts.view(-1, 1), picked, candidates.shape[1])
    picked = picked.sort(1).values
    return torch.where(picked < candidates.shape[1], picked, -1)


def _slots_learned(trained: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions learned -> ``[B, L-1]`` slots learned: slot i predicts position i+2."""
    out = torch.zeros(trained.shape[0], trained.shape[1] - 1, dtype=torch.bool)
    out[:, :-1] = trained[:, 2:]
    return out


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(net: HeadNet, data: Dataset, train_ids: list[int], cfg: TrainConfig, checkpoint: Path,
          progress: bool = True, answer_header: list[int] | None = None, ends: set[int] | None = None) -> dict:
    """Train ``net`` for ``cfg.steps`` steps, resuming from ``checkpoint`` if it exists; returns
    the run's log (loss per step, seconds). With ``cfg.answers_only``, ``answer_header`` and
    ``ends`` delimit the assistant's turns (:func:`answer_mask`)."""
    if cfg.answers_only and not (answer_header and cfg.label_top_k):
        raise ValueError("answers_only needs label_top_k > 0 and the chat template's answer_header")
    if cfg.chain_share != 1 and not cfg.label_top_k:
        raise ValueError("chain_share < 1 needs label_top_k > 0 (the sampled chains are trained with top-k labels)")
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    step, log = 0, {"loss": [], "seconds": 0.0}
    start_key = run_start_key(net, data, train_ids)
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        made = {k: v for k, v in state["train_config"].items() if (k, v) != ("feature_noise", 0.0)}  # (a removed option)
        if made != asdict(cfg):
            raise ValueError(f"{checkpoint} was made with other settings {state['train_config']}; remove it to start over")
        if state.get("start") != start_key:
            raise ValueError(f"{checkpoint} is another run's: it started from another head or trains on other data "
                             f"({state.get('start')} here {start_key}); remove it to start over")
        net.load_export(state["head"])
        opt.load_state_dict(state["optimizer"])
        step, log = state["step"], state["log"]

    def save() -> None:
        payload = {"head": net.export(), "optimizer": opt.state_dict(), "step": step, "log": log,
                   "train_config": asdict(cfg), "start": start_key}
        cache.write_atomic(checkpoint, lambda tmp: torch.save(payload, tmp))

    bar = tqdm(total=cfg.steps, initial=step, desc="train head", unit="step", disable=not progress)
    while step < cfg.steps:
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        tokens, feats, lengths = data.batch(order(train_ids, step, cfg.batch_sequences, cfg.seed))
        if cfg.label_top_k:
            trained = answer_mask(tokens, answer_header, ends or set()) if cfg.answers_only else None
            chains = torch.Generator().manual_seed(2**40 + cfg.seed * 1_000_003 + step)  # a function of the step: resumable
            losses = pass_losses_top_k(net, tokens, feats, lengths, cfg.passes, cfg.label_top_k, trained,
                                       cfg.chain_share, chains)
        else:
            losses = pass_losses(net, tokens, feats, lengths, cfg.passes)
        loss = sum(losses) / len(losses)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        step += 1
        log["loss"].append([round(float(x.detach()), 4) for x in losses])
        log["seconds"] += time.perf_counter() - start
        bar.update(1)
        bar.set_postfix(loss=" ".join(f"{float(x.detach()):.2f}" for x in losses))
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save()
    bar.close()
    return log


def run_start_key(net: HeadNet, data: Dataset, train_ids: list[int]) -> dict:
    """What a training run starts from: a digest of the head's weights and drafted ids before step
    1, and of the training rows' tokens. Stored in the checkpoint, so that a resume continues the
    same run, never another one's checkpoint left under the same name with the same settings."""
    import hashlib

    head = hashlib.sha256(net.vocab_ids.numpy().tobytes())
    for name, tensor in sorted(net.export().items()):
        head.update(name.encode())
        head.update(tensor.float().contiguous().numpy().tobytes())
    rows = hashlib.sha256()
    for i in train_ids:
        rows.update(data.rows[i][0].numpy().tobytes())
    return {"head": head.hexdigest()[:16], "rows": len(train_ids), "tokens": rows.hexdigest()[:16]}


@torch.no_grad()
def evaluate(net: HeadNet, data: Dataset, ids: list[int], passes: int, full_rows: torch.Tensor,
             batch: int = 4, answer_header: list[int] | None = None, ends: set[int] | None = None,
             temperature: float = 1.0, last_answer_only: bool = False) -> dict:
    """Held-out acceptance per draft position, teacher-forced tokens, the head's own features:
    ``alpha[m]`` = mean over slots of sum_x min(p(x), q(x)) (the chance a sampled draft at step
    m is accepted, both at ``temperature``) and ``greedy[m]`` = how often argmax q == argmax p (greedy acceptance),
    both with ``p`` the target's full-vocabulary distribution (``full_rows`` [V, E]); and the
    subset's coverage of the target's argmax. With ``answer_header``, only the slots that
    predict an assistant's token count (:func:`answer_mask`); with ``last_answer_only`` too, only
    those of each row's last assistant turn (the target's own answer in a generated row)."""
    sums = {"alpha": [0.0] * passes, "greedy": [0.0] * passes, "count": [0] * passes}
    covered = total = 0
    subset = torch.zeros(full_rows.shape[0], dtype=torch.bool)
    subset[net.vocab_ids] = True
    for s in range(0, len(ids), batch):
        tokens, feats, lengths = data.batch(ids[s : s + batch])
        p = torch.softmax(torch.nn.functional.linear(net.normed(feats[:, 1:]), full_rows.float()) / temperature, -1)  # [B, L-1, V]
        top = p.argmax(-1)
        slots = torch.arange(tokens.shape[1] - 1)
        inside = slots.view(1, -1) + 1 < lengths.view(-1, 1)
        if answer_header:
            inside = inside & _slots_learned(answer_mask(tokens, answer_header, ends or set(), last_answer_only))
        covered += int((subset[top] & inside).sum())
        total += int(inside.sum())
        for m, out in enumerate(net.passes(feats, tokens, passes), start=1):
            q = torch.softmax(net.target_logits(out[:, :-1]) / temperature, -1)  # [B, L-1, N]
            valid = inside & (slots.view(1, -1) >= m - 1)
            alpha = torch.minimum(p[..., net.vocab_ids], q).sum(-1)
            hit = net.vocab_ids[q.argmax(-1)] == top
            sums["alpha"][m - 1] += float((alpha * valid).sum())
            sums["greedy"][m - 1] += float((hit & valid).sum())
            sums["count"][m - 1] += int(valid.sum())
    n = sums["count"]
    return {"alpha": [round(a / max(1, c), 4) for a, c in zip(sums["alpha"], n)],
            "greedy": [round(g / max(1, c), 4) for g, c in zip(sums["greedy"], n)],
            "slots": n[0], "subset_covers_argmax": round(covered / max(1, total), 4)}


def write_json(path: Path, data: dict) -> None:
    cache.write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1)))


def head_config(target_cfg, cfg: TrainConfig) -> HeadConfig:
    return HeadConfig.for_target(target_cfg, cfg.intermediate_size)
