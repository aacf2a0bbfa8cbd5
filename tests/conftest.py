"""Shared test set-up: the fixtures several test files use, and torch's threads. Under
pytest-xdist (`make test` runs one worker per core), each worker uses its share of the cores for
torch's threads, so that the workers do not oversubscribe the machine."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def fresh_home(tmp_path, monkeypatch):
    """Point SPECDEC_HOME at an empty directory that shares this machine's compiled kernels (a
    link): the tests using it check model caches and commands, and rebuilding every kernel in
    each fresh home would cost minutes."""
    from specdec import cache

    kernels = cache.home() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    if not (home / "kernels").exists():
        (home / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    return home


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty ``SPECDEC_HOME`` for this test (:func:`fresh_home`)."""
    return fresh_home(tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def pair():
    """An int8 tiny target and a draft that agrees with it often, but not always (the target's
    weights perturbed by 1%)."""
    from tiny_models import hf_tiny, ours, perturbed

    return ours(hf_tiny("qwen2", seed=0), "int8"), ours(perturbed(hf_tiny("qwen2", seed=0), 0.01, seed=1), "int8")


@pytest.fixture(scope="module")
def unrelated_pair():
    """An int8 tiny target and an unrelated one-layer draft over its vocabulary: many rejections,
    so the residual path runs often."""
    from tiny_models import hf_tiny, ours

    return ours(hf_tiny("qwen2", seed=0), "int8"), ours(hf_tiny("qwen2", seed=5, layers=1), "int8")


@pytest.fixture(scope="module")
def small_pair():
    """A target over a 6-id vocabulary and an unrelated one-layer draft: joint laws of a few
    tokens are small enough to test exactly."""
    from tiny_models import V_SMALL, hf_tiny, ours

    target = ours(hf_tiny("llama", vocab=V_SMALL, seed=3), "int8")
    return target, ours(hf_tiny("llama", vocab=V_SMALL, seed=4, layers=1), "int8")


@pytest.fixture
def always_trees(monkeypatch):
    """Trees whatever the rows sample: the engine's shape choice patched so that a tree proposer
    drafts trees under sampling too, for the tests of the tree path's exactness at T > 0 (by
    default tree proposers draft chains while every row samples: ``tree_shape``)."""
    from specdec.core import engine

    monkeypatch.setattr(engine, "tree_shape", lambda mode, wanted, sampling: mode != "chains")


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    """A tiny chat model (llama, random weights, a chat template) loaded at int8: the servers'."""
    from specdec.api import TextGenerator
    from tiny_models import hf_tiny, save_chat_model_dir

    directory = save_chat_model_dir(hf_tiny("llama", seed=0), tmp_path_factory.mktemp("model"))
    return TextGenerator.load(str(directory), dtype="int8")
