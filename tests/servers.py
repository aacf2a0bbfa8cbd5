"""The server as the tests run it: uvicorn in a thread on a loopback port, over a tiny model."""

from __future__ import annotations

import socket
import threading
import time

import openai
import uvicorn

from specdec.api import TextGenerator
from specdec.server import ServeConfig, create_app

MODEL = "tiny"


class Server:
    """uvicorn in a thread on a free loopback port; ``stop`` shuts it down gracefully."""

    def __init__(self, gen: TextGenerator, config: ServeConfig) -> None:
        self.app = create_app(gen, config, MODEL)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        guard = time.time() + 300  # a hang guard only
        while not self.server.started:
            if time.time() > guard:
                raise TimeoutError("the server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=120, max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server did not shut down"
