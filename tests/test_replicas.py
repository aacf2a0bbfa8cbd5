"""`specdec serve --replicas`: the OpenAI server as Ray Serve replicas (loopback, a local Ray
instance started here and shut down after; the tiny model). Marked ``ray``: `make test-ray`
runs them (CI too); `make test` does not (Ray's start-up alone takes most of a minute here).

What is checked: answers do not depend on the replica (greedy and seeded, the requests landing
on both replicas); prefix routing keeps a conversation's turns on one replica, where they find
their history in its prefix cache; 32 concurrent streams, none lost or mixed up; a replica killed during a wave:
every request either completes identically to its solo answer or fails with a clear error (an
HTTP error status, or a stream that ends without its final chunk and [DONE]), none hangs, and
the deployment is back to 2 replicas.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is an optional extra: pip install -e '.[ray]'")

from specdec.server import ServeConfig  # noqa: E402
from specdec.server.replicas import APP, DEPLOYMENT, ReplicaSpec, Scaling, deploy, merge_metrics  # noqa: E402
from specdec.speculation import SpeculationConfig  # noqa: E402
from tiny_models import hf_tiny, save_chat_model_dir  # noqa: E402

pytestmark = pytest.mark.ray
MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray import serve

    directory = save_chat_model_dir(hf_tiny("llama", seed=0), tmp_path_factory.mktemp("model"))
    port = _free_port()
    speculation = SpeculationConfig.resolve("suffix", draft=False, head=False)
    spec = ReplicaSpec(str(directory), dtype="int8", head=None, model_name=MODEL, threads=1,
                       config=ServeConfig(speculation, max_batch=16, max_queue=128, max_model_len=256))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # 2 replicas x 1 thread, + the aggregate
    try:
        deploy(spec, Scaling(replicas=2), port=port)
        url = f"http://127.0.0.1:{port}"
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)
    finally:
        serve.shutdown()
        ray.shutdown()


def _replica_of(url: str, body: dict, key: str) -> tuple[str, dict]:
    r = httpx.post(url + "/v1/completions", json=body, headers={"x-specdec-route-key": key}, timeout=120)
    r.raise_for_status()
    return r.headers["x-specdec-replica"], r.json()


def _spread(url: str, body: dict, n: int, wave: int) -> dict[str, list[dict]]:
    """``body`` sent ``n`` times, 4 at a time, each with its own routing key (the same body has
    the same key, so it would always go to one replica), by replica."""
    with ThreadPoolExecutor(4) as pool:
        out = list(pool.map(lambda i: _replica_of(url, body, f"wave{wave}-{i}"), range(n)))
    by: dict[str, list[dict]] = {}
    for replica, answer in out:
        by.setdefault(replica, []).append(answer)
    return by


def _on_both_replicas(url: str, body: dict) -> dict[str, list[dict]]:
    """``body`` in waves of 8 until both replicas have answered it (8 keys all on one replica:
    probability 2^-7 a wave; at most 4 waves)."""
    by: dict[str, list[dict]] = {}
    for wave in range(4):
        for replica, answers in _spread(url, body, 8, wave).items():
            by.setdefault(replica, []).extend(answers)
        if len(by) >= 2:
            break
    assert len(by) == 2, f"the requests landed on {len(by)} replica(s)"
    return by


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}], ids=["greedy", "seeded"])
def test_answers_are_identical_on_every_replica(cluster, sampling):
    url, _ = cluster
    by = _on_both_replicas(url, {"model": MODEL, "prompt": "hello world", "max_tokens": 24, **sampling})
    texts = {a["choices"][0]["text"] for answers in by.values() for a in answers}
    assert len(texts) == 1 and texts != {""}  # one answer, and not an empty one
    assert all(a["usage"]["completion_tokens"] > 0 for answers in by.values() for a in answers)


def _stream(client, prompt: str, max_tokens: int) -> str:
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    text, finish = [], None
    for c in chunks:
        if c.choices:
            text.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
    assert finish is not None, "the stream ended without a finish reason"
    return "".join(text)


def test_32_concurrent_streams_none_lost_or_mixed_up(cluster):
    url, client = cluster
    prompts = [f"item {i}: {'xyz' * (i % 5)}" for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        streamed = list(pool.map(lambda p: _stream(client, p, 16 + len(p) % 7), prompts))
    solo = [_stream(client, p, 16 + len(p) % 7) for p in prompts]
    assert streamed == solo


SYSTEM = "Be terse. " * 4  # a shared system prompt of a few cache blocks (the tiny model: 256 positions)


def _turn(url: str, messages: list[dict]) -> tuple[str, dict]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.headers["x-specdec-replica"], r.json()


def _conversation(url: str, first: str, turns: int = 3) -> list[tuple[str, dict]]:
    messages, out = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}], []
    for t in range(turns):
        replica, answer = _turn(url, messages)
        out.append((replica, answer))
        messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"and then {t}?"}]
    return out


def test_prefix_routing_keeps_a_conversation_on_the_replica_that_holds_its_history(cluster):
    """8 conversations of 3 turns, 4 at a time: each conversation's turns on one replica, each
    later turn served its whole earlier prompt from the prefix cache (up to the last partial
    block), the conversations spread over both replicas (all 8 on one: probability 2^-7), and a
    replay of every conversation answers the same."""
    from specdec.core.prefix_cache import BLOCK

    url, _ = cluster
    firsts = [f"q{i}: {'why' * i}" for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        convs = list(pool.map(lambda f: _conversation(url, f), firsts))
    for conv in convs:
        assert len({replica for replica, _ in conv}) == 1, [replica for replica, _ in conv]
        for (_, before), (_, later) in zip(conv, conv[1:]):
            cached = later["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= before["usage"]["prompt_tokens"] - BLOCK, (cached, before["usage"])
    assert len({conv[0][0] for conv in convs}) == 2
    replay = [_conversation(url, f) for f in firsts[:3]]
    assert [[a["choices"] for _, a in c] for c in replay] == [[a["choices"] for _, a in c] for c in convs[:3]]


def test_cluster_health_and_metrics_cover_every_replica(cluster):
    url, _ = cluster
    health = httpx.get(url + "/cluster/health", timeout=60).json()
    assert health["status"] == "ok" and health["replicas"] == 2
    text = httpx.get(url + "/cluster/metrics", timeout=60).text
    replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("specdec_generated_tokens_total")}
    assert len(replicas) == 2
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"  # one replica's own


def _raw_stream(url: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    """("ok", text) for a stream that ended with its finish chunk and [DONE]; ("error", why)
    for an HTTP error or a stream cut before them (what a client must treat as a failure)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, finish, done = [], None, False
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return "error", f"HTTP {r.status_code}"
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return "error", chunk["error"].get("message", "error")
                    for c in chunk["choices"]:
                        text.append(c["text"])
                        finish = c.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        return "error", type(exc).__name__
    if finish is None or not done:
        return "error", "stream cut before its end"
    return "ok", "".join(text)


