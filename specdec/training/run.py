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
from specdec.training.recipe import AnswerSlice, HeadRecipe
from specdec.training.train import (Dataset, TrainConfig, evaluate, head_config, precision, split, train, vocab_subset,
                                    write_json)


ANSWER_BATCH = 16
ANSWER_TOKENS = 256
ANSWER_TEMPERATURES = (0.0, 0.7)  # batch b answers at ANSWER_TEMPERATURES[b % 2]: greedy and sampled text
FEATURES_READ = "the target's last block output"  # what every head reads (its card says so)


def run(target: LoadedModel, recipe: HeadRecipe, workdir: Path, out: Path, eos_ids: set[int],
        encode_chat) -> dict | None:
    """Run ``recipe`` for ``target`` (its runtime dtype is the one whose features the head learns
    to read) and write the head to ``out`` with its card; returns the card (None with
    ``extract_only``). Stages: corpus -> features or own answers -> training -> evaluation ->
    card, each kept in ``workdir`` and skipped when already there (an interrupted run resumes).
    ``encode_chat``: the target's chat encoding (``TextGenerator.encode_chat``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    data, corpus_seconds = corpus_stage(target, recipe, workdir, encode_chat)
    sequences = data["sequences"][: recipe.sequences]
    used = {s.split("#")[0] for s in data["manifest"]["sources"][: len(sequences)]}  # chunks the corpus used
    if recipe.extract_only:
        extract_stage(target, recipe, workdir, sequences, used, eos_ids, encode_chat)
        return None
    full_rows = heads.output_rows(target)  # [V, E] the target's output layer in fp32
    if recipe.init_head is not None and not recipe.stage2:
        card = _finetune_on_corpus(target, recipe, workdir, data, sequences, eos_ids, full_rows, encode_chat, out)
        return card
    if recipe.init_head is None:
        card, net, dataset, train_ids = _stage1(target, recipe, workdir, data, sequences, eos_ids, full_rows)
        card["stages"]["corpus_seconds"] = corpus_seconds
    else:
        net, card = _continued(target, recipe, full_rows)
        dataset, train_ids = Dataset([]), []
    if recipe.stage2:
        checkpoint = _checkpoint(workdir, f"finetune-own-{recipe.source}", out)
        card["finetune"] = _finetune_on_own_answers(target, recipe, net, dataset, train_ids, sequences, workdir, used,
                                                    eos_ids, encode_chat, full_rows, checkpoint)
    card["features"] = FEATURES_READ
    command = recipe.command(target.name, target.model.dtype_name, out.name)
    card["command"] = command if recipe.init_head is None else f"{card.pop('command')}; then {command}"
    _write_head(out, net, card)
    cache.write_atomic(out.with_suffix(".md"), lambda tmp: tmp.write_text(card_markdown(card, out.name)))
    return card


def corpus_stage(target: LoadedModel, recipe: HeadRecipe, workdir: Path, encode_chat) -> tuple[dict, float]:
    """The corpus (built once into ``workdir``; rebuilt when a larger one is asked for, the old one
    being its prefix) and the seconds it took here."""
    t = time.perf_counter()
    name = "corpus.json" if recipe.source == "python-docs" else f"corpus-{recipe.source}-{recipe.seq_len}.json"
    path = workdir / name
    data = corpus.load(path) if path.exists() else None
    if data is not None and data["manifest"]["tokens"] < recipe.tokens * 0.9 and recipe.sequences is None:
        data = None
    if data is None:
        data = _build_corpus(target, recipe.source, recipe.tokens, recipe.seq_len, recipe.train.seed,
                             recipe.corpus_root, encode_chat)
        corpus.save(data, path)
    return data, round(time.perf_counter() - t, 1)


def extract_stage(target, recipe: HeadRecipe, workdir: Path, sequences, used: set[str], eos_ids, encode_chat) -> None:
    """Everything training will read, the held-out set first (the "before" figures): the corpus's
    features, or with ``answers`` stage 2's data alone, the target's own answers."""
    sharegpt = recipe.source == "sharegpt"
    if recipe.answers:
        if sharegpt:
            held_out_own_answers(target, workdir, encode_chat, eos_ids)
        for part in recipe.answers:
            _answer_slice(target, workdir, part, recipe.source, used, eos_ids, encode_chat, recipe.corpus_root)
        return
    if sharegpt:
        held_out_sharegpt(target, workdir, encode_chat, recipe.seq_len)
    features.extract(target.model, sequences, workdir / _features_dir(recipe.source, recipe.seq_len))


def _continued(target, recipe: HeadRecipe, full_rows) -> tuple[HeadNet, dict]:
    """Stage 2's starting point from ``recipe.init_head``: the net and the card to go on, which
    keeps the earlier head on record (its file and sha256, and the chain of heads before it) and
    its command under ``command`` (what this run's is appended to)."""
    init_head = Path(recipe.init_head)
    net, card = init_net(init_head, target, full_rows, recipe.train.seed)
    earlier_dtype, card["target_dtype"] = card.get("target_dtype"), target.model.dtype_name
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
    card["command"] = command or f"(the command that made {init_head.name} was not recorded)"
    return net, card


def _write_head(out: Path, net: HeadNet, card: dict) -> None:
    """Write the head ``net`` to ``out`` and its JSON card beside it, recording on the card what
    its reader needs without the head file: how many ids it drafts, the file's sha256 and size."""
    card["drafted_ids"] = net.vocab_ids.numel()
    save_head(out, net.cfg, net.export(), net.vocab_ids, card)
    card["sha256"] = hashlib.sha256(out.read_bytes()).hexdigest()
    card["bytes"] = out.stat().st_size
    write_json(out.with_suffix(".json"), card)


def _checkpoint(workdir: Path, stage: str, out: Path) -> Path:
    """A continuing stage's checkpoint, named after the head it writes: the stages of a chain (and
    a replay of earlier stages' answers) share one workdir, whose features they all read, while
    each resumes only its own run (``train`` refuses a checkpoint that another run started)."""
    return workdir / f"{stage}-{out.stem}.pt"


def _features_dir(source: str, seq_len: int) -> str:
    return "features" if source == "python-docs" else f"features-{source}-{seq_len}"


def init_net(init_head: Path, target: LoadedModel, full_rows, seed: int = 0) -> tuple[HeadNet, dict]:
    """The head in ``init_head`` as a trainable net, and its card. ``full_rows`` [V, E]: the
    target's output rows. The head must have been made for ``target``; another runtime dtype of
    it is a continuation (its features differ by rounding, q4 against q4k, and the head learns the
    ones it will read; the new card records the earlier dtype under ``init_head``)."""
    model = target.model
    head_cfg, state, vocab_ids, card = read_head(init_head)
    if card.get("target") != target.name:
        raise ValueError(f"init_head {init_head} was trained for {card.get('target')}, not {target.name}")
    if head_cfg.target_vocab_size != model.vocab_size or head_cfg.hidden_size != model.cfg.hidden_size:
        raise ValueError(f"init_head {init_head} was trained for another target")
    net = HeadNet(head_cfg, vocab_ids, model.embed, model.final_norm, full_rows[vocab_ids], seed)
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


def _stage1(target, recipe: HeadRecipe, workdir: Path, data, sequences, eos_ids, full_rows):
    """Stage 1: features of the corpus, the vocabulary subset, training and held-out evaluation;
    returns the card so far, the head, the corpus dataset and its training ids."""
    cfg, stages = recipe.train, {}
    feature_dir = workdir / _features_dir(recipe.source, recipe.seq_len)
    t = time.perf_counter()
    features.extract(target.model, sequences, feature_dir)
    stages["extract_seconds_this_run"] = round(time.perf_counter() - t, 1)
    shards = features.load_shards(feature_dir)[: (len(sequences) + features.SHARD - 1) // features.SHARD]
    dataset = Dataset(shards)
    train_ids, held_ids = split(len(dataset), cfg.held_out_every)
    model = target.model
    vocab_ids = vocab_subset([dataset.rows[i][0] for i in train_ids], cfg.vocab_size, eos_ids, model.vocab_size)
    net = HeadNet(head_config(model.cfg, cfg), vocab_ids, model.embed, model.final_norm,
                  full_rows[vocab_ids], cfg.seed)
    log = train(net, dataset, train_ids, cfg, workdir / "checkpoint.pt")
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


def held_out_sharegpt(target, workdir: Path, encode_chat, seq_len: int, tokens: int = 12_000) -> Dataset:
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
    directory = workdir / f"features-sharegpt-{seq_len}-held-out-{tokens}"
    features.extract(target.model, data["sequences"], directory)
    return Dataset(features.load_shards(directory))


def _finetune_on_corpus(target, recipe: HeadRecipe, workdir: Path, data, sequences, eos_ids, full_rows, encode_chat,
                        out: Path) -> dict:
    """Stage 1 from an existing head (``init_head``, same target): train it further on the
    corpus's features (top-k labels, answers only when ``cfg.answers_only``), then evaluate the
    head before and after on held-out ShareGPT conversations; returns the card."""
    model, cfg, source, seq_len, init_head = target.model, recipe.train, recipe.source, recipe.seq_len, Path(recipe.init_head)
    net, old_card = init_net(init_head, target, full_rows, cfg.seed)
    feature_dir = workdir / _features_dir(source, seq_len)
    t = time.perf_counter()
    features.extract(model, sequences, feature_dir)
    extract_s = time.perf_counter() - t
    shards = features.load_shards(feature_dir)[: (len(sequences) + features.SHARD - 1) // features.SHARD]
    dataset = Dataset(shards)
    header = answer_header(encode_chat) if cfg.answers_only else None
    if source == "sharegpt":  # held out by conversation, never trained on
        held, train_ids = held_out_sharegpt(target, workdir, encode_chat, seq_len), list(range(len(dataset)))
        held_ids = list(range(len(held)))
    else:
        held = dataset
        train_ids, held_ids = split(len(dataset), cfg.held_out_every)
    # batch 1: the target's full-vocabulary p of a 1,024-token window is 0.6 GB in fp32 (batch 4
    # with its temporaries was killed for memory on a 24 GB machine)
    before = evaluate(net, held, held_ids, cfg.passes, full_rows, batch=1, answer_header=header, ends=eos_ids)
    log = train(net, dataset, train_ids, cfg, _checkpoint(workdir, f"finetune-{source}-{seq_len}", out),
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
    card["features"] = FEATURES_READ
    card["command"] = recipe.command(target.name, model.dtype_name, out.name)
    _write_head(out, net, card)
    return card


def own_answers(target, directory: Path, prompts: list[list[dict]], batches: int | range, eos_ids, encode_chat) -> Dataset:
    """The target's answers to ``prompts``, ``ANSWER_BATCH`` at a time (batch b answers
    ``prompts[16 b : 16 b + 16]``, greedy and T = 0.7 in turn), with its features recorded while it
    generates: one shard per batch in ``directory``, so an interrupted run resumes at the first
    missing batch. ``batches``: a count (batches 0 .. n - 1) or a range of batch indices."""
    from specdec.verify.sampling import SamplingParams

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
        rows = features.generate_with_features(target.model, ids, params, min(ANSWER_TOKENS, room // 2), eos_ids, seed=b)
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
                  encode_chat, corpus_root: Path | None) -> Dataset:
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
    return own_answers(target, own_answer_dir(workdir, part.source), prompts, part.batches, eos_ids,
                       encode_chat)


_PROMPTS = {"sharegpt": "ShareGPT user turns", "python-docs": "requests derived from unused python-docs chunks",
            "sharegpt-translate": "requests to translate ShareGPT's English paragraphs"}

NEW_VOCAB_FREQUENT_SHARE = 0.75  # chosen on held-out own answers (see vocab_subset)
HELD_OUT_ANSWER_BATCHES = 2  # 32 held-out ShareGPT requests, ~7k answer tokens: a standard error of ~0.006


def held_out_own_answers(target, workdir: Path, encode_chat, eos_ids,
                         source: str = "sharegpt") -> Dataset:
    """The target's own answers to held-out ``source`` requests (from conversations never trained
    on): the text a head drafts at inference, so the evaluation closest to the bench's.
    "sharegpt-translate" gives its translations of held-out English paragraphs instead."""
    prompts = answer_prompts(source, HELD_OUT_ANSWER_BATCHES * ANSWER_BATCH, encode_chat, set(), None,
                             split="held_out")
    return own_answers(target, workdir / f"own-answers-{source}-held-out", prompts,
                       HELD_OUT_ANSWER_BATCHES, eos_ids, encode_chat)


def own_answer_dir(workdir: Path, source: str) -> Path:
    return workdir / ("own-answers" if source == "python-docs" else f"own-answers-{source}")


def _finetune_on_own_answers(target, recipe: HeadRecipe, net, corpus_data, corpus_train, sequences, workdir,
                             used_sources, eos_ids, encode_chat, full_rows, checkpoint: Path) -> dict:
    """Stage 2: the target answers ``recipe.answers``' requests (:func:`_own_answer_data`), then
    the head is fine-tuned on those answers mixed with as many corpus sequences (none when stage 1
    ran earlier: ``corpus_data`` is empty), at a third of the learning rate, from ``checkpoint``
    when one is there. ``new_vocab`` / ``widen_vocab`` first change the drafted ids
    (:func:`_redraft`; ``sequences``: the corpus's, for ``new_vocab``). Evaluated on held-out own
    answers before and after."""
    cfg = recipe.train
    net.load_export({k: v.half() for k, v in net.export().items()})  # start from the stage-1 head as saved (fp16)
    own, held, own_train, own_held, generate_s = _own_answer_data(target, recipe, workdir, used_sources, eos_ids,
                                                                  encode_chat)
    mixed = Dataset([])
    mixed.rows = own.rows + held.rows + corpus_data.rows
    offset = len(own.rows) + len(held.rows)
    train_ids = own_train + [offset + i for i in corpus_train[: len(own_train)]]
    header = answer_header(encode_chat) if cfg.answers_only else None
    # scored: the target's own answer alone (a ShareGPT multi-turn request's context holds a human's
    # answer); with no header to find it by (answers_only off, python-docs prompts) every slot
    scoring = header or (answer_header(encode_chat) if recipe.source == "sharegpt" else None)
    scored = {"batch": 1, "answer_header": scoring, "ends": eos_ids, "last_answer_only": scoring is not None}
    before = evaluate(net, mixed, own_held, cfg.passes, full_rows, **scored)
    vocab_record = _redraft(net, recipe, [own.rows[i][0] for i in own_train], sequences, eos_ids, full_rows)
    if vocab_record is not None:
        vocab_record["before_training"] = evaluate(net, mixed, own_held, cfg.passes, full_rows, **scored)
    ft_cfg = replace(cfg, steps=recipe.finetune_steps, lr=cfg.lr * 0.3, warmup=5, seed=cfg.seed + 1, checkpoint_every=10)
    log = train(net, mixed, train_ids, ft_cfg, checkpoint, answer_header=header, ends=eos_ids)
    after = evaluate(net, mixed, own_held, cfg.passes, full_rows, **scored)
    answers = recipe.answers
    record = {"own_answer_sequences": len(own), "own_answer_tokens": sum(r[0].shape[0] for r in own.rows),
              "prompts": " and ".join(dict.fromkeys(_PROMPTS[part.source] for part in answers)),
              "answers": [str(part) for part in answers],
              "own_train": len(own_train), "own_held_out": len(own_held), "corpus_mixed_in": len(train_ids) - len(own_train),
              "temperatures": _temperatures_used(answers), "answers_only": header is not None,
              "steps": recipe.finetune_steps, "lr": ft_cfg.lr, "chain_share": ft_cfg.chain_share,
              "precision": precision(), "seconds": round(log["seconds"], 1),
              "generate_seconds_this_run": round(generate_s, 1),
              "held_out_own_answers_before": before, "held_out_own_answers_after": after}
    return record | ({"new_vocab": vocab_record} if vocab_record else {})


def _own_answer_data(target, recipe: HeadRecipe, workdir: Path, used_sources, eos_ids, encode_chat):
    """Stage 2's data: the own answers ``recipe.answers`` names (generated where missing: greedy
    and T = 0.7 in turn, the features recorded while the target generates) and the held-out ones
    (answers to held-out ShareGPT conversations for a "sharegpt" run, else every 10th own answer).
    Returns (own, held, own train ids, held-out ids in own + held, seconds spent here)."""
    t = time.perf_counter()
    own = Dataset([])
    for part in recipe.answers:
        own.rows += _answer_slice(target, workdir, part, recipe.source, used_sources, eos_ids, encode_chat,
                                  recipe.corpus_root).rows
    if recipe.source == "sharegpt":
        held = held_out_own_answers(target, workdir, encode_chat, eos_ids)
        own_train, own_held = list(range(len(own))), list(range(len(own), len(own) + len(held)))
    else:
        held = Dataset([])
        own_train, own_held = split(len(own), 10)
    return own, held, own_train, own_held, time.perf_counter() - t


def _redraft(net, recipe: HeadRecipe, own_rows: list[torch.Tensor], sequences, eos_ids, full_rows) -> dict | None:
    """Change the ids ``net`` drafts as the recipe asks: ``new_vocab`` re-chooses as many from the
    own answers and the corpus ``sequences``; ``widen_vocab`` keeps them all and adds more
    (:func:`widened_vocab`). Returns what changed (None: nothing asked)."""
    old_ids = net.vocab_ids
    if recipe.new_vocab:
        rows = own_rows + [torch.tensor(ids) for ids in sequences]
        ids = vocab_subset(rows, old_ids.numel(), eos_ids, full_rows.shape[0], NEW_VOCAB_FREQUENT_SHARE)
        record = {"size": ids.numel(), "frequent_share": NEW_VOCAB_FREQUENT_SHARE,
                  "kept_from_before": int(torch.isin(ids, old_ids).sum()),
                  "chosen_from_tokens": sum(int((r >= 0).sum()) for r in rows)}
    elif recipe.widen_vocab:
        ids = widened_vocab(old_ids, own_rows, recipe.widen_vocab, full_rows.shape[0])
        record = {"size": ids.numel(), "widened_from": old_ids.numel()}
    else:
        return None
    net.set_vocab(ids, full_rows[ids])
    return record


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



