"""A target's call costs (:class:`~specdec.core.adaptive.CallCosts`) kept between processes.

Why: adaptive k prices a verify call of n positions by what such calls cost on this machine.
Learned from nothing within one answer it lost 7-9% against the best fixed k at a 7B target
(acceptance 0.6-0.7, Zen 5), while costs learned earlier came within 2%. A one-shot
``specdec generate`` is always that first answer, so what one process learns, the next reads,
and the first process of all measures the call sizes adaptive k weighs before its first step
(:func:`calibrate`, ~1 s at 7B, once per model and machine).

Keyed by the model's content (a GGUF's sha256, a directory's file fingerprint), the runtime's
dtype, the CPU (model name and ISA flags) and torch's thread count: costs measured elsewhere
are never read. A damaged file is said on stderr and ignored.
"""

from __future__ import annotations

import hashlib
import json
import time
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


# One-row call sizes measured before the first adaptive step (k = 0, 1, 2, 4, 8; the rest interpolated).
CALIBRATION_SIZES = (1, 2, 3, 5, 9)
CALIBRATION_CONTEXT = 32


def calibrated(costs: CallCosts) -> bool:
    """Whether ``costs`` holds every :data:`CALIBRATION_SIZES` (measured here or by a process before)."""
    return all(n in costs.shape for n in CALIBRATION_SIZES)


@torch.inference_mode()
def calibrate(model, costs: CallCosts, rounds: int = 2) -> float:
    """Fold one-row forwards of each :data:`CALIBRATION_SIZES` positions (after a short prefix,
    sizes interleaved, a first round to warm up) into ``costs``; returns the seconds it took.

    Why: adaptive k prices a call by its size, and a first one-shot run learns only the sizes it
    happens to try, from nothing. Run once per model and machine (the result is kept): at a 7B
    target about 15 forwards, ~1 s."""
    start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.vocab_size, (1, CALIBRATION_CONTEXT), generator=g)  # [1, C]
    cache = model.new_cache(1, CALIBRATION_CONTEXT + max(CALIBRATION_SIZES))
    model(prefix, cache, logit_index=torch.tensor([[CALIBRATION_CONTEXT - 1]]))
    blocks = {n: torch.randint(0, model.vocab_size, (1, n), generator=g) for n in CALIBRATION_SIZES}  # [1, n]
    for r in range(rounds + 1):
        for n in CALIBRATION_SIZES:
            t = time.perf_counter()
            model(blocks[n], cache)
            if r:
                costs.observe(n, time.perf_counter() - t)
            cache.truncate(CALIBRATION_CONTEXT)
    return time.perf_counter() - start


def save_costs(loaded: LoadedModel, costs: CallCosts) -> None:
    """Keep ``costs`` for the next process (atomically; nothing when none was measured)."""
    if costs.scale is None:
        return
    path = costs_path(loaded)
    path.parent.mkdir(parents=True, exist_ok=True)
    cache.write_atomic(path, lambda tmp: tmp.write_text(json.dumps(costs.state())))
