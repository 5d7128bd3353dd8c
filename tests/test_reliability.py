"""Faults against the real server: clients that vanish mid-prefill and mid-stream, a soak of
short requests with random cancellations (every KV block back, memory flat), SIGTERM drain.

Each test that checks "blocks are freed" also checks that generation stopped early, so it fails
if aborting on disconnect is removed (a request that runs to the end frees its blocks too).
Soak size: FITLLM_SOAK_REQUESTS (default 1000).
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import httpx
import pytest

from test_server import LiveServer

OPTIONS = ("--max-num-batched-tokens", "64", "--num-kv-blocks", "256", "--max-model-len", "1024",
           "--max-num-seqs", "32", "--max-waiting", "512", "--log-level", "warning")
SOAK_REQUESTS = int(os.environ.get("FITLLM_SOAK_REQUESTS", "1000"))
RSS_GROWTH_LIMIT = 64 << 20


@pytest.fixture(scope="module")
def server():
    s = LiveServer(*OPTIONS)
    yield s
    s.stop()


def generated(server) -> float:
    return server.metrics()["fitllm_generation_tokens_total"]


def test_disconnect_mid_prefill_frees_blocks(server):
    # ~900 prompt tokens at 64 per step: the prefill takes many steps; leave during it.
    prompt = list(range(1000, 1900))
    before = generated(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(10, read=0.5),
                   json={"prompt": prompt, "max_tokens": 100, "temperature": 0, "ignore_eos": True})
    m = server.wait_idle()
    assert m["fitllm_kv_blocks_used"] == 0 and m["fitllm_num_requests_running"] == 0
    assert generated(server) == before, "the request kept running after its client left"


def test_disconnect_mid_stream_frees_blocks(server):
    before = generated(server)
    body = {"prompt": "Count to one hundred: 1, 2,", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert got  # some tokens arrived; now hang up
    m = server.wait_idle()
    assert m["fitllm_kv_blocks_used"] == 0 and m["fitllm_num_requests_running"] == 0
    assert generated(server) - before < 100, "the stream kept generating after its client left"


async def one_request(client: httpx.AsyncClient, rng: random.Random, stats: dict) -> None:
    """A short request; about one in four is abandoned mid-flight in one of three ways."""
    chat = rng.random() < 0.3
    body = {"max_tokens": rng.randint(1, 4), "temperature": rng.choice([0, 0.8]), "stream": rng.random() < 0.5}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"Say {rng.randint(0, 99)}"}]
    else:
        path, body["prompt"] = "/v1/completions", [rng.randrange(100, 40000) for _ in range(rng.randint(1, 4))]
    cancel = rng.random() < 0.25
    try:
        if body["stream"]:
            async with client.stream("POST", path, json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if cancel and line.startswith("data: "):  # hang up after the first chunk
                        stats["cancelled"] += 1
                        return
        else:
            task = asyncio.ensure_future(client.post(path, json=body))
            if cancel:
                await asyncio.sleep(rng.uniform(0, 0.15))
                if task.cancel():
                    stats["cancelled"] += 1
                    await asyncio.gather(task, return_exceptions=True)
                    return
            r = await task
            assert r.status_code == 200, r.text
        stats["ok"] += 1
    except (httpx.HTTPError, asyncio.CancelledError) as exc:
        stats.setdefault("errors", []).append(repr(exc))


async def soak(url: str, count: int, concurrency: int = 32, seed: int = 0) -> dict:
    rng = random.Random(seed)
    stats = {"ok": 0, "cancelled": 0}
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def gated():
            async with gate:
                await one_request(client, rng, stats)
        await asyncio.gather(*(gated() for _ in range(count)))
    return stats


def test_soak_no_leaks(server):
    asyncio.run(soak(server.url, 100, seed=1))  # warm-up: allocator pools, caches, lazy imports
    server.wait_idle()
    rss_before = server.rss_bytes()
    start = time.monotonic()
    stats = asyncio.run(soak(server.url, SOAK_REQUESTS, seed=2))
    elapsed = time.monotonic() - start
    m = server.wait_idle()
    rss_after = server.rss_bytes()
    growth = rss_after - rss_before
    print(f"\nsoak: {SOAK_REQUESTS} requests in {elapsed:.1f} s ({SOAK_REQUESTS / elapsed:.1f}/s), "
          f"{stats['cancelled']} cancelled, {stats['ok']} completed, errors {len(stats.get('errors', []))}; "
          f"KV blocks used after: {m['fitllm_kv_blocks_used']:.0f} of {m['fitllm_kv_blocks_total']:.0f}; "
          f"server RSS {rss_before / 2**20:.1f} MiB -> {rss_after / 2**20:.1f} MiB ({growth / 2**20:+.1f} MiB)")
    assert not stats.get("errors"), stats["errors"][:5]
    assert stats["ok"] + stats["cancelled"] == SOAK_REQUESTS and stats["cancelled"] >= SOAK_REQUESTS // 10
    assert m["fitllm_kv_blocks_used"] == 0, "KV blocks leaked"
    assert m["fitllm_num_requests_running"] == 0 and m["fitllm_num_requests_waiting"] == 0
    assert growth < RSS_GROWTH_LIMIT, f"server memory grew by {growth / 2**20:.1f} MiB"


def test_sigterm_drains_in_flight_requests(server):
    """Last in this module: it stops the server. In-flight requests finish, then the process exits."""
    results: dict = {}

    def stream_one():
        body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "stream": True}
        chunks = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(line)
                    results["started"] = True
            results["done"] = line == "data: [DONE]" or chunks[-1]
        results["chunks"] = chunks

    thread = threading.Thread(target=stream_one)
    thread.start()
    deadline = time.monotonic() + 60
    while "started" not in results and time.monotonic() < deadline:
        time.sleep(0.02)
    assert results.get("started"), "the stream never started"
    server.proc.send_signal(signal.SIGTERM)
    thread.join(120)
    assert '"finish_reason":"length"' in results["chunks"][-1], results["chunks"][-3:]
    text_chunks = [c for c in results["chunks"] if '"text":""' not in c]
    assert len(text_chunks) >= 10  # all 12 tokens came through (a few may merge in one chunk)
    code = server.proc.wait(60)
    assert code in (0, -signal.SIGTERM), server.output()  # uvicorn re-raises SIGTERM once drained
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
