"""An OpenAI-compatible HTTP server over one :class:`~specdec.core.engine.Engine` (continuous batching).

* :mod:`specdec.server.scheduler` — the worker thread that owns the engine; jobs in, events out.
* :mod:`specdec.server.app` — the FastAPI application: OpenAI request/response formats, errors.
* :mod:`specdec.server.metrics` — the Prometheus metrics.
"""

from specdec.server.app import create_app, serve
from specdec.server.scheduler import ServeConfig

__all__ = ["ServeConfig", "create_app", "serve"]
