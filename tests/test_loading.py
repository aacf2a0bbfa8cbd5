"""Loading: Hugging Face directories (safetensors), the int8 cache, and pair compatibility checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.api import TextGenerator, same_tokenizer
from specdec.models import loading
from tiny_models import hf_tiny
from conftest import fresh_home


def _tokenizer(vocab_size: int, shift: int = 0):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{(i + shift) % vocab_size}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1")


@pytest.fixture
def hf_dir(tmp_path, monkeypatch):
    fresh_home(tmp_path, monkeypatch)
    hf = hf_tiny("qwen2")
    directory = tmp_path / "tiny-qwen2"
    hf.save_pretrained(directory)
    _tokenizer(97).save_pretrained(directory)
    return directory, hf


def test_load_safetensors_directory_matches_transformers(hf_dir):
    directory, hf = hf_dir
    loaded = loading.load(str(directory), "float32")
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits, -1)
    ours = torch.log_softmax(loaded.model(ids, loaded.model.new_cache(1, 16)), -1)
    assert (ours - ref).abs().max() <= 1e-3


def test_int8_cache_gives_identical_model(hf_dir):
    directory, _ = hf_dir
    first = loading.load(str(directory), "int8")  # calibrates, quantizes, writes the cache
    cached = list((loading.registry.home() / "layers").glob("*.safetensors"))
    assert len(cached) == 1
    second = loading.load(str(directory), "int8")  # reads the cache
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    a = first.model(ids, first.model.new_cache(2, 16))
    b = second.model(ids, second.model.new_cache(2, 16))
    assert torch.equal(a, b)


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a known model"):
        loading.source_path(str(tmp_path / "nope"))


def _fake(name, vocab_size, tokenizer):
    return SimpleNamespace(name=name, model=SimpleNamespace(vocab_size=vocab_size), tokenizer=tokenizer)


def test_a_draft_with_another_vocabulary_or_token_ids_is_told_apart():
    assert not same_tokenizer(_fake("t", 97, _tokenizer(97)), _fake("d", 96, _tokenizer(96)))
    assert not same_tokenizer(_fake("t", 97, _tokenizer(97)), _fake("d", 97, _tokenizer(97, shift=1)))
    assert same_tokenizer(_fake("t", 97, _tokenizer(97)), _fake("d", 97, _tokenizer(97)))


def test_text_generator_end_to_end_with_stop_string(hf_dir):
    directory, _ = hf_dir
    gen = TextGenerator.load(str(directory), str(directory), dtype="int8")
    prompt = [5, 6, 7]  # (AutoTokenizer maps this test tokenizer to Qwen2Tokenizer, which cannot encode "w5")
    plain = gen.generate([prompt], loading_params(), 12, speculation=gen.speculation("none"))[0]
    spec = gen.generate([prompt], loading_params(), 12, speculation=gen.speculation("draft", k=3))[0]
    assert spec.token_ids == plain.token_ids
    stop = gen.decode(plain.token_ids[2:3])
    assert stop, "the third generated token must decode to text"
    chunks = []
    stopped = gen.generate([prompt], loading_params(), 12, speculation=gen.speculation("ngram", k=3), stop=[stop],
                           on_text=lambda row, text: chunks.append(text))[0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text and plain.text.startswith(stopped.text)
    assert len(stopped.token_ids) <= 3
    assert "".join(chunks) == stopped.text  # streaming shows exactly the final text, never the stop string
    chunks.clear()
    streamed = gen.generate([prompt], loading_params(), 12, speculation=gen.speculation("draft", k=3), on_text=lambda row, text: chunks.append(text))[0]
    assert "".join(chunks) == streamed.text == plain.text and len(chunks) > 1


def loading_params():
    from specdec.verify.sampling import SamplingParams

    return SamplingParams(temperature=0.0)


def test_draft_model_is_pruned_to_frequent_ids_in_one_place(hf_dir, monkeypatch):
    """Every draft proposer the API builds uses the draft with its output layer restricted to
    DRAFT_VOCAB ids (here 40 of 97: no head shipped for this target, so the 40 lowest ids);
    greedy output stays the target's own."""
    import torch

    from specdec.models import heads

    monkeypatch.setattr(heads, "DRAFT_VOCAB", 40)
    directory, _ = hf_dir
    gen = TextGenerator.load(str(directory), str(directory), dtype="int8")
    view = gen.draft_model()
    model, ids = view.model, view.ids
    assert torch.equal(ids, torch.arange(40))
    cache = model.new_cache(1, 8)
    assert model(torch.tensor([[5, 6, 7]]), cache).shape[-1] == 40
    assert gen.draft_model()[0] is model  # built once
    prompt = [5, 6, 7]
    plain = gen.generate([prompt], loading_params(), 12, speculation=gen.speculation("none"))[0]
    for kind in ("draft", "hybrid"):
        spec = gen.generate([prompt], loading_params(), 12, speculation=gen.speculation(kind, k=3))[0]
        assert spec.token_ids == plain.token_ids


