"""Target features for head training: one prefill per sequence, stored in shards, resumable.

For each corpus sequence the target (in the runtime dtype the head will read at inference) runs
one prefill; the last block's output at every position is stored in fp16 with the token ids. A
shard of ``SHARD`` sequences is written atomically, so an interrupted extraction resumes at the
first missing shard. The distillation labels are NOT stored: they are the target's own
distribution, recomputed from these features by its final norm and output layer during training.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from specdec import cache
from specdec.runtime.model import Transformer

SHARD = 16


def shard_path(directory: Path, index: int) -> Path:
    return directory / f"features-{index:05d}.safetensors"


def extract(target: Transformer, sequences: list[list[int]], directory: Path) -> None:
    """Write ``features-NNNNN.safetensors`` shards (``tokens`` [n, L] int32 padded with -1,
    ``hidden`` [n, L, E] fp16) for ``sequences`` into ``directory``; existing shards are kept."""
    directory.mkdir(parents=True, exist_ok=True)
    shards = range(0, len(sequences), SHARD)
    todo = [s for s in shards if not shard_path(directory, s // SHARD).exists()]
    if not todo:
        return
    total = sum(len(sequences[i]) for s in todo for i in range(s, min(s + SHARD, len(sequences))))
    with tqdm(total=total, unit="tok", desc="extract features", smoothing=0.1) as bar:
        for start in todo:
            rows = []
            for ids in sequences[start : start + SHARD]:
                rows.append((ids, prefill_features(target, ids)))
                bar.update(len(ids))
            write_shard(shard_path(directory, start // SHARD), rows)


def prefill_features(target: Transformer, ids: list[int]) -> torch.Tensor:
    """``[L, E]`` the target's last-block output at every position of ``ids`` (one prefill)."""
    kv = target.new_cache(1, len(ids))
    _, hidden = target(torch.tensor([ids]), kv, logit_index=torch.tensor([[len(ids) - 1]]), return_hidden=True)
    return hidden[0]


def load_shard(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One shard as (tokens [n, L] int32, hidden [n, L, E] fp16)."""
    from safetensors.torch import load_file

    data = load_file(str(path))
    return data["tokens"], data["hidden"]


def load_shards(directory: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every shard as (tokens [n, L] int32, hidden [n, L, E] fp16), in order."""
    out = [load_shard(path) for path in sorted(directory.glob("features-*.safetensors"))]
    if not out:
        raise FileNotFoundError(f"no feature shards in {directory}")
    return out


def generate_with_features(target: Transformer, prompts: list[list[int]], params, max_new_tokens: int,
                           eos_token_ids, seed: int = 0) -> list[tuple[list[int], torch.Tensor]]:
    """The target's own answers to ``prompts`` with its features at every position of prompt and
    answer but the last (whose feature is never computed): ``[(ids, hidden [len(ids) - 1, E])]``."""
    from specdec.core.engine import new_engine, steps
    from specdec.core.recorder import FeatureRecorder
    from specdec.core.rows import Request

    engine = new_engine(target, max(map(len, prompts)) + max_new_tokens, k_max=0, eos_token_ids=eos_token_ids,
                        seed=seed)
    recorder = FeatureRecorder()
    engine.attach(recorder)
    rows = [engine.add(Request(p, params, max_new_tokens)) for p in prompts]
    for _ in steps(engine, rows):
        pass
    out = []
    for prompt, row in zip(prompts, rows):
        ids = prompt + row.token_ids
        hidden = recorder.features(row)  # [len(ids) - 1, E]: the last token is never fed, so has no feature
        out.append((ids[: hidden.shape[0]], hidden))
    return out


def write_shard(path: Path, rows: list[tuple[list[int], torch.Tensor]]) -> None:
    """A shard in :func:`extract`'s format from (ids, hidden [len(ids), E]) pairs."""
    from safetensors.torch import save_file

    width = max(len(ids) for ids, _ in rows)
    tokens = torch.full((len(rows), width), -1, dtype=torch.int32)
    hidden = torch.zeros(len(rows), width, rows[0][1].shape[-1], dtype=torch.float16)
    for i, (ids, h) in enumerate(rows):
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        hidden[i, : len(ids)] = h.half()
    cache.write_atomic(path, lambda tmp: save_file({"tokens": tokens, "hidden": hidden}, str(tmp)))
