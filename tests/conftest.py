"""Shared test set-up. Under pytest-xdist (`make test` runs one worker per core), each worker
uses its share of the cores for torch's threads, so that the workers do not oversubscribe the
machine."""

from __future__ import annotations

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