def test_the_hybrids_lookup_side_is_the_suffix_proposers_chains(hf_dir):
    """The one place the hybrids are built: their lookup side is the suffix proposer drafting
    chains (its copy cursor and learned replacements), matching the n-gram lengths, sharing the
    generator's history; the hybrid's greedy output is the target's own."""
    from specdec.proposers import HybridProposer, SuffixProposer

    directory, _ = hf_dir
    gen = TextGenerator.load(str(directory), str(directory), dtype="int8")
    hybrid = gen.speculation("hybrid", ngram=(2, 5)).build(gen, 64)
    assert isinstance(hybrid, HybridProposer) and isinstance(hybrid.lookup_side, SuffixProposer)
    assert hybrid.tree_mode == "chains" and (hybrid.lookup_side.min_match, hybrid.lookup_side.max_match) == (2, 5)
    assert hybrid.lookup_side.history is gen.suffix_history
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = gen.generate([prompt], loading_params(), 16, speculation=gen.speculation("none"))[0]
    spec = gen.generate([prompt], loading_params(), 16, speculation=gen.speculation("hybrid"))[0]
    assert spec.token_ids == plain.token_ids


def test_a_shipped_head_follows_the_model_not_its_name(tmp_path, monkeypatch):
    """Heads are matched by the GGUF's sha256: the same file under any path gets the head (it
    used to be keyed by registry name, so the registry's own file by its path got plain
    decoding); a different file does not. The hash is computed once per (path, size, mtime)."""
    import hashlib

    from specdec.models import heads, registry

    fresh_home(tmp_path, monkeypatch)
    data = b"GGUF" + bytes(range(256)) * 64
    a, b, other = tmp_path / "a.gguf", tmp_path / "copy" / "b.gguf", tmp_path / "other.gguf"
    b.parent.mkdir()
    a.write_bytes(data)
    b.write_bytes(data)
    other.write_bytes(data + b"x")
    head_file = next(iter(heads.SHIPPED.values()))
    monkeypatch.setattr(heads, "SHIPPED", {hashlib.sha256(data).hexdigest(): head_file})
    assert heads.shipped(str(a)) is not None and heads.shipped(str(a)) == heads.shipped(str(b))
    assert heads.shipped(str(other)) is None
    assert heads.shipped(str(tmp_path)) is None  # a directory: no GGUF identity
    calls = []
    monkeypatch.setattr(registry, "sha256_of", lambda path: calls.append(path) or "0" * 64)
    heads.identity(str(a))
    assert calls == []  # answered from the memo


def test_the_registry_target_and_its_shipped_head_agree():
    from specdec.models import heads, registry

    spec = registry.resolve("qwen2.5-coder-1.5b-instruct")
    assert heads.SHIPPED[spec.sha256] == "qwen2.5-coder-1.5b-instruct.head.safetensors"
    assert heads.shipped("qwen2.5-coder-1.5b-instruct") is not None
