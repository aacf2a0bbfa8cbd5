"""Draft heads: the ones shipped with specdec, and loading a head for a loaded target.

A head file (:func:`save_head`: safetensors, the config in its metadata) holds only what was trained; the
target's embedding, final norm and output rows for the head's vocabulary subset are taken from the
target itself when the head is loaded. Its matrices are stored in fp16 (58 MB for the default
target's head: what training writes and continues from) or, for shipping, in the q4k
decomposition the runtime multiplies them in (``weights="q4k"``: 4.625 bits a weight, 17 MB):
on the q4k and gguf runtimes such a head computes exactly what its fp16 original computes there,
and other runtimes multiply its dequantized values.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import torch

from specdec.models.loading import LoadedModel, content_sha256, release_freed_memory
from specdec.runtime import q4
from specdec.runtime.head import DraftHead, HeadConfig
from specdec.runtime.model import Transformer
from specdec.text.vocab import VocabMap

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
    return content_sha256(path)


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


# A draft model computes logits only for this many frequent ids (FR-Spec; heads.frequent_ids):
# on the 0.5B draft, its output layer shrinks from 151,936 to 65,536 rows (~50 MB fewer bytes per
# draft token) at the same acceptance on code (docs/CHANGELOG.md, 'Fewer ops per layer'). Exact whatever the size:
# the other ids get q = 0 and are never drafted.
DRAFT_VOCAB = 65536


class DraftView(NamedTuple):
    """A draft model as its proposer runs it: the model, the target ids its logits are for
    (None: all of its vocabulary), the target's vocabulary size, and the map to the target's ids
    where the two vocabularies differ (None: the same ids)."""

    model: Transformer
    ids: torch.Tensor | None
    vocab_size: int
    vocab: VocabMap | None


def pruned_draft(draft: LoadedModel, head: Path | None, vocab: VocabMap | None = None) -> DraftView:
    """``draft``'s model with its output layer cut to :data:`DRAFT_VOCAB` frequent ids
    (:func:`frequent_ids`, ranked by the target's draft head ``head`` where it has one), and those
    ids. ``vocab``: the map to a target of another vocabulary (:mod:`specdec.text.vocab`): then
    the ids are target ids, those of the intersection, and the rows the draft's for them."""
    model = draft.model
    if vocab is None:
        if model.vocab_size <= DRAFT_VOCAB:
            return DraftView(model, None, model.vocab_size, None)
        ids = frequent_ids(head, model.vocab_size, DRAFT_VOCAB)
        rows = ids
    else:
        ids = vocab.target_ids
        if len(ids) > DRAFT_VOCAB:
            ids = ids[torch.isin(ids, frequent_ids(head, vocab.target_size, DRAFT_VOCAB))]
        rows = vocab.draft_rows(ids)
    model = model.with_output_rows(output_rows(draft, rows))
    release_freed_memory()
    return DraftView(model, ids, vocab.target_size if vocab else draft.model.vocab_size, vocab)


def output_rows(target: LoadedModel, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The target's output layer in fp32, read from its weights on disk: all ``[V, E]``, or only
    the rows ``ids`` (read in chunks, so a head load never holds the whole matrix)."""
    weights = target.weights
    name = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    return weights[name].float() if ids is None else weights.rows(name, ids)


def load_head(path: Path, target: LoadedModel) -> DraftHead:
    """A :class:`DraftHead` for ``target``, in the target's runtime dtype."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no draft head at {path}")
    cfg, state, vocab_ids, _, grids = _read(Path(path))
    if target.model.vocab_size != cfg.target_vocab_size:
        raise ValueError(f"the head at {path} was trained for a vocabulary of {cfg.target_vocab_size} ids; "
                         f"{target.name} has {target.model.vocab_size}")
    head = DraftHead(cfg, state, vocab_ids, target.model, output_rows(target, vocab_ids), target.model.dtype_name,
                     grids)
    del state
    release_freed_memory()
    return head


def save_head(path: Path, cfg: HeadConfig, state: dict[str, torch.Tensor], vocab_ids: torch.Tensor,
              info: dict | None = None, weights: str = "fp16") -> None:
    """Write the head as safetensors (int32 vocabulary, config in the metadata). ``weights``:
    "fp16" stores every tensor in fp16; "q4k" stores each matrix ``name`` [out, in] as the packed
    q4k decomposition of its fp16 values (``name.q4k``, :func:`specdec.runtime.q4.quantize_q4k`)
    and its shape (``name.shape``), vectors in fp16."""
    from safetensors.torch import save_file

    from specdec import cache

    if weights not in ("fp16", "q4k"):
        raise ValueError(f"weights must be 'fp16' or 'q4k', got {weights!r}")
    tensors = {}
    for name, value in state.items():
        value = value.to(torch.float16)
        if weights == "q4k" and value.dim() == 2:
            tensors[name + ".q4k"] = q4.quantize_q4k(value.float())["packed"]
            tensors[name + ".shape"] = torch.tensor(value.shape, dtype=torch.int64)
        else:
            tensors[name] = value.contiguous()
    tensors["vocab_ids"] = vocab_ids.to(torch.int32)
    meta = {"format": FORMAT, "config": json.dumps(dataclasses.asdict(cfg)), "info": json.dumps(info or {}),
            "weights": weights}
    cache.write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def read_head(path: Path) -> tuple[HeadConfig, dict[str, torch.Tensor], torch.Tensor, dict]:
    """A head file's config, weights (fp16 as stored; a q4k file's matrices as their exact fp32
    values), vocabulary subset and card."""
    cfg, state, vocab_ids, info, _ = _read(Path(path))
    return cfg, state, vocab_ids, info


def _read(path: Path):
    """:func:`read_head`'s four, and the q4k grids of a q4k file's matrices by name (else {})."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a specdec draft head ({FORMAT})")
        if "base" in meta:
            raise ValueError(f"{path} is a head stored as an update of another (a format of specdec before "
                             "2026-12-05); rebuild it with that version's read_head and save it whole")
        stored = {k: f.get_tensor(k) for k in f.keys()}
    vocab_ids = stored.pop("vocab_ids").long()
    state, grids = {}, {}
    for name, value in stored.items():
        if name.endswith(".shape"):
            continue
        if name.endswith(".q4k"):
            name = name[: -len(".q4k")]
            grids[name] = q4.grid_of(value, *stored[name + ".shape"].tolist())
            state[name] = grids[name].dequantize()  # [out, in] fp32, exactly the stored values
        else:
            state[name] = value  # fp16 as stored: each consumer converts one tensor at a time
    return _config(path, json.loads(meta["config"])), state, vocab_ids, json.loads(meta["info"]), grids


def _config(path: Path, config: dict) -> HeadConfig:
    """A head file's :class:`HeadConfig`. Files written before EAGLE-3's fused features were
    removed (2026-12-05) record ``feature_layers``: empty, the last block's features, as every
    head reads now; a fused head is refused, not run on the wrong features."""
    if config.pop("feature_layers", None):
        raise ValueError(f"{path} reads EAGLE-3's fused features (several target blocks), which specdec no "
                         "longer supports: it would compute other drafts than it was trained for")
    return HeadConfig(**config)

