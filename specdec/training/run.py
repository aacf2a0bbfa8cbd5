"""``specdec train-head``: corpus -> features -> vocabulary subset -> training -> evaluation -> head file.

Every stage writes into one work directory and is skipped when its output is already there, so
an interrupted run picks up where it stopped (the corpus and the feature shards are kept; training
resumes from its last checkpoint). The finished head is written with a model card next to it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from specdec import cache
from specdec.models import heads
from specdec.models.loading import LoadedModel
from specdec.models.heads import read_head, save_head
from specdec.training.head_net import HeadNet
from specdec.training import corpus, features
from specdec.training.train import (Dataset, TrainConfig, evaluate, head_config, precision, split, train, vocab_subset,
                                    write_json)


ANSWER_BATCH = 16
ANSWER_TOKENS = 256
ANSWER_TEMPERATURES = (0.0, 0.7)  # batch b answers at ANSWER_TEMPERATURES[b % 2]: greedy and sampled text
SOURCES = ("sharegpt", "python-docs")  # the corpora train-head reads, and whose requests the target answers
# Requests the target answers itself: the corpora's, and requests to translate ShareGPT's English
# paragraphs (sharegpt.translation_prompts), for the non-English text the corpus lacks.
ANSWER_SOURCES = SOURCES + ("sharegpt-translate",)


@dataclass(frozen=True)
class AnswerSlice:
    """Batches ``first`` .. ``end - 1`` of the target's own answers to ``source``'s requests
    (batch b answers requests 16 b .. 16 b + 15 of :func:`answer_prompts`, so a batch is the same
    text whichever slice names it): stage 2's data, e.g. ``sharegpt:36-63`` for batches no earlier
    stage trained on, mixed with ``python-docs:0-16``."""

    source: str
    first: int
    end: int

    def __post_init__(self):
        if self.source not in ANSWER_SOURCES:
            raise ValueError(f"AnswerSlice.source must be one of {ANSWER_SOURCES}, got {self.source!r}")
        if not 0 <= self.first < self.end:
            raise ValueError(f"AnswerSlice needs 0 <= first < end, got {self.first}-{self.end}")

    @classmethod
    def parse(cls, text: str) -> "AnswerSlice":
        """``SOURCE:FIRST-END`` or ``SOURCE:N`` (batches 0 .. N - 1)."""
        import re

        match = re.fullmatch(r"([\w-]+):(?:(\d+)-)?(\d+)", text)
        if match is None:
            raise ValueError(f"an answer slice is SOURCE:FIRST-END or SOURCE:N, got {text!r}")
        source, first, end = match.groups()
        return cls(source, int(first or 0), int(end))

    @property
    def batches(self) -> range:
        return range(self.first, self.end)

    def __str__(self) -> str:
        return f"{self.source}:{self.first}-{self.end}"


def run(target: LoadedModel, workdir: Path, out: Path, max_tokens: int, cfg: TrainConfig,
        eos_ids: set[int], max_sequences: int | None = None, corpus_root: Path | None = None,
        answers: tuple[AnswerSlice, ...] = (), finetune_steps: int = 0, encode_chat=None, init_head: Path | None = None,
        source: str = "python-docs", seq_len: int = 512, extract_only: bool = False,
        new_vocab: bool = False, fused: bool = False, widen_vocab: int = 0) -> dict | None:
    """Train a head for ``target`` (its runtime dtype is the one whose features the head learns
    to read) and write it to ``out``; returns the model card.

    With ``init_head`` (a head file made by an earlier run for the same target), stage 1 is not
    run: that head is the starting point of stage 2, which then trains on own answers alone (the
    corpus is still built, to know which chunks stage 1 used), and the card keeps the earlier
    run's stage-1 record.

    ``source``: "sharegpt" (chat conversations, :mod:`specdec.training.sharegpt`, formatted by
    ``encode_chat``) or "python-docs" (:mod:`specdec.training.corpus`). ``extract_only``: stop
    after the feature shards are written (a long extraction in stages), or with ``answers``
    (stage 2's own answers, :class:`AnswerSlice`) after they are generated; returns None then.
    ``new_vocab``: stage 2 re-chooses the ids the head drafts from the corpus sequences used and
    the own answers (see :func:`_finetune_on_own_answers`). ``fused``: a new head reads EAGLE-3's
    fused features (:func:`features.fused_layers`), stored under their own names in ``workdir``; a
    head from ``init_head`` reads what it was made to read, or with ``fused`` a last-block head
    becomes a fused one that starts as the same function (:meth:`HeadNet.fuse_as_last_only`).
    ``widen_vocab``: stage 2 from ``init_head`` widens the drafted ids to that many instead
    (:func:`widened_vocab`); it excludes ``new_vocab``."""
    if widen_vocab and new_vocab:
        raise ValueError("widen_vocab and new_vocab exclude each other: one keeps the head's ids and adds more, "
                         "the other chooses them anew")
    workdir.mkdir(parents=True, exist_ok=True)
    layers = features.fused_layers(target.model.cfg.num_layers) if fused else ()
    if init_head is not None and not fused:
        layers = read_head(init_head)[0].feature_layers
    corpus_path = workdir / ("corpus.json" if source == "python-docs" else f"corpus-{source}-{seq_len}.json")
    stages = {}
    t = time.perf_counter()
    if corpus_path.exists():
        data = corpus.load(corpus_path)
        if data["manifest"]["tokens"] < max_tokens * 0.9 and max_sequences is None:
            data = None  # a larger corpus was asked for: rebuild (the old one is its prefix)
    else:
        data = None
    if data is None:
        data = _build_corpus(target, source, max_tokens, seq_len, cfg.seed, corpus_root, encode_chat)
        corpus.save(data, corpus_path)
    sequences = data["sequences"][:max_sequences]
    stages["corpus_seconds"] = round(time.perf_counter() - t, 1)
    sources = {s.split("#")[0] for s in data["manifest"]["sources"][: len(sequences)]}  # chunks the corpus used

    if extract_only:  # everything training will read: the held-out set first (the "before" figures)
        if answers:  # stage 2's data alone: the target's own answers
            if source == "sharegpt":
                held_out_own_answers(target, workdir, encode_chat, eos_ids, layers)
            for part in answers:
                _answer_slice(target, workdir, part, source, sources, eos_ids, encode_chat, corpus_root, layers)
            return None
        if source == "sharegpt":
            held_out_sharegpt(target, workdir, encode_chat, seq_len, layers=layers)
        features.extract(target.model, sequences, workdir / _features_dir(source, seq_len, layers), layers)
        return None
    model = target.model
    full_rows = heads.output_rows(target)  # [V, E] the target's output layer in fp32
    if init_head is not None and not (answers and finetune_steps):
        card = _finetune_on_corpus(target, workdir, data, sequences, cfg, eos_ids, full_rows, init_head, encode_chat,
                                   source, seq_len, out, layers)
        return card
    if init_head is None:
        card, net, dataset, train_ids = _stage1(target, workdir, data, sequences, cfg, eos_ids, full_rows, stages,
                                                workdir / _features_dir(source, seq_len, layers), layers)
        command = _stage1_command(target, max_tokens, max_sequences, cfg) + (" --fused-features" if layers else "")
    else:
        net, card = init_net(init_head, target, full_rows, cfg.seed, layers)
        earlier_dtype, card["target_dtype"] = card.get("target_dtype"), model.dtype_name
        beside = init_head.with_suffix(".json")  # the card written next to it: its command, full records
        full = json.loads(beside.read_text()) if beside.exists() else {}
        command = card.pop("command", None) or full.get("command")
        card = {k: v for k, v in card.items() if k not in ("sha256", "bytes")}
        earlier = card.pop("finetune", None)
        if earlier is not None:
            card["finetune_earlier"] = full.get("finetune", earlier)
        card["init_head"] = {"file": init_head.name, "sha256": hashlib.sha256(init_head.read_bytes()).hexdigest(),
                             "target_dtype": earlier_dtype} | (
            {"earlier": card["init_head"]} if "init_head" in card else {})  # the whole chain of heads stays on record
        dataset, train_ids = Dataset([]), []
        command = command or f"(the command that made {init_head.name} was not recorded)"
    finetune = None
    if answers and finetune_steps:
        finetune = _finetune_on_own_answers(target, net, dataset, train_ids, cfg, workdir, sources, answers,
                                            finetune_steps, eos_ids, encode_chat, full_rows, corpus_root, source,
                                            _checkpoint(workdir, f"finetune-own-{source}", out, layers),
                                            new_vocab_from=sequences if new_vocab else None, layers=layers,
                                            widen_vocab=widen_vocab)
        card["finetune"] = finetune
    stage2 = (f" {_answers_option(answers, source)} --finetune-steps {finetune_steps}"
              + (" --new-vocab" if new_vocab else "")
              + (f" --widen-vocab {widen_vocab}" if widen_vocab else "")) if finetune else ""
    card["features"] = _features_read(layers, model.cfg.num_layers)
    if init_head is None:
        card["command"] = command + stage2 + f" --out {out.name}"
    else:
        card["command"] = (f"{command}; then specdec train-head --target {target.name} --dtype {model.dtype_name} "
                           f"--tokens {max_tokens} --lr {cfg.lr} --seed {cfg.seed} --init-head {init_head.name}"
                           + (" --fused-features" if layers else "")
                           + _loss_options(cfg) + f"{stage2} --out {out.name}")
    _write_head(out, net, card)
    cache.write_atomic(out.with_suffix(".md"), lambda tmp: tmp.write_text(card_markdown(card, out.name)))
    return card


def _write_head(out: Path, net: HeadNet, card: dict) -> None:
    """Write the head ``net`` to ``out`` and its JSON card beside it, recording on the card what
    its reader needs without the head file: how many ids it drafts, the file's sha256 and size."""
    card["drafted_ids"] = net.vocab_ids.numel()
    save_head(out, net.cfg, net.export(), net.vocab_ids, card)
    card["sha256"] = hashlib.sha256(out.read_bytes()).hexdigest()
    card["bytes"] = out.stat().st_size
    write_json(out.with_suffix(".json"), card)


def _checkpoint(workdir: Path, stage: str, out: Path, layers: tuple[int, ...] = ()) -> Path:
    """A continuing stage's checkpoint, named after the head it writes: the stages of a chain (and
    a replay of earlier stages' answers) share one workdir, whose features they all read, while
    each resumes only its own run (``train`` refuses a checkpoint that another run started)."""
    return workdir / f"{stage}-{out.stem}{_fused_suffix(layers)}.pt"


def _features_dir(source: str, seq_len: int, layers: tuple[int, ...] = ()) -> str:
    return ("features" if source == "python-docs" else f"features-{source}-{seq_len}") + _fused_suffix(layers)


def _features_read(layers: tuple[int, ...], num_layers: int) -> str:
    """The card's words for what the head reads."""
    if not layers:
        return "the target's last block output"
    return f"fused (EAGLE-3): the outputs of blocks {', '.join(map(str, layers))} and {num_layers - 1} (0-based)"


def _fused_suffix(layers: tuple[int, ...]) -> str:
    """What tells fused feature shards from the last block's in a work directory's names."""
    return "".join(f"-{i}" for i in ("fused",) + layers) if layers else ""


def init_net(init_head: Path, target: LoadedModel, full_rows, seed: int = 0,
             layers: tuple[int, ...] | None = None) -> tuple[HeadNet, dict]:
    """The head in ``init_head`` as a trainable net reading ``layers`` (None: the blocks it was made
    for), and its card: a head that reads the last block's features alone, asked to read fused
    ones, starts as the same function. ``full_rows`` [V, E]: the target's output rows.
    The head must have been made for ``target``; another runtime dtype of it is a continuation
    (its features differ by rounding, q4 against q4k, and the head learns the ones it will read;
    the new card records the earlier dtype under ``init_head``)."""
    model = target.model
    head_cfg, state, vocab_ids, card = read_head(init_head)
    layers = head_cfg.feature_layers if layers is None else layers
    if card.get("target") != target.name:
        raise ValueError(f"init_head {init_head} was trained for {card.get('target')}, not {target.name}")
    if head_cfg.target_vocab_size != model.vocab_size or head_cfg.hidden_size != model.cfg.hidden_size:
        raise ValueError(f"init_head {init_head} was trained for another target")
    if head_cfg.feature_layers not in ((), layers):
        raise ValueError(f"init_head {init_head} reads blocks {head_cfg.feature_layers}, not {layers}")
    net = HeadNet(replace(head_cfg, feature_layers=layers), vocab_ids, model.embed, model.final_norm,
                  full_rows[vocab_ids], seed)
    if layers and not head_cfg.feature_layers:
        state = state | net.fuse_as_last_only()
    net.load_export(state)
    return net, card


def _build_corpus(target, source, max_tokens, seq_len, seed, root, encode_chat) -> dict:
    """The training sequences of ``source`` with a manifest (see :func:`run`)."""
    if source == "python-docs":
        return corpus.build(target.tokenizer, max_tokens, seq_len=seq_len, seed=seed, root=root)
    if source != "sharegpt":
        raise ValueError(f"source must be 'sharegpt' or 'python-docs', got {source!r}")
    from specdec.training import sharegpt

    data = sharegpt.build(lambda msgs: encode_chat(msgs, add_generation_prompt=False), seq_len, max_tokens)
    m = data["manifest"]
    keep = max(1, len(data["sequences"]) // features.SHARD) * features.SHARD  # whole shards (see corpus.build)
    data["sequences"] = data["sequences"][:keep]
    m["sources"] = m.pop("conversation_ids")[:keep]
    m["tokens"], m["sequences"] = sum(len(s) for s in data["sequences"]), keep
    m["packages"] = [f"{m['source']['package']}==0.1.0"]
    return data


def _stage1(target, workdir, data, sequences, cfg, eos_ids, full_rows, stages, feature_dir, layers=()):
    """Features of the corpus, the vocabulary subset, training and held-out evaluation; returns the
    card so far, the head, the corpus dataset and its training ids."""
    t = time.perf_counter()
    features.extract(target.model, sequences, feature_dir, layers)
    stages["extract_seconds_this_run"] = round(time.perf_counter() - t, 1)
    shards = features.load_shards(feature_dir)[: (len(sequences) + features.SHARD - 1) // features.SHARD]
    dataset = Dataset(shards)
    train_ids, held_ids = split(len(dataset), cfg.held_out_every)
    model = target.model
    vocab_ids = vocab_subset([dataset.rows[i][0] for i in train_ids], cfg.vocab_size, eos_ids, model.vocab_size)
    net = HeadNet(replace(head_config(model.cfg, cfg), feature_layers=layers), vocab_ids, model.embed, model.final_norm,
                  full_rows[vocab_ids], cfg.seed)
    log = train(net, dataset, train_ids, cfg, workdir / f"checkpoint{_fused_suffix(layers)}.pt")
    write_json(workdir / "losses.json", log)
    t = time.perf_counter()
    scores = evaluate(net, dataset, held_ids, cfg.passes, full_rows)
    stages["eval_seconds"] = round(time.perf_counter() - t, 1)
    train_tokens = sum(dataset.rows[i][0].shape[0] for i in train_ids)
    card = {
        "target": target.name,
        "target_dtype": model.dtype_name,
        "train_config": asdict(cfg), "training_precision": precision(),
        "corpus": {k: v for k, v in data["manifest"].items() if k != "sources"} | {
            "sequences_used": len(sequences), "train_tokens": train_tokens,
            "held_out_sequences": len(held_ids)},
        "training_seconds": round(log["seconds"], 1),
        "final_losses": log["loss"][-1] if log["loss"] else None,
        "held_out": scores,
        "stages": stages,
    }
    return card, net, dataset, train_ids


def answer_header(encode_chat) -> list[int]:
    """The chat template's assistant header (e.g. ``<|im_start|>assistant\n``): what a generation
    prompt adds to a conversation."""
    convo = [{"role": "user", "content": "x"}]
    with_prompt, without = encode_chat(convo), encode_chat(convo, add_generation_prompt=False)
    if with_prompt[: len(without)] != without or len(with_prompt) == len(without):
        raise ValueError("cannot find the chat template's assistant header")
    return with_prompt[len(without):]


def held_out_sharegpt(target, workdir: Path, encode_chat, seq_len: int, tokens: int = 12_000,
                      layers: tuple[int, ...] = ()) -> Dataset:
    """Features of the held-out ShareGPT conversations (a split by conversation id: never trained
    on), about ``tokens`` of them; extracted once into the work directory. 12k tokens (~6k of them
    answers) put a standard error of ~0.006 on an acceptance rate, and cost ~7 minutes of one core
    at the q4 runtime's 28 tokens/s prefill on an AVX2 EPYC."""
    from specdec.training import sharegpt

    path = workdir / f"held-out-sharegpt-{seq_len}-{tokens}.json"
    if path.exists():
        data = corpus.load(path)
    else:
        data = sharegpt.build(lambda msgs: encode_chat(msgs, add_generation_prompt=False), seq_len, tokens,
                              split="held_out")
        corpus.save(data, path)
    directory = workdir / f"features-sharegpt-{seq_len}-held-out-{tokens}{_fused_suffix(layers)}"
    features.extract(target.model, data["sequences"], directory, layers)
    return Dataset(features.load_shards(directory))


def _finetune_on_corpus(target, workdir, data, sequences, cfg, eos_ids, full_rows, init_head, encode_chat, source,
                        seq_len, out, layers=()) -> dict:
    """Stage 1 from an existing head (``init_head``, same target): train it further on the
    corpus's features (top-k labels, answers only when ``cfg.answers_only``), then evaluate the
    head before and after on held-out ShareGPT conversations; returns the card."""
    model = target.model
    net, old_card = init_net(init_head, target, full_rows, cfg.seed, layers)
    feature_dir = workdir / _features_dir(source, seq_len, layers)
    t = time.perf_counter()
    features.extract(model, sequences, feature_dir, layers)
    extract_s = time.perf_counter() - t
    shards = features.load_shards(feature_dir)[: (len(sequences) + features.SHARD - 1) // features.SHARD]
    dataset = Dataset(shards)
    header = answer_header(encode_chat) if cfg.answers_only else None
    if source == "sharegpt":  # held out by conversation, never trained on
        held, train_ids = held_out_sharegpt(target, workdir, encode_chat, seq_len, layers=layers), list(range(len(dataset)))
        held_ids = list(range(len(held)))
    else:
        held = dataset
        train_ids, held_ids = split(len(dataset), cfg.held_out_every)
    # batch 1: the target's full-vocabulary p of a 1,024-token window is 0.6 GB in fp32 (batch 4
    # with its temporaries was killed for memory on a 24 GB machine)
    before = evaluate(net, held, held_ids, cfg.passes, full_rows, batch=1, answer_header=header, ends=eos_ids)
    log = train(net, dataset, train_ids, cfg, _checkpoint(workdir, f"finetune-{source}-{seq_len}", out, layers),
                answer_header=header, ends=eos_ids)
    write_json(workdir / f"losses-{source}-{seq_len}-{out.stem}.json", log)
    after = evaluate(net, held, held_ids, cfg.passes, full_rows, batch=1, answer_header=header, ends=eos_ids)
    card = {
        "target": target.name, "target_dtype": model.dtype_name, "train_config": asdict(cfg),
        "training_precision": precision(),
        "init_head": {"file": init_head.name, "sha256": hashlib.sha256(init_head.read_bytes()).hexdigest(),
                      "target_dtype": old_card.get("target_dtype"),
                      "card": {k: old_card.get(k) for k in ("corpus", "held_out", "finetune") if k in old_card}},
        "corpus": {k: v for k, v in data["manifest"].items() if k != "sources"} | {
            "sequences_used": len(train_ids), "train_tokens": sum(dataset.rows[i][0].shape[0] for i in train_ids)},
        "training_seconds": round(log["seconds"], 1), "extract_seconds_this_run": round(extract_s, 1),
        "final_losses": log["loss"][-1] if log["loss"] else None,
        "held_out_eval": {"set": "ShareGPT held-out conversations" if source == "sharegpt" else
                          f"every {cfg.held_out_every}th corpus sequence", "sequences": len(held_ids),
                          "answers_only": header is not None, "before": before, "after": after},
    }
    card["held_out"] = after
    card["features"] = _features_read(layers, model.cfg.num_layers)
    card["command"] = (f"specdec train-head --target {target.name} --dtype {model.dtype_name} --corpus {source} "
                       f"--seq-len {seq_len} --sequences {len(sequences)} --init-head {init_head.name} "
                       f"--steps {cfg.steps} --batch {cfg.batch_sequences} --lr {cfg.lr}"
                       + _loss_options(cfg) + (" --fused-features" if layers else "")
                       + f" --out {out.name}")
    _write_head(out, net, card)
    return card


def _stage1_command(target, max_tokens, max_sequences, cfg) -> str:
    return (f"specdec train-head --target {target.name} --dtype {target.model.dtype_name} --tokens {max_tokens}"
            + (f" --sequences {max_sequences}" if max_sequences else "")
            + f" --steps {cfg.steps} --batch {cfg.batch_sequences} --lr {cfg.lr} --vocab-size {cfg.vocab_size}"
            f" --intermediate-size {cfg.intermediate_size} --passes {cfg.passes} --seed {cfg.seed}" + _loss_options(cfg))


def _loss_options(cfg: TrainConfig) -> str:
    """The command-line options of ``cfg``'s loss, as a card records them."""
    return ((f" --label-top-k {cfg.label_top_k}" if cfg.label_top_k else "")
            + (" --answers-only" if cfg.answers_only else "")
            + (f" --chain-share {cfg.chain_share:g}" if cfg.chain_share != 1 else ""))


def own_answers(target, directory: Path, prompts: list[list[dict]], batches: int | range, eos_ids, encode_chat,
                layers: tuple[int, ...] = ()) -> Dataset:
    """The target's answers to ``prompts``, ``ANSWER_BATCH`` at a time (batch b answers
    ``prompts[16 b : 16 b + 16]``, greedy and T = 0.7 in turn), with its features recorded while it
    generates: one shard per batch in ``directory``, so an interrupted run resumes at the first
    missing batch. ``batches``: a count (batches 0 .. n - 1) or a range of batch indices."""
    from specdec.sampling import SamplingParams

    directory.mkdir(parents=True, exist_ok=True)
    room = target.model.cfg.max_position_embeddings
    t = time.perf_counter()
    made = 0
    batches = range(batches) if isinstance(batches, int) else batches
    for b in batches:
        path = features.shard_path(directory, b)
        group = prompts[b * ANSWER_BATCH : (b + 1) * ANSWER_BATCH]
        if path.exists() or not group:
            continue
        ids = [encode_chat(p)[-min(384, room // 2):] for p in group]  # a long prompt's end: the assistant's turn
        params = SamplingParams(temperature=ANSWER_TEMPERATURES[b % len(ANSWER_TEMPERATURES)])
        rows = features.generate_with_features(target.model, ids, params, min(ANSWER_TOKENS, room // 2), eos_ids, seed=b,
                                               layers=layers)
        features.write_shard(path, rows)
        made += sum(len(r[0]) for r in rows)
        cache.notice(f"own answers: batch {b + 1}/{batches.stop} in {directory.name} "
                     f"({time.perf_counter() - t:.0f} s, {made / (time.perf_counter() - t):.1f} feature tokens/s)")
    paths = [features.shard_path(directory, b) for b in batches]  # a batch past the prompts' end has none
    return Dataset([features.load_shard(path) for path in paths if path.exists()])


def answer_prompts(source: str, count: int, encode_chat, used_sources: set[str], corpus_root: Path | None,
                   split: str = "train") -> list[list[dict]]:
    """Requests for the target to answer itself: ShareGPT user turns of ``split``
    (:func:`sharegpt.prompts`), requests to translate their English paragraphs
    (:func:`sharegpt.translation_prompts`), or prompts derived from unused python-docs chunks."""
    from specdec.training import sharegpt

    if source == "sharegpt":
        return sharegpt.prompts(encode_chat, count, split=split)
    if source == "sharegpt-translate":
        return sharegpt.translation_prompts(count, split=split)
    return corpus.answer_prompts(used_sources, count, root=corpus_root)


def _answer_slice(target, workdir: Path, part: AnswerSlice, run_source: str, run_sources: set[str], eos_ids,
                  encode_chat, corpus_root: Path | None, layers: tuple[int, ...]) -> Dataset:
    """The own answers ``part`` names, generated where missing. Python-docs requests come from
    chunks no corpus stage used: those of this run's corpus when it is python-docs, else every
    chunk of ``workdir``'s python-docs corpus (none when it has none)."""
    if part.source == run_source:
        used = run_sources
    elif (workdir / "corpus.json").exists():
        used = {s.split("#")[0] for s in corpus.load(workdir / "corpus.json")["manifest"]["sources"]}
    else:
        used = set()
    prompts = answer_prompts(part.source, part.end * ANSWER_BATCH, encode_chat, used, corpus_root)
    if len(prompts) <= part.first * ANSWER_BATCH:
        raise ValueError(f"answers {part}: {part.source} gives {len(prompts)} requests here, fewer than batch "
                         f"{part.first} needs ({ANSWER_BATCH} per batch)")
    return own_answers(target, own_answer_dir(workdir, part.source, layers), prompts, part.batches, eos_ids,
                       encode_chat, layers)


def _answers_option(answers: tuple[AnswerSlice, ...], source: str) -> str:
    """The train-head option that names ``answers``: ``--answer-batches N`` for the run's own
    source from batch 0, else ``--answers SLICE ...``."""
    if len(answers) == 1 and answers[0].source == source and answers[0].first == 0:
        return f"--answer-batches {answers[0].end}"
    return "--answers " + " ".join(map(str, answers))


_PROMPTS = {"sharegpt": "ShareGPT user turns", "python-docs": "requests derived from unused python-docs chunks",
            "sharegpt-translate": "requests to translate ShareGPT's English paragraphs"}

NEW_VOCAB_FREQUENT_SHARE = 0.75  # chosen on held-out own answers (see vocab_subset)
HELD_OUT_ANSWER_BATCHES = 2  # 32 held-out ShareGPT requests, ~7k answer tokens: a standard error of ~0.006


def held_out_own_answers(target, workdir: Path, encode_chat, eos_ids, layers: tuple[int, ...] = (),
                         source: str = "sharegpt") -> Dataset:
    """The target's own answers to held-out ``source`` requests (from conversations never trained
    on): the text a head drafts at inference, so the evaluation closest to the bench's.
    "sharegpt-translate" gives its translations of held-out English paragraphs instead."""
    prompts = answer_prompts(source, HELD_OUT_ANSWER_BATCHES * ANSWER_BATCH, encode_chat, set(), None,
                             split="held_out")
    return own_answers(target, workdir / f"own-answers-{source}-held-out{_fused_suffix(layers)}", prompts,
                       HELD_OUT_ANSWER_BATCHES, eos_ids, encode_chat, layers)


def own_answer_dir(workdir: Path, source: str, layers: tuple[int, ...] = ()) -> Path:
    return workdir / (("own-answers" if source == "python-docs" else f"own-answers-{source}") + _fused_suffix(layers))


def _finetune_on_own_answers(target, net, corpus_data, corpus_train, cfg, workdir, used_sources, answers, steps,
                             eos_ids, encode_chat, full_rows, corpus_root, source, checkpoint: Path, new_vocab_from=None,
                             layers=(), widen_vocab: int = 0) -> dict:
    """Stage 2: the target answers requests (``answers``, :class:`AnswerSlice`; greedy and T = 0.7
    in turn, its features recorded while it generates), then the head is fine-tuned on those answers mixed
    with as many corpus sequences (none when stage 1 ran earlier: ``corpus_data`` is empty), at a
    third of the learning rate. Evaluated on held-out own answers: answers to held-out ShareGPT
    conversations for ``source`` "sharegpt", else every 10th own answer. Training resumes from
    ``checkpoint`` (:func:`_checkpoint`). ``widen_vocab``: first widen the drafted ids to that many
    (:func:`widened_vocab`)."""
    net.load_export({k: v.half() for k, v in net.export().items()})  # start from the stage-1 head as saved (fp16)
    t = time.perf_counter()
    own = Dataset([])
    for part in answers:
        own.rows += _answer_slice(target, workdir, part, source, used_sources, eos_ids, encode_chat, corpus_root,
                                  layers).rows
    if source == "sharegpt":
        held = held_out_own_answers(target, workdir, encode_chat, eos_ids, layers)
        own_train, own_held = list(range(len(own))), list(range(len(own), len(own) + len(held)))
    else:
        held = Dataset([])
        own_train, own_held = split(len(own), 10)
    generate_s = time.perf_counter() - t
    mixed = Dataset([])
    mixed.rows = own.rows + held.rows + corpus_data.rows
    offset = len(own.rows) + len(held.rows)
    train_ids = own_train + [offset + i for i in corpus_train[: len(own_train)]]
    header = answer_header(encode_chat) if cfg.answers_only else None
    # scored: the target's own answer alone (a ShareGPT multi-turn request's context holds a human's
    # answer); with no header to find it by (answers_only off, python-docs prompts) every slot
    scoring = header or (answer_header(encode_chat) if source == "sharegpt" else None)
    scored = {"batch": 1, "answer_header": scoring, "ends": eos_ids, "last_answer_only": scoring is not None}
    before = evaluate(net, mixed, own_held, cfg.passes, full_rows, **scored)
    vocab_record = None
    if new_vocab_from is not None:
        rows = [own.rows[i][0] for i in own_train] + [torch.tensor(ids) for ids in new_vocab_from]
        old_ids = net.vocab_ids
        ids = vocab_subset(rows, old_ids.numel(), eos_ids, full_rows.shape[0], NEW_VOCAB_FREQUENT_SHARE)
        net.set_vocab(ids, full_rows[ids])
        vocab_record = {"size": ids.numel(), "frequent_share": NEW_VOCAB_FREQUENT_SHARE,
                        "kept_from_before": int(torch.isin(ids, old_ids).sum()),
                        "chosen_from_tokens": sum(int((r >= 0).sum()) for r in rows),
                        "before_training": evaluate(net, mixed, own_held, cfg.passes, full_rows, **scored)}
    if widen_vocab:
        old_ids = net.vocab_ids
        ids = widened_vocab(old_ids, [own.rows[i][0] for i in own_train], widen_vocab, full_rows.shape[0])
        net.set_vocab(ids, full_rows[ids])
        vocab_record = {"size": ids.numel(), "widened_from": old_ids.numel(),
                        "before_training": evaluate(net, mixed, own_held, cfg.passes, full_rows, **scored)}
    ft_cfg = TrainConfig(**{**asdict(cfg), "steps": steps, "lr": cfg.lr * 0.3, "warmup": 5, "seed": cfg.seed + 1,
                            "checkpoint_every": 10})
    log = train(net, mixed, train_ids, ft_cfg, checkpoint, answer_header=header, ends=eos_ids)
    after = evaluate(net, mixed, own_held, cfg.passes, full_rows, **scored)
    record = {"own_answer_sequences": len(own), "own_answer_tokens": sum(r[0].shape[0] for r in own.rows),
            "prompts": " and ".join(dict.fromkeys(_PROMPTS[part.source] for part in answers)),
            "answers": [str(part) for part in answers],
            "own_train": len(own_train), "own_held_out": len(own_held), "corpus_mixed_in": len(train_ids) - len(own_train),
            "temperatures": _temperatures_used(answers), "answers_only": header is not None,
            "steps": steps, "lr": ft_cfg.lr, "chain_share": ft_cfg.chain_share, "precision": precision(),
            "seconds": round(log["seconds"], 1),
            "generate_seconds_this_run": round(generate_s, 1),
            "held_out_own_answers_before": before, "held_out_own_answers_after": after}
    return record | ({"new_vocab": vocab_record} if vocab_record else {})


def widened_vocab(old_ids: torch.Tensor, token_rows: list[torch.Tensor], size: int, vocab: int) -> torch.Tensor:
    """``size`` drafted ids, sorted: every one of ``old_ids``, then the ids ``token_rows`` use most
    that ``old_ids`` lacks, then the lowest unused ids. Nothing trained is lost: a head's output
    is scored by the target's own rows (not stored), so a new id is drafted from the first step,
    and training teaches the head when to.

    Why: the ids a head was first given follow its first corpus. Text it meets later (the target's
    translations into French or German) is written in pieces outside them: 16,384 ids chosen on
    ShareGPT and python-docs cover only 0.69 of the target's tokens in its held-out translations,
    so no draft there can be accepted more often than that. Widening by those answers' own ids
    to 20,480 covers 0.86 (mix9, the shipped head; docs/HEAD-TRAINING.md, 'Stage 11')."""
    if not old_ids.numel() < size <= vocab:
        raise ValueError(f"widen_vocab must be above the head's {old_ids.numel()} ids and at most the target's "
                         f"{vocab}, got {size}")
    return vocab_subset(token_rows, size, set(old_ids.tolist()), vocab)


def _temperatures_used(answers: tuple[AnswerSlice, ...]) -> str:
    """How the own answers were sampled, e.g. 'greedy and T = 0.7 in turn'."""
    temps = sorted({ANSWER_TEMPERATURES[b % len(ANSWER_TEMPERATURES)] for part in answers for b in part.batches})
    names = ["greedy" if t == 0 else f"T = {t:g}" for t in temps]
    return " and ".join(names) + (" in turn" if len(names) > 1 else "")


def _stage2_line(f: dict, title: str, init: dict | None) -> str:
    vocab = f.get("new_vocab")
    return (
        f"\n- **{title} (own answers):** the target answered {f['own_answer_sequences']} requests "
        f"({f.get('prompts', 'derived from unused corpus chunks')}; {f.get('own_answer_tokens', '?')} tokens, "
        f"{f.get('temperatures', 'greedy')}, features recorded while it generated); {f['steps']} fine-tuning steps at "
        f"lr {f['lr']:g} on them"
        + (f", chains from {f['chain_share']:g} of the slots" if f.get("chain_share", 1) != 1 else "")
        + (f", in {f['precision']}" if "precision" in f else "")  # a stage's own; the card's top level is stage 1's
        + (" mixed with as many corpus sequences" if f.get("corpus_mixed_in") else "")
        + (f", starting from `{init['file']}` (sha256 `{init['sha256'][:16]}…`)" if init else "")
        + (f"; drafted ids re-chosen ({vocab['kept_from_before']} of {vocab['size']} kept)"
           if vocab and "kept_from_before" in vocab else "")
        + (f"; drafted ids widened from {vocab['widened_from']} to {vocab['size']}" if vocab and "widened_from" in vocab else "")
        + f". Held-out own answers, greedy acceptance per position: {f['held_out_own_answers_before']['greedy']} "
        f"before, {f['held_out_own_answers_after']['greedy']} after.")


def _corpus_line(card: dict) -> str:
    c, t = card["corpus"], card["train_config"]
    if "held_out_sequences" in c:  # stage 1 from scratch: every n-th corpus sequence held out
        return (f"\n- **Stage 1 (corpus):** {c['sequences_used']} chat-formatted sequences (<= {c['seq_len']} tokens) "
                f"from {', '.join(c.get('packages', [])[:3]) or 'the corpus'}{' and more' if len(c.get('packages', [])) > 3 else ''}; "
                f"{c['train_tokens']} training tokens, every {t['held_out_every']}th sequence held out "
                f"({c['held_out_sequences']} sequences); {t['steps']} steps x {t['batch_sequences']} sequences, "
                f"AdamW lr {t['lr']} (warm-up, cosine), {card['training_seconds'] / 60:.0f} min.")
    e = card.get("held_out_eval", {})
    return (f"\n- **Corpus fine-tune:** {c['sequences_used']} windows (<= {c['seq_len']} tokens) of "
            f"{', '.join(c.get('packages', []))}, {c['train_tokens']} tokens; {t['steps']} steps x "
            f"{t['batch_sequences']} windows at lr {t['lr']}, top-{t.get('label_top_k')} labels"
            + (", answers only" if t.get("answers_only") else "")
            + (f", chains from {t['chain_share']:g} of the slots" if t.get("chain_share", 1) != 1 else "")
            + f", {card['training_seconds'] / 60:.0f} min. "
            f"{e.get('set', 'Held out')}, greedy acceptance per position: {e.get('before', {}).get('greedy')} before, "
            f"{e.get('after', {}).get('greedy')} after.")


def card_markdown(card: dict, file_name: str) -> str:
    """A short human-readable model card from the JSON card: what the head is, each stage that
    made it (oldest first, following ``init_head``), and the held-out figures each one recorded."""
    t = card["train_config"]
    drafted = card.get("drafted_ids", t["vocab_size"])  # older cards: stage 1's (every shipped card records it)
    stages, init = [], card.get("init_head")
    while init is not None:  # the chain of heads this one was trained from, newest first
        if "card" in init:  # a head trained further on a corpus kept its starting head's card
            stages.insert(0, f"\n- **Started from `{init['file']}`** (sha256 `{init['sha256'][:16]}…`), whose own "
                             f"held-out greedy acceptance was {init['card'].get('held_out', {}).get('greedy')}.")
        init = init.get("earlier")
    stages.append(_corpus_line(card))
    stages += [_stage2_line(card[key], title, card.get("init_head") if key == "finetune" else None)
               for key, title in (("finetune_earlier", "Stage 2, first round"), ("finetune", "Stage 2"))
               if key in card]
    note = f"\n- **Note:** {card['note']}" if card.get("note") else ""
    h = card["held_out"]
    rows = "\n".join(f"| {i + 1} | {g:.3f} | {a:.3f} |" for i, (g, a) in enumerate(zip(h["greedy"], h["alpha"])))
    return f"""# Draft head `{file_name}`

An EAGLE-style draft head for **{card['target']}** (features of its `{card['target_dtype']}` runtime),
trained by `specdec train-head` on a CPU (the first stage in {card.get('training_precision', 'fp32')}; a later stage's
precision, where recorded, is on its line). See `specdec/runtime/head.py`.

- **Reads:** {card.get('features', "the target's last block output")}.
- **Architecture:** RMS-normalised target feature + token embedding -> fc (2E -> E) -> one decoder
  layer (the target's attention shape, MLP width {t['intermediate_size']}) -> the target's final norm
  and output rows for {drafted} token ids (the rest are never drafted).
- **Labels:** the target's own next-token distribution (distillation), draft steps 1..{t['passes']}
  trained with the head reading its own guesses.{''.join(stages)}
- **Reproduce:** `{card['command']}`{note}
- **File:** {_file_line(card)}

Held-out acceptance per draft position recorded with the corpus stage (teacher-forced tokens, the
head's own features; greedy = argmax agreement with the target, sampled = sum min(p, q) at T = 1,
each given the earlier positions right); the subset covers the target's argmax at
{h['subset_covers_argmax']:.1%} of those positions:

| position | greedy | sampled (T = 1) |
|---|---|---|
{rows}
{_evaluation_markdown(card)}"""


def _file_line(card: dict) -> str:
    """The head's file: its size and sha256."""
    return f"{card['bytes'] / 1e6:.1f} MB, sha256 `{card['sha256']}`"


def _evaluation_markdown(card: dict) -> str:
    """The shipping evaluation (``specdec/training/head_card.py``), where the card has one: held-out
    sets, the bench's categories and the learning curve, each per draft position."""
    def pos(values) -> str:
        return " / ".join("-" if v is None else f"{v:.3f}" for v in values)

    parts = []
    if "machine" in card:
        parts.append(f"\n## Evaluation\n\nTaken on {card['machine']}.")
    for name, result in card.get("held_out_eval_sets", {}).items():
        rows = "\n".join(f"| {t} | {pos(r['greedy'])} | {pos(r['alpha'])} | {r['slots']} |"
                          for t, r in result["by_temperature"].items())
        parts.append(f"\n**Held-out {name}** (teacher-forced; `specdec/training/head_eval.py`), per draft position:\n\n"
                     f"| T (sampled) | greedy | sampled | slots |\n|---|---|---|---|\n{rows}")
    bench = card.get("bench_acceptance")
    if bench:
        rows = []
        for t, r in bench["by_temperature"].items():
            rows += [f"| {t} | {c} | {pos(v['per_position'])} | {v['calls']} |" for c, v in r["categories"].items()]
            rows.append(f"| {t} | **median (pooled)** | {r['median_first']:.3f} ({r['pooled_first']:.3f}) | |")
        parts.append(f"\n**On the bench's categories** (`{bench['command']}`; accepted / reached at each draft "
                     "position, pooled over the category's prompts):\n\n| T | category | per position | calls "
                     "reaching 1 |\n|---|---|---|---|\n" + "\n".join(rows))
    curve = card.get("learning_curve")
    if curve:
        rows = "\n".join(f"| {c['head']} | {c['chat_tokens']:,} | {pos(c['greedy'])} | {pos(c['alpha'])} |" for c in curve)
        parts.append("\n**Learning curve** (held-out own answers, the same slots for every head; chat tokens: "
                     "ShareGPT text and own answers trained on, cumulative):\n\n| head | chat tokens | greedy | "
                     f"sampled (T = 1) |\n|---|---|---|---|\n{rows}")
    return "\n".join(parts) + ("\n" if parts else "")


def default_workdir(target_name: str, dtype: str) -> Path:
    return cache.home() / "train-head" / f"{Path(target_name).stem}-{dtype}"


def summary(card: dict) -> str:
    """One line on the newest stage: stage 2's held-out own answers before and after when this run
    made one, else the corpus stage's held-out figures."""
    f = card.get("finetune")
    if f is not None:
        b, a = f["held_out_own_answers_before"], f["held_out_own_answers_after"]
        return (f"held-out own answers, acceptance per draft position (teacher-forced): greedy {b['greedy']} before, "
                f"{a['greedy']} after; sampled (T=1) {b['alpha']} before, {a['alpha']} after; fine-tuned "
                f"{f['seconds'] / 60:.1f} min on {f['own_answer_tokens']} tokens of own answers")
    h = card["held_out"]
    return (f"held-out acceptance per draft position (teacher-forced): greedy {h['greedy']}, "
            f"sampled (T=1) {h['alpha']}; subset covers the target's argmax {h['subset_covers_argmax']:.1%}; "
            f"trained {card['training_seconds'] / 60:.1f} min on {card['corpus']['train_tokens']} tokens")



