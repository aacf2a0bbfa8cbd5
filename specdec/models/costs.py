"""A target's call costs (:class:`~specdec.core.adaptive.CallCosts`) kept between processes.

Why: adaptive k prices a verify call of n positions by what such calls cost on this machine.
Learned from nothing within one answer it lost 7-9% against the best fixed k at a 7B target
(acceptance 0.6-0.7, Zen 5), while costs learned earlier came within 2%. A one-shot
``specdec generate`` is always that first answer, so what one process learns, the next reads.

Keyed by the model's content (a GGUF's sha256, a directory's file fingerprint), the runtime's
dtype, the CPU (model name and ISA flags) and torch's thread count: costs measured elsewhere
are never read. A damaged file is said on stderr and ignored.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from specdec import cache
from specdec.core.adaptive import CallCosts
from specdec.models.loading import LoadedModel, content_key
from specdec.runtime.native import cpu_name

FORMAT = "call-costs-v1"


def costs_path(loaded: LoadedModel) -> Path:
    """Where ``loaded``'s call costs on this machine, at this thread count, are kept."""
    content = loaded.sha256 or content_key(loaded.source)  # a GGUF has its sha256; else a directory
    machine = f"{loaded.model.dtype_name}|{cpu_name()}|{torch.get_num_threads()}|{FORMAT}"
    return cache.home() / "costs" / f"{content[:16]}-{hashlib.sha256(machine.encode()).hexdigest()[:12]}.json"


def load_costs(loaded: LoadedModel) -> CallCosts:
    """The costs learned by earlier processes, or fresh ones (none kept, or the file damaged)."""
    path = costs_path(loaded)
    try:
        return CallCosts.from_state(json.loads(path.read_text()))
    except FileNotFoundError:
        return CallCosts()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        cache.notice(f"call costs at {path} are damaged ({cache.brief(exc)}); learning them again")
        return CallCosts()


def save_costs(loaded: LoadedModel, costs: CallCosts) -> None:
    """Keep ``costs`` for the next process (atomically; nothing when none was measured)."""
    if costs.scale is None:
        return
    path = costs_path(loaded)
    path.parent.mkdir(parents=True, exist_ok=True)
    cache.write_atomic(path, lambda tmp: tmp.write_text(json.dumps(costs.state())))
