"""``specdec train-head --hours H``: the recipe that worked, stage after stage, within H hours.

Stage 1 trains a new head on text (the corpus of ``--corpus``), sized to take about a third of
the time: its corpus follows from the target's prefill rate, measured first. Then rounds of the
target's own answers, the text a head drafts at inference (docs/HEAD-TRAINING.md): each round
answers new batches of requests (ShareGPT user turns, python-docs requests and translation
requests with ``--corpus sharegpt``; python-docs requests otherwise), replays every earlier
round's (their features are kept), and trains the previous head further with the shipped head's
settings (top-32 labels on answer slots, a quarter of the chains). A round starts only while its
estimated time, the last round's scaled by its training steps, fits in what is left.

Each stage's head stays in the work directory (``plan-NN.safetensors`` with its card) and
``plan.json`` records the seconds each took: a rerun of the same command skips the stages done
(their time counts against the hours) and resumes the one interrupted from what it had kept (its
corpus, features and training checkpoints; its time before the interruption is not counted).
After each stage one line gives its held-out acceptance; the last head is copied to ``--out``
with its card.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from specdec import cache
from specdec.training import features
from specdec.training.recipe import AnswerSlice, HeadRecipe
from specdec.training.run import run

# batches of 16 requests a round adds, by request source, for each stage-1 corpus
ROUND = {"sharegpt": (("sharegpt", 8), ("python-docs", 4), ("sharegpt-translate", 4)),
         "python-docs": (("python-docs", 8),)}
STEPS_PER_BATCH = 6  # training steps of 4 windows per own-answer batch, replayed ones included
ROUND_TRAIN = {"label_top_k": 32, "answers_only": True, "chain_share": 0.25, "lr": 0.0016}  # the shipped head's
STAGE1_SHARE = 1 / 3  # of the hours, for stage 1
EPOCHS = 2  # stage 1's passes over its corpus


def train_within(target, base: HeadRecipe, hours: float, workdir: Path, out: Path, eos_ids, encode_chat) -> dict:
    """Run the plan for ``target`` within ``hours``: stage 1 from ``base`` (its corpus and
    training settings), then rounds of own answers while they fit. Returns the last stage's card."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "plan.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {"stages": []}
    left = hours * 3600 - sum(s["seconds"] for s in log["stages"])
    stage, path = 0, None
    while True:
        done = stage < len(log["stages"])
        if not done:
            recipe = _stage1(target, base, hours, log) if stage == 0 else _round(base, stage, path)
            if stage > 0 and _estimate(log["stages"], recipe) > left:
                break  # the next round would not fit in the hours left
        path = workdir / f"plan-{stage:02d}.safetensors"
        if not done:
            _save(log_path, log)  # (stage 1's size first: a resumed stage 1 is the same run)
            began = time.perf_counter()
            card = run(target, recipe, workdir, path, eos_ids, encode_chat)
            seconds = time.perf_counter() - began
            left -= seconds
            log["stages"].append({"head": path.name, "seconds": round(seconds, 1),
                                  "steps": recipe.finetune_steps or recipe.train.steps, "greedy": _first(card)})
            _save(log_path, log)
        _progress(stage, log["stages"][stage], hours)
        stage += 1
    for suffix in (".safetensors", ".json", ".md"):
        shutil.copyfile(path.with_suffix(suffix), out.with_suffix(suffix))
    return json.loads(path.with_suffix(".json").read_text())


def _stage1(target, base: HeadRecipe, hours: float, log: dict) -> HeadRecipe:
    """Stage 1 on ``base``'s corpus: at most its tokens, as many as the target prefills in half
    of stage 1's share of the hours (the other half trains, :data:`EPOCHS` passes). The size is
    kept in ``log`` when first chosen, so that a resumed stage 1 is the same run."""
    if "stage1" not in log:
        rate = prefill_rate(target.model, base.seq_len)  # tokens/s
        tokens = int(min(base.tokens, max(16 * base.seq_len, rate * hours * 3600 * STAGE1_SHARE / 2)))
        steps = max(1, EPOCHS * max(16, tokens // base.seq_len) // base.train.batch_sequences)
        log["stage1"] = {"tokens": max(tokens, 1000), "steps": steps, "prefill_tokens_per_s": round(rate, 1)}
    size = log["stage1"]
    return replace(base, tokens=size["tokens"], train=replace(base.train, steps=size["steps"]))


def _round(base: HeadRecipe, r: int, init_head: Path) -> HeadRecipe:
    """Round ``r`` (1, 2, ...): every earlier round's own-answer batches and ``ROUND``'s new ones,
    from the previous stage's head."""
    answers = tuple(AnswerSlice(source, 0, n * r) for source, n in ROUND[base.source])
    steps = STEPS_PER_BATCH * sum(n * r for _, n in ROUND[base.source])
    return replace(base, answers=answers, finetune_steps=steps, init_head=init_head,
                   train=replace(base.train, **ROUND_TRAIN))


def _save(path: Path, log: dict) -> None:
    cache.write_atomic(path, lambda tmp: tmp.write_text(json.dumps(log, indent=1)))


def _estimate(stages: list[dict], recipe: HeadRecipe) -> float:
    """Seconds the next round will take: the last stage's time scaled by the training steps
    (after stage 1 alone, whose steps are of another kind, its time as it was)."""
    last = stages[-1]
    return last["seconds"] * (recipe.finetune_steps / last["steps"] if len(stages) > 1 else 1.0)


def prefill_rate(model, seq_len: int) -> float:
    """The target's prefill rate on this machine, tokens/s: one window of ``seq_len`` tokens."""
    ids = torch.randint(0, model.vocab_size, (min(seq_len, 512),)).tolist()
    start = time.perf_counter()
    features.prefill_features(model, ids)
    return len(ids) / (time.perf_counter() - start)


def _first(card: dict) -> float | None:
    """The stage's held-out greedy acceptance at the first draft position."""
    finetune = card.get("finetune")
    scores = finetune["held_out_own_answers_after"] if finetune else card.get("held_out", {})
    return (scores.get("greedy") or [None])[0]


def _progress(stage: int, record: dict, hours: float) -> None:
    what = "stage 1 (text)" if stage == 0 else f"round {stage} (own answers)"
    print(f"train-head: {what} -> {record['head']}: held-out first-position acceptance {record['greedy']}, "
          f"{record['seconds'] / 60:.1f} min (of {hours * 60:.0f})", file=sys.stderr, flush=True)
