"""Draft heads: the ones shipped with specdec, and loading a head for a loaded target.

A head file (:func:`save_head`: safetensors, the config in its metadata) holds only what was trained; the
target's embedding, final norm and output rows for the head's vocabulary subset are taken from the
target itself when the head is loaded, so a head is a few tens of MB. A head trained further from
another can be stored as that head plus a low-rank update of each matrix (:func:`save_head_delta`:
16 MB at rank 256 in fp16 for the default target's head, 8 MB in int8, against 58 MB in full), which :func:`read_head` rebuilds (issue 29 caps what its stages add to git history).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import torch

from specdec.models.loading import LazyWeights, LoadedModel, release_freed_memory
from specdec.runtime.head import DraftHead, HeadConfig

FORMAT = "specdec-draft-head-v1"

# The sha256 of the GGUF file a shipped head was trained on -> its file in specdec/heads/ (made by
# `specdec train-head`). A head follows the model, not its name: the registry's Qwen2.5-Coder-1.5B
# and the very same file given by its path get the same head.
SHIPPED = {"cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046":
           "qwen2.5-coder-1.5b-instruct.head.safetensors"}


def identity(name_or_path: str) -> str | None:
    """The identity heads are matched by: the sha256 of the target's GGUF file (a registry
    model's pinned one; a .gguf path's own, hashed once and cached by path, size and mtime), or
    None for anything else (a Hugging Face directory has no shipped head)."""
    from specdec import cache
    from specdec.models import registry

    spec = registry.resolve(name_or_path)
    if spec is not None:
        return spec.sha256
    path = Path(name_or_path).expanduser()
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    memo = registry.home() / "sha256" / f"{path.stem}-{cache.fingerprint([path], str(path.resolve()))}"
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    digest = registry.sha256_of(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    cache.write_atomic(memo, lambda tmp: tmp.write_text(digest))
    return digest


def shipped(name_or_path: str) -> Path | None:
    """The head shipped for this target (a registry name or a .gguf path, matched by the file's
    sha256), if there is one."""
    name = SHIPPED.get(identity(name_or_path) or "")
    if name is None:
        return None
    path = Path(str(resources.files("specdec.heads") / name))
    return path if path.is_file() else None


def frequent_ids(head: Path | None, vocab_size: int, size: int) -> torch.Tensor:
    """``size`` token ids, sorted, for a draft that drafts only likely tokens (FR-Spec): the
    frequency-ranked subset of the target's draft head ``head`` (ranked on its training
    text), then the lowest ids — byte-level BPE numbers tokens in the order it merged them, so
    low ids are the tokens most frequent in the tokenizer's own (multilingual) training text.
    Coverage of the target's greedy tokens on the bench's answers, measured: docs/CHANGELOG.md, 'Fewer ops per layer'."""
    from safetensors import safe_open

    size = min(size, vocab_size)
    path = head
    chosen: set[int] = set()
    if path is not None:
        with safe_open(str(path), "pt") as f:
            chosen = {i for i in f.get_tensor("vocab_ids").tolist() if i < vocab_size}
    chosen = set(sorted(chosen)[:size])
    low = 0
    while len(chosen) < size:
        chosen.add(low)
        low += 1
    return torch.tensor(sorted(chosen))


def output_rows(target: LoadedModel, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The target's output layer in fp32, read from its weights on disk: all ``[V, E]``, or only
    the rows ``ids`` (read in chunks, so a head load never holds the whole matrix)."""
    weights = LazyWeights(target.source_dir)
    name = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    return weights[name].float() if ids is None else weights.rows(name, ids)


