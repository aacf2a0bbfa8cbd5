"""What a caller can attach to an engine to read the target's features of each row
(:meth:`specdec.core.engine.Engine.attach`): the engine itself keeps no training hook.

Head training attaches one to read the features of the target's own answers; the engine keeps
one of its own for the prefix cache when its proposer reads features (a later request that
reuses a finished row's KV needs that row's features too).
"""

from __future__ import annotations

import torch

from specdec.core.rows import RowState


class FeatureRecorder:
    """The target's last-block features of every position whose KV a row committed, in order:
    the prompt's at prefill, then each step's fed token and accepted drafts (never a rejected
    draft's). They stay until :meth:`forget`."""

    def __init__(self) -> None:
        self._pieces: dict[RowState, list[torch.Tensor]] = {}  # row -> [n_i, E] pieces

    def prefilled(self, row: RowState, hidden: torch.Tensor) -> None:
        """``hidden`` ``[L, E]``: the features of the row's whole prompt."""
        self._pieces[row] = [hidden]

    def committed(self, row: RowState, hidden: torch.Tensor) -> None:
        """``hidden`` ``[n, E]``: the features of the positions a step kept in the row's cache."""
        self._pieces[row].append(hidden)

    def features(self, row: RowState) -> torch.Tensor:
        """``[n, E]``: every recorded position of ``row``, prompt first (the last committed token
        has none yet, unless it was an accepted draft: fed, then committed as the row's last)."""
        return torch.cat(self._pieces[row])

    def forget(self, row: RowState) -> None:
        self._pieces.pop(row, None)
