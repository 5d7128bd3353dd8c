"""Benchmarks the way users compare engines: an online load generator for any OpenAI-compatible
server, and offline engine throughput without HTTP.

Workloads are synthetic token-id prompts (exact lengths on any server that accepts token-id
prompts, as vLLM, SGLang and fitllm do). "sharegpt" lengths are lognormal with the medians and
spread of ShareGPT conversations as commonly reported (prompt median ~220 tokens, output ~190),
clipped to the model's limits.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlsplit

import numpy as np


@dataclass
class Workload:
    input_lens: list[int]
    output_lens: list[int]
    prompts: list[list[int]]


def make_workload(num_prompts: int, input_len: int, output_len: int, distribution: str = "fixed",
                  vocab_size: int = 32000, max_len: int = 4096, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    if distribution == "fixed":
        ins, outs = [input_len] * num_prompts, [output_len] * num_prompts
    elif distribution == "sharegpt":
        # lognormal(mu = log(median), sigma); sigma ~1.0 gives ShareGPT's long tail.
        ins = [int(rng.lognormvariate(math.log(input_len), 1.0)) for _ in range(num_prompts)]
        outs = [int(rng.lognormvariate(math.log(output_len), 0.8)) for _ in range(num_prompts)]
    else:
        raise ValueError(f"unknown length distribution {distribution!r} (fixed, sharegpt)")
    ins = [min(max(4, n), max_len // 2) for n in ins]
    outs = [min(max(1, n), max_len - i) for n, i in zip(outs, ins)]
    # Avoid the lowest ids (special tokens) so prompts are ordinary text tokens.
    prompts = [[rng.randrange(100, vocab_size) for _ in range(n)] for n in ins]
    return Workload(ins, outs, prompts)


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{p}": float("nan") for p in ps} | {"mean": float("nan")}
    arr = np.asarray(values)
    return {f"p{p}": float(np.percentile(arr, p)) for p in ps} | {"mean": float(arr.mean())}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.itls) + 1 for r in ok)  # chunks that carried text
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_examples": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_tokens_per_s": out_tokens / duration if duration else 0.0,
        "tokens_per_chunk": out_tokens / chunks if chunks else float("nan"),
        "total_tokens_per_s": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration if duration else 0.0,
        "ttft_ms": {k: v * 1e3 for k, v in percentiles([r.ttft for r in ok]).items()},
        "itl_ms": {k: v * 1e3 for k, v in percentiles([x for r in ok for x in r.itls]).items()},
        "e2e_ms": {k: v * 1e3 for k, v in percentiles([r.latency for r in ok]).items()},
    }


class _HTTP:
    """A minimal HTTP/1.1 client, one connection per request: the load generator must cost far
    less than the server it measures. (httpx costs ~150 us of CPU per streamed chunk, most of it
    in its connection pool, which scans every open connection for each new request.)"""

    def __init__(self, base_url: str, headers: dict, connect_timeout: float = 10.0):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"expected an http:// or https:// URL, got {base_url!r}")
        self.host, self.tls = u.hostname, u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        self.headers = {"host": u.netloc, "accept": "application/json, text/event-stream",
                        "connection": "close", **{k.lower(): v for k, v in headers.items()}}
        self.connect_timeout = connect_timeout

    async def request(self, method: str, path: str, body: Optional[dict] = None):
        """(status, body chunks iterator). The caller must drain or close the iterator."""
        raw = b"" if body is None else json.dumps(body).encode()
        head = {**self.headers, "content-length": str(len(raw))}
        if body is not None:
            head["content-type"] = "application/json"
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, ssl=self.tls or None), self.connect_timeout)
        lines = [f"{method} {self.prefix}{path} HTTP/1.1"] + [f"{k}: {v}" for k, v in head.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + raw)
        status_line, *header_lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(status_line.split()[1])
        fields = dict(h.lower().split(":", 1) for h in header_lines if ":" in h)
        chunked = "chunked" in fields.get("transfer-encoding", "").lower()
        return status, self._body(reader, writer, chunked)

    @staticmethod
    async def _body(reader, writer, chunked: bool):
        try:
            while True:
                if not chunked:
                    data = await reader.read(65536)
                    if not data:
                        return
                    yield data
                    continue
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    return
                yield (await reader.readexactly(size + 2))[:-2]
        finally:
            writer.close()

    async def get_json(self, path: str):
        status, chunks = await self.request("GET", path)
        data = b"".join([c async for c in chunks])
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}: {data[:200]!r}")
        return json.loads(data)


def _sse_events(buffer: bytearray, data: bytes) -> list[bytes]:
    """Append `data` to `buffer`; return the payloads of the `data:` lines it completed."""
    buffer += data
    end = buffer.rfind(b"\n")
    if end < 0:
        return []
    lines, rest = bytes(buffer[:end]), buffer[end + 1:]
    buffer[:] = rest
    return [line[5:].strip() for line in lines.split(b"\n") if line.startswith(b"data:")]


async def _one_request(http: _HTTP, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = RequestResult(ok=False, prompt_tokens=len(prompt))
    last = None
    try:
        status, chunks = await http.request("POST", "/v1/completions", body)
        buffer = bytearray()
        async with contextlib.aclosing(chunks):
            if status != 200:
                result.error = f"HTTP {status}"
                return result
            async for data in chunks:
                # One chunk may carry several tokens (a server that fell behind merges them).
                for payload in _sse_events(buffer, data):
                    if payload == b"[DONE]":
                        continue
                    chunk = json.loads(payload)
                    now = time.perf_counter()
                    if chunk.get("usage"):
                        result.output_tokens = chunk["usage"].get("completion_tokens", result.output_tokens)
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.itls.append(now - last)
                        last = now
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or (len(result.itls) + (last is not None))
        result.ok = last is not None
        if not result.ok:
            result.error = "no tokens streamed"
    except Exception as exc:  # network errors count as failed requests, not as a crash
        result.error = f"{exc.__class__.__name__}: {exc}"
    return result


async def run_online(base_url: str, workload: Workload, rate: float, model: Optional[str] = None,
                     api_key: Optional[str] = None, max_concurrency: Optional[int] = None,
                     on_done: Optional[Callable[[], None]] = None, seed: int = 0) -> dict:
    """Send the workload with Poisson arrivals at `rate` requests/s (inf: all at once)."""
    http = _HTTP(base_url, {"authorization": f"Bearer {api_key}"} if api_key else {})
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(workload.prompts))
    if model is None:  # the server's own (first) model
        model = (await http.get_json("/v1/models"))["data"][0]["id"]

    async def fire(i: int) -> RequestResult:
        async with limit:
            r = await _one_request(http, model, workload.prompts[i], workload.output_lens[i])
        if on_done:
            on_done()
        return r

    start = time.perf_counter()
    tasks = []
    for i in range(len(workload.prompts)):
        tasks.append(asyncio.create_task(fire(i)))
        if math.isfinite(rate) and rate > 0:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return summarize(list(results), duration) | {"rate": rate}


def run_offline(engine, workload: Workload) -> dict:
    """Engine throughput without HTTP: all requests submitted at once, greedy, EOS ignored."""
    from fitllm.serve.sampling import SamplingParams

    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(f"offline-{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    generated = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    duration = time.perf_counter() - start
    return {
        "requests": len(workload.prompts),
        "duration_s": duration,
        "output_tokens": generated,
        "output_tokens_per_s": generated / duration,
        "total_tokens_per_s": (generated + sum(workload.input_lens)) / duration,
        "request_throughput": len(workload.prompts) / duration,
    }
