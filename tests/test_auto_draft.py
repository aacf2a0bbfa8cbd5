"""``--draft auto``: the smallest installed model with the target's tokenizer, said on stderr.

The catalog is the registry's files and ``$SPECDEC_HOME/models`` (the metadata directories of the
models loaded before, each naming its source); the tests put tiny Hugging Face directories there:
a smaller model with the target's tokenizer and a still smaller one with another tokenization,
and check which is chosen, that a target whose special tokens differ gets the first through
the vocabulary intersection, and that the smallest model gets none with the reason given.
"""

from __future__ import annotations

import json

import pytest

from conftest import fresh_home
from specdec.cli import main
from specdec.models import catalog, loading
from specdec.speculation import auto_draft
from tiny_models import char_tokenizer, hf_tiny, merging_char_tokenizer, save_hf_dir


def _installed(home, name, hf, tokenizer=None):
    """A model named ``name`` in the catalog (its own source)."""
    directory = home / "models" / name
    hf.save_pretrained(directory)
    (tokenizer or char_tokenizer()).save_pretrained(directory)
    loading._write_done(directory, directory)
    return directory


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = fresh_home(tmp_path, monkeypatch)
    _installed(home, "same-1layer", hf_tiny("qwen2", layers=1, seed=4))
    # another tokenization of the same text (92 of the 97 strings shared): never a draft
    _installed(home, "other-tiny", hf_tiny("qwen2", layers=1, hidden=32, seed=5), merging_char_tokenizer())
    return home


def test_the_smallest_model_with_the_target_tokenizer_is_chosen(home, tmp_path, capsys):
    target = save_hf_dir(hf_tiny("qwen2", layers=3), tmp_path / "target")
    capsys.readouterr()
    picked = auto_draft(str(target))
    assert picked == str(home / "models" / "same-1layer")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--draft auto: same-1layer" in err and "the smallest of 1" in err
    fingerprints = {d.name: catalog.tokenizer_fingerprint(d) for d in (home / "models").iterdir() if d.is_dir()}
    assert fingerprints["same-1layer"] == catalog.tokenizer_fingerprint(target) != fingerprints["other-tiny"]


def test_a_fine_tune_with_other_special_tokens_gets_the_base_familys_model(home, tmp_path, capsys):
    """The target's tokenizer has another end-of-sequence token (its fingerprint differs): the
    smallest model sharing nearly all its strings drafts their intersection, and greedy output
    through it is plain greedy."""
    tuned = char_tokenizer()
    tuned.eos_token = "?"
    target = tmp_path / "tuned"
    hf_tiny("qwen2", layers=3).save_pretrained(target)
    tuned.save_pretrained(target)
    capsys.readouterr()
    assert catalog.tokenizer_fingerprint(target) != catalog.tokenizer_fingerprint(home / "models" / "same-1layer")
    assert auto_draft(str(target)) == str(home / "models" / "same-1layer")
    assert "sharing at least 99% of its token strings" in capsys.readouterr().err
    base = ["generate", "--target", str(target), "--prompt", "abcabc", "--max-new-tokens", "16", "--json", "--dtype", "int8"]
    assert main(base + ["--proposer", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", "auto", "--proposer", "draft"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["token_ids"] == plain["token_ids"]
    assert "drafts text" not in captured.err  # the ids agree: it drafts target tokens


def test_no_draft_when_no_smaller_model_shares_the_tokenizer(home, tmp_path, capsys):
    assert auto_draft(str(home / "models" / "same-1layer")) is None  # the catalog's smallest of its tokenizer
    assert "no draft for same-1layer" in capsys.readouterr().err
    assert auto_draft(str(home / "models" / "other-tiny")) is None
    assert "none of the 1 other installed models has its tokenizer" in capsys.readouterr().err


def test_generate_with_draft_auto_is_plain_greedy_with_the_chosen_draft(home, tmp_path, capsys):
    target = str(save_hf_dir(hf_tiny("qwen2", layers=3), tmp_path / "target"))
    base = ["generate", "--target", target, "--prompt", "abcabc", "--max-new-tokens", "16", "--json", "--dtype", "int8"]
    assert main(base + ["--proposer", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", "auto"]) == 0
    captured = capsys.readouterr()
    spec = json.loads(captured.out)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["config"]["draft"] == str(home / "models" / "same-1layer")
    assert "else the draft model" in captured.err  # the hybrid over the found draft
    small = str(home / "models" / "other-tiny")
    assert main(["generate", "--target", small, "--prompt", "a", "--draft", "auto", "--proposer", "draft"]) == 2
    assert "no installed model can draft" in capsys.readouterr().err


def test_the_default_drafts_with_the_found_model_only_without_a_head(home, tmp_path, capsys):
    """No --draft and no --proposer: a target without a draft head gets the hybrid over the model
    --draft auto finds (said on stderr), greedy output unchanged; --proposer or --k 0 loads none."""
    target = str(save_hf_dir(hf_tiny("qwen2", layers=3), tmp_path / "target"))
    base = ["generate", "--target", target, "--prompt", "abcabc", "--max-new-tokens", "16", "--json", "--dtype", "int8"]
    assert main(base + ["--proposer", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["token_ids"] == plain["token_ids"]
    assert out["config"]["draft"] == str(home / "models" / "same-1layer")
    assert "default draft (the target has no draft head): same-1layer" in captured.err
    assert "else the draft model (the default with a draft model)" in captured.err
    for chosen in (["--proposer", "suffix"], ["--k", "0"]):
        assert main(base + chosen) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)["config"]["draft"] is None and "default draft" not in captured.err
    smallest = str(home / "models" / "same-1layer")  # nothing smaller to find: lookup alone, as before
    assert main(["generate", "--target", smallest, "--prompt", "ab", "--max-new-tokens", "4", "--dtype", "int8"]) == 0
    err = capsys.readouterr().err
    assert "default draft (the target has no draft head): no draft for same-1layer" in err and "proposer suffix" in err
