"""Streaming text: incremental decoding equals a full decode, and stop strings are found and held back."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.text.detokenize import IncrementalDetokenizer, StopFinder

CORPUS = [
    "def rename(old_name, new_name):\n    return new_name  # keep the old one",
    "Le renard brun rapide saute par-dessus le chien paresseux. Größe, Übermaß, naïve café.",
    "快速的棕色狐狸跳过了懒狗。 数学：3 + 4 = 7，对吗？ 🦊🐶🎉 emoji are four bytes",
    "Summarise the passage in two sentences; answer the question from the text.",
]


def _byte_level_tokenizer():
    """A small byte-level BPE (the Qwen / GPT-2 family): multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False)


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer: a word's leading space is the '▁' of its first token, which a
    decode that starts at that token drops."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"])
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)


BYTE_LEVEL = _byte_level_tokenizer()
METASPACE = _metaspace_tokenizer()


def _stream(tokenizer, ids: list[int], rng: random.Random) -> tuple[str, list[str]]:
    """Feed ``ids`` in random chunks of 1-4 (speculative steps commit several tokens at once)."""
    detok, deltas, n = IncrementalDetokenizer(tokenizer), [], 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 4))
        deltas.append(detok.update(ids[:n]))
    assert "".join(deltas) == detok.text
    return detok.text, deltas


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(sorted(set("".join(CORPUS)))), min_size=1, max_size=80), st.integers(0, 10**6))
def test_byte_level_stream_equals_full_decode(text, seed):
    """Any text built from the corpus' characters (CJK, emoji, accents split over byte tokens):
    the streamed text equals the full decode, and no delta carries a broken character."""
    ids = BYTE_LEVEL(text, add_special_tokens=False)["input_ids"]
    streamed, deltas = _stream(BYTE_LEVEL, ids, random.Random(seed))
    assert streamed == BYTE_LEVEL.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_byte_level_holds_back_an_incomplete_character():
    ids = BYTE_LEVEL("🦒", add_special_tokens=False)["input_ids"]  # not in the corpus: no merged token
    assert len(ids) > 1, "the emoji must span several tokens for this test to mean anything"
    detok = IncrementalDetokenizer(BYTE_LEVEL)
    assert [detok.update(ids[:n]) for n in range(1, len(ids))] == [""] * (len(ids) - 1)
    assert detok.update(ids) == "🦒"


@pytest.mark.parametrize("seed", range(20))
def test_metaspace_stream_keeps_leading_spaces(seed):
    rng = random.Random(seed)
    words = " ".join(rng.choice(CORPUS).split()[:6] + rng.choice(CORPUS).split()[:6])
    ids = METASPACE(words, add_special_tokens=False)["input_ids"]
    streamed, _ = _stream(METASPACE, ids, rng)
    assert streamed == METASPACE.decode(ids)
    assert " " in streamed  # the property under test: spaces survive chunked decoding


def test_naive_chunk_decoding_loses_spaces_negative_control():
    """Decoding each chunk on its own (no left context) drops the spaces the test above checks."""
    ids = METASPACE("the quick brown fox jumps", add_special_tokens=False)["input_ids"]
    naive = "".join(METASPACE.decode([i]) for i in ids)
    assert naive != METASPACE.decode(ids)


def test_shrinking_sequence_is_an_error():
    detok = IncrementalDetokenizer(BYTE_LEVEL)
    detok.update([5, 6, 7])
    with pytest.raises(ValueError, match="shrank"):
        detok.update([5, 6])


def test_stop_finder_across_chunks_and_hold_back():
    finder = StopFinder(["\n\n", "END"])
    text = "first line\n"
    assert finder.feed(text) is None
    assert finder.safe_length(text) == len(text) - 1  # "\n" may start "\n\n"
    text += "more E"
    assert finder.feed(text) is None and finder.safe_length(text) == len(text) - 1  # "E" may start "END"
    text += "N"
    assert finder.feed(text) is None and finder.safe_length(text) == len(text) - 2
    text += "D and after"
    assert finder.feed(text) == text.index("END")
    assert finder.safe_length(text) == text.index("END")
    text += "\n\n"
    assert finder.feed(text) == text.index("END")  # the first stop string wins, and stays


def test_stop_finder_straddling_a_chunk_boundary_and_no_stops():
    finder = StopFinder(["stop here"])
    text = ""
    for chunk in ["we s", "to", "p", " he", "re now"]:
        text += chunk
        found = finder.feed(text)
    assert found == text.index("stop here")
    empty = StopFinder([])
    assert empty.feed("anything") is None and empty.safe_length("anything") == len("anything")
