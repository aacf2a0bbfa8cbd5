"""OpenVINO GenAI's continuous batching behind a minimal OpenAI chat endpoint: the served OpenVINO
peer of ``benchmarks/serve_bench.py`` (``--methods openvino``). Not a product server: streaming
greedy chat completions and /health, enough for the bench's clients.

One thread owns the ``ContinuousBatchingPipeline`` (it reads the GGUF file itself): it adds the
requests that arrived, runs one ``step()`` for every running request, and hands each request's new
token ids to its stream. Text is decoded from all of a request's ids each time, and only its new
complete characters are sent.

    python -m specdec.bench.openvino_server --model FILE.gguf --port 8000 --threads 2 --max-batch 16
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import queue
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


class Batcher:
    """The pipeline and the thread that steps it."""

    def __init__(self, model: str, threads: int, max_batch: int) -> None:
        import openvino_genai as ov_genai

        scheduler = ov_genai.SchedulerConfig()
        scheduler.max_num_seqs, scheduler.cache_size = max_batch, 2  # KV cache: 2 GB
        self.pipe = ov_genai.ContinuousBatchingPipeline(model, scheduler, "CPU", {"INFERENCE_NUM_THREADS": threads})
        self.tokenizer = self.pipe.get_tokenizer()
        self.incoming: queue.Queue = queue.Queue()
        self.ids = itertools.count()
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, messages: list[dict], max_tokens: int) -> asyncio.Queue:
        """A queue that receives lists of new token ids, then None at the end."""
        out: asyncio.Queue = asyncio.Queue()
        self.incoming.put((messages, max_tokens, out, asyncio.get_running_loop()))
        return out

    def _add(self, messages: list[dict], max_tokens: int, out, loop) -> tuple:
        import openvino_genai as ov_genai

        config = ov_genai.GenerationConfig()
        config.max_new_tokens, config.repetition_penalty = max_tokens, 1.0  # greedy: its default
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.pipe.add_request(next(self.ids), prompt, config), out, loop

    def _run(self) -> None:
        import openvino_genai.py_openvino_genai as ov

        running: list[tuple] = []
        while True:
            while not running or not self.incoming.empty():
                messages, max_tokens, out, loop = self.incoming.get()
                try:
                    running.append(self._add(messages, max_tokens, out, loop))
                except Exception:  # a request it cannot take (its chat template, its tokenizer): ends empty
                    loop.call_soon_threadsafe(out.put_nowait, None)
            self.pipe.step()
            for item in list(running):
                handle, out, loop = item
                while handle.can_read():
                    for output in handle.read().values():
                        loop.call_soon_threadsafe(out.put_nowait, list(output.generated_ids))
                if handle.get_status() != ov.GenerationStatus.RUNNING:
                    loop.call_soon_threadsafe(out.put_nowait, None)
                    running.remove(item)


def create_app(batcher: Batcher) -> FastAPI:
    app = FastAPI(title="openvino-genai continuous batching (specdec bench peer)")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        tokens = batcher.submit(body["messages"], int(body.get("max_tokens") or 128))
        return StreamingResponse(_stream(batcher.tokenizer, tokens), media_type="text/event-stream")

    return app


async def _stream(tokenizer, tokens: asyncio.Queue):
    ids, sent, created = [], "", int(time.time())
    while (new := await tokens.get()) is not None:
        ids += new
        text = tokenizer.decode(ids)
        if not text.endswith("\ufffd") and len(text) > len(sent):  # only whole characters
            yield _chunk({"content": text[len(sent):]}, created)
            sent = text
    final = {"id": "ov", "object": "chat.completion.chunk", "created": created, "choices": [],
             "usage": {"completion_tokens": len(ids)}}
    yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n"


def _chunk(delta: dict, created: int) -> str:
    body = {"id": "ov", "object": "chat.completion.chunk", "created": created,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    return f"data: {json.dumps(body)}\n\n"


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file (OpenVINO GenAI's reader) or an OpenVINO IR directory")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=16)
    args = ap.parse_args()
    uvicorn.run(create_app(Batcher(args.model, args.threads, args.max_batch)), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