def load_head(path: Path, target: LoadedModel) -> DraftHead:
    """A :class:`DraftHead` for ``target``, in the target's runtime dtype."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no draft head at {path}")
    cfg, state, vocab_ids, _ = read_head(Path(path))
    if target.model.vocab_size != cfg.target_vocab_size:
        raise ValueError(f"the head at {path} was trained for a vocabulary of {cfg.target_vocab_size} ids; "
                         f"{target.name} has {target.model.vocab_size}")
    head = DraftHead(cfg, state, vocab_ids, target.model, output_rows(target, vocab_ids), target.model.dtype_name)
    del state
    release_freed_memory()
    return head


def save_head(path: Path, cfg: HeadConfig, state: dict[str, torch.Tensor], vocab_ids: torch.Tensor,
              info: dict | None = None) -> None:
    """Write the head as safetensors (fp16 weights, int32 vocabulary), config in the metadata."""
    from safetensors.torch import save_file

    from specdec import cache

    tensors = {k: v.to(torch.float16).contiguous() for k, v in state.items()}
    tensors["vocab_ids"] = vocab_ids.to(torch.int32)
    meta = {"format": FORMAT, "config": json.dumps(dataclasses.asdict(cfg)), "info": json.dumps(info or {})}
    cache.write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def save_head_delta(path: Path, base: Path, state: dict[str, torch.Tensor], vocab_ids: torch.Tensor, rank: int,
                    info: dict | None = None, bits: int = 16) -> dict[str, float]:
    """Write the head ``state`` as the head file ``base`` plus a rank-``rank`` update of each weight
    matrix, so that a head trained further from a committed head costs a fraction of a full head
    (the default target's: 16 MB at rank 256 in fp16, 8 MB in int8, 58 MB in full).

    Each matrix ``W`` [out, in] is stored as ``W_base + U V`` with ``U`` [out, r] and ``V`` [r, in]
    from the truncated SVD of ``W - W_base``: by Eckart-Young the best rank-r approximation in
    Frobenius norm, so the loss is exactly the update's energy beyond its r largest singular values.
    Vectors (norms, biases) and ``vocab_ids`` are stored whole (the vocabulary subset is not trained:
    the head's output is scored by the target's own rows, so a delta may draft another subset). The file names ``base`` (its file
    name, looked up beside ``path`` when read, and its sha256); :func:`read_head` rebuilds the full
    head. Returns, per matrix, the relative Frobenius error of the stored update (truncation and rounding).

    ``bits=8`` stores ``U`` and ``V`` as int8, half the bytes of fp16 at the same rank, with one fp32
    scale per rank direction: ``U V = sum_j (a_j u_j)(b_j v_j)`` with ``u_j`` the j-th left singular
    vector (unit norm) and ``v_j = s_j`` times the j-th right one, each rounded to 127 steps of its
    own largest entry (``a_j``, ``b_j``), so every direction is rounded relative to its own size and
    ``delta_scale[j] = a_j b_j``. Rounding to a step ``h`` adds an error of rms ``h / sqrt(12)``
    per entry, ~1% of the direction's rms for entries a few rms wide: small next to what the
    truncation leaves out (0.36-0.61 of each matrix's change at rank 256 for the default head)."""
    from safetensors.torch import save_file

    from specdec import cache
    from specdec.models import registry

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if bits not in (8, 16):
        raise ValueError(f"bits must be 8 or 16, got {bits}")
    base = Path(base)
    base_cfg, base_state, _, _ = read_head(base)
    if set(base_state) != set(state):
        raise ValueError(f"the head's tensors differ from its base {base}'s: {sorted(set(state) ^ set(base_state))}")
    tensors: dict[str, torch.Tensor] = {"vocab_ids": vocab_ids.to(torch.int32)}
    errors: dict[str, float] = {}
    for name, w in state.items():
        if w.dim() != 2:
            tensors[name] = w.to(torch.float16).contiguous()
            continue
        delta = w.float() - base_state[name].float()  # [out, in]
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)
        r = min(rank, s.numel())
        if bits == 16:
            tensors[name + ".delta_u"] = (u[:, :r] * s[:r]).to(torch.float16).contiguous()  # [out, r]
            tensors[name + ".delta_v"] = vh[:r].to(torch.float16).contiguous()  # [r, in]
        else:
            uq, a = _int8_by_direction(u[:, :r].T)  # [r, out], [r]
            vq, b = _int8_by_direction(s[:r, None] * vh[:r])  # [r, in], [r]
            tensors[name + ".delta_u"] = uq.T.contiguous()  # [out, r] int8
            tensors[name + ".delta_v"] = vq.contiguous()  # [r, in] int8
            tensors[name + ".delta_scale"] = (a * b).contiguous()  # [r] fp32
        stored = _update(tensors, name)  # [out, in]
        total = float(delta.square().sum())
        errors[name] = (float((delta - stored).square().sum()) / total) ** 0.5 if total > 0 else 0.0
    meta = {"format": FORMAT, "config": json.dumps(dataclasses.asdict(base_cfg)), "info": json.dumps(info or {}),
            "base": json.dumps({"file": base.name, "sha256": registry.sha256_of(base)})}
    cache.write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
    return errors


def read_head(path: Path) -> tuple[HeadConfig, dict[str, torch.Tensor], torch.Tensor, dict]:
    """A head file's config, weights (fp16, as stored), vocabulary subset and card. A delta file
    (:func:`save_head_delta`) is rebuilt on its base, which must lie beside it with the sha256 it names."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a specdec draft head ({FORMAT})")
        state = {k: f.get_tensor(k) for k in f.keys()}
    vocab_ids = state.pop("vocab_ids").long()
    cfg = HeadConfig(**json.loads(meta["config"]))
    if "base" in meta:
        state = _rebuild_on_base(Path(path), json.loads(meta["base"]), state)
    # fp16 as stored: each consumer converts one tensor at a time (no fp32 copy of the whole head)
    return cfg, state, vocab_ids, json.loads(meta["info"])


def _rebuild_on_base(path: Path, base: dict, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full weights of the delta head ``path``: each matrix its base's plus ``U V``, each vector its own."""
    from specdec.models import registry

    base_path = path.parent / base["file"]
    if not base_path.is_file():
        raise FileNotFoundError(f"the head {path} is stored as an update of {base['file']}, which is not beside it")
    if registry.sha256_of(base_path) != base["sha256"]:
        raise ValueError(f"the head {path} is an update of {base['file']} with sha256 {base['sha256']}; "
                         f"the file beside it is another")
    _, state, _, _ = read_head(base_path)  # its config is the delta's (save_head_delta copies it; sha256 checked)
    for name in list(state):
        if name + ".delta_u" in delta:
            update = _update(delta, name)  # [out, in]
            for part in (".delta_u", ".delta_v", ".delta_scale"):
                delta.pop(name + part, None)
            state[name] = (state[name].float() + update).to(torch.float16)
        elif name in delta:
            state[name] = delta.pop(name)
        else:
            raise ValueError(f"the head {path} holds no {name}")
    if delta:
        raise ValueError(f"the head {path} holds tensors its base has not: {sorted(delta)}")
    return state


def _int8_by_direction(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` [r, n] rounded to int8 in steps of its own largest entry / 127: (int8 rows, steps [r])."""
    step = x.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127  # [r]
    return torch.round(x / step[:, None]).clamp(-127, 127).to(torch.int8), step.float()


def _update(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The stored update ``U V`` [out, in] of the matrix ``name`` (fp16 factors, or int8 ones with a scale per direction)."""
    u = tensors[name + ".delta_u"].float()  # [out, r]
    if name + ".delta_scale" in tensors:
        u = u * tensors[name + ".delta_scale"].float()
    return u @ tensors[name + ".delta_v"].float()
