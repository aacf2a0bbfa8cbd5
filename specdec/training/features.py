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

from specdec.models import cache
from specdec.runtime.model import Transformer

SHARD = 16


def shard_path(directory: Path, index: int) -> Path:
    return directory / f"features-{index:05d}.safetensors"


def extract(target: Transformer, sequences: list[list[int]], directory: Path) -> None:
    """Write ``features-NNNNN.safetensors`` shards (``tokens`` [n, L] int32 padded with -1,
    ``hidden`` [n, L, E] fp16) for ``sequences`` into ``directory``; existing shards are kept."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    shards = range(0, len(sequences), SHARD)
    todo = [s for s in shards if not shard_path(directory, s // SHARD).exists()]
    if not todo:
        return
    total = sum(len(sequences[i]) for s in todo for i in range(s, min(s + SHARD, len(sequences))))
    with tqdm(total=total, unit="tok", desc="extract features", smoothing=0.1) as bar:
        for start in todo:
            group = sequences[start : start + SHARD]
            width = max(len(s) for s in group)
            tokens = torch.full((len(group), width), -1, dtype=torch.int32)
            hidden = torch.zeros(len(group), width, target.cfg.hidden_size, dtype=torch.float16)
            for i, ids in enumerate(group):
                tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
                hidden[i, : len(ids)] = prefill_features(target, ids).half()
                bar.update(len(ids))
            cache.write_atomic(shard_path(directory, start // SHARD),
                               lambda tmp: save_file({"tokens": tokens, "hidden": hidden}, str(tmp)))


def prefill_features(target: Transformer, ids: list[int]) -> torch.Tensor:
    """``[L, E]`` the target's last-block output at every position of ``ids`` (one prefill)."""
    kv = target.new_cache(1, len(ids))
    _, hidden = target(torch.tensor([ids]), kv, logit_index=torch.tensor([[len(ids) - 1]]), return_hidden=True)
    return hidden[0]


def load_shards(directory: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every shard as (tokens [n, L] int32, hidden [n, L, E] fp16), in order."""
    from safetensors.torch import load_file

    out = []
    for path in sorted(directory.glob("features-*.safetensors")):
        data = load_file(str(path))
        out.append((data["tokens"], data["hidden"]))
    if not out:
        raise FileNotFoundError(f"no feature shards in {directory}")
    return out
