"""The Proposer protocol: suggest up to k tokens per row, then learn what was committed.

A proposer owns whatever state it needs (a draft model's KV cache, an n-gram index) and keeps it
in step with the committed text through ``observe``. The engine never touches that state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.sampling import SamplingParams


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] long
    probs: torch.Tensor | None  # [B, k, V] the distributions the tokens were sampled from; None = deterministic


class Proposer(Protocol):
    # Whether the proposer reads the target's features (a draft head): the engine then passes the
    # last block's output of the prefill to ``start`` and of each verified block to ``observe``.
    wants_target_hidden: bool

    def start(self, prompts: list[list[int]], params: list[SamplingParams], generator: torch.Generator,
              target_hidden: torch.Tensor | None = None) -> None:
        """Begin a batch: ``prompts`` are the token ids already in each row's context;
        ``target_hidden`` ``[B, L, E]`` their target features when ``wants_target_hidden``."""

    def propose(self, pending: list[list[int]], k: int) -> Proposal:
        """Propose ``k`` tokens per row. ``pending[b]`` holds the tokens committed since the last
        call (the first call gets the first generated token): the proposer has not seen them yet."""

    def observe(self, num_accepted: torch.Tensor, target_hidden: torch.Tensor | None = None) -> None:
        """``num_accepted`` ``[B]``: how many of the last proposal's tokens the target accepted;
        ``target_hidden`` ``[B, k+1, E]``: the verified block's features when ``wants_target_hidden``."""

    def retain(self, rows: list[int]) -> None:
        """Keep only these rows (by current position); the others have finished."""