def test_a_replica_killed_during_a_wave_fails_cleanly_and_is_replaced(cluster):
    from ray import serve

    url, _ = cluster
    prompts = [f"wave {i} {'ab' * (i % 4)}" for i in range(24)]
    solo = {p: _raw_stream(url, p, 48) for p in prompts}
    assert all(status == "ok" for status, _ in solo.values())
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP}#{DEPLOYMENT}")]
    assert len(names) == 2
    victim = ray.get_actor(names[0], namespace="serve")
    with ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(_raw_stream, url, p, 48) for p in prompts]
        time.sleep(1.0)  # the wave is under way
        ray.kill(victim, no_restart=True)
        results = [f.result(timeout=300) for f in futures]  # none hangs
    for p, (status, text) in zip(prompts, results):
        assert status == "error" or text == solo[p][1], (p, status, text)
    deadline = time.time() + 240
    while time.time() < deadline:
        status = serve.status().applications[APP].deployments[DEPLOYMENT]
        running = status.replica_states.get("RUNNING", 0)
        if running == 2 and status.status == "HEALTHY":
            break
        time.sleep(2)
    assert running == 2, status
    assert all(_raw_stream(url, p, 48) == solo[p] for p in prompts[:4])
    failed = sum(status == "error" for status, _ in results)
    print(f"replica killed mid-wave: {failed} of {len(results)} requests failed cleanly, the rest identical to solo")


def test_merge_metrics_labels_every_sample_with_its_replica():
    a = "# HELP x_total things\n# TYPE x_total counter\nx_total 3.0\n"
    b = "# HELP x_total things\n# TYPE x_total counter\nx_total 4.0\n"
    text = merge_metrics([("r1", a), ("r2", b)])
    assert 'x_total{replica="r1"} 3.0' in text and 'x_total{replica="r2"} 4.0' in text
    assert text.count("# TYPE x_total counter") == 1
