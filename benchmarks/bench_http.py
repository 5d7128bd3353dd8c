"""The HTTP serving path alone (issue 10): the OpenAI server over a fake engine that costs nothing.

The fake engine has LLMEngine's interface and emits one token per running request per step,
after sleeping `--step-ms` with the GIL released (as a GPU step's wait would). Text comes from
the real incremental detokenizer and the embedded model's tokenizer (as the engine thread does
it), so the server's CPU per token is what our Python costs on top of the GPU: detokenization,
the engine-thread -> event-loop hand-off, chunk building, SSE framing, HTTP/1.1.

The server runs in its own process; `--clients` load-generator processes (fitllm.serve.bench's
run_online, all requests at once, `--concurrency` streams in all) run beside it on loopback. CPU
time of the server and of the clients is measured separately (/proc and getrusage), so a slow
client shows as such. Bounded: `--requests` x `--output-len` tokens, then it stops.

  python benchmarks/bench_http.py                      # 128 streams, 512 requests x 128 tokens
  python benchmarks/bench_http.py --step-ms 40         # paced: the server keeps up, ~1 token per chunk
  python benchmarks/bench_http.py --profile 10         # py-spy (pip install py-spy) over the server
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ---- the fake engine --------------------------------------------------------------------------------

@dataclass
class _Req:
    rid: str
    prompt: list
    params: object
    detok: object
    out: list = field(default_factory=list)


class FakeEngine:
    """LLMEngine's serving interface, no model: one token per running request per step."""

    def __init__(self, tokenizer, vocab_size: int, step_s: float, max_num_seqs: int = 256,
                 max_model_len: int = 4096, seed: int = 0):
        self.step_s, self.max_num_seqs = step_s, max_num_seqs
        # The server copies `tokenizer` to encode text prompts; ids-only runs need no real one.
        self.text_tokenizer, self.tokenizer = tokenizer, tokenizer or SimpleNamespace()
        self.max_model_len = max_model_len
        self.model_config = SimpleNamespace(vocab_size=vocab_size)
        self.scheduler = SimpleNamespace(waiting=[], running=[])
        self.requests: dict[str, _Req] = {}
        self._outbox: list = []
        self._rng = random.Random(seed)
        self.generated = 0

    def validate_request(self, request_id, prompt_token_ids, params) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        from fitllm.serve.detokenizer import IncrementalDetokenizer

        detok = None if self.text_tokenizer is None else IncrementalDetokenizer(
            self.text_tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens)
        req = _Req(request_id, list(prompt_token_ids), params, detok)
        self.requests[request_id] = req
        self.scheduler.waiting.append(req)

    def abort_request(self, request_id) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            for q in (self.scheduler.waiting, self.scheduler.running):
                if req in q:
                    q.remove(req)
            self._outbox.append(self._output(req, [], "", True, "abort"))

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._outbox)

    def step(self) -> list:
        outputs, self._outbox = self._outbox, []
        s = self.scheduler
        while s.waiting and len(s.running) < self.max_num_seqs:
            s.running.append(s.waiting.pop(0))
        if not s.running:
            return outputs
        time.sleep(self.step_s)  # the GPU's share of the step; the GIL is free meanwhile
        still = []
        for req in s.running:
            outputs.append(self._token(req))
            if not outputs[-1].finished:
                still.append(req)
        s.running = still
        return outputs

    def _token(self, req: _Req):
        token = self._rng.randrange(100, self.model_config.vocab_size)
        req.out.append(token)
        self.generated += 1
        text, reason = "", None
        if req.detok is not None:
            text = req.detok.add(token)
            reason = "stop" if req.detok.stopped else None
        if reason is None and len(req.out) >= req.params.max_tokens:
            reason = "length"
        if reason is not None:
            text += req.detok.flush() if req.detok is not None else ""
            self.requests.pop(req.rid, None)
        return self._output(req, [token], text, reason is not None, reason)

    def _output(self, req: _Req, tokens, text, finished, reason):
        from fitllm.serve.engine import RequestOutput

        return RequestOutput(req.rid, tokens, text, finished, reason, len(req.prompt), len(req.out))

    def stats(self) -> dict:
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_blocks_used": 0, "kv_blocks_total": 1, "generated_tokens": self.generated}


def load_tokenizer(folder: Optional[Path]):
    """The tokenizer in `folder`, or the embedded model's."""
    from fitllm.models.hub import resolve_model
    from fitllm.models.tokenizer import load_tokenizer as load

    return load(folder or resolve_model(None))


def serve(port: int, step_ms: float, tokenizer_dir: Optional[Path], detok: bool, max_num_seqs: int) -> None:
    import uvicorn

    from fitllm.serve.app import ServerConfig, create_app

    tokenizer = load_tokenizer(tokenizer_dir) if detok else None
    vocab = len(tokenizer) if tokenizer is not None else 32000
    engine = FakeEngine(tokenizer, vocab, step_ms / 1e3, max_num_seqs)
    app = create_app(engine, ServerConfig(served_model_name="fake", max_waiting=100_000))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ---- the load -----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_main(url: str, requests: int, concurrency: int, output_len: int, vocab: int, seed: int, conn) -> None:
    from fitllm.serve.bench import make_workload, run_online

    workload = make_workload(requests, 16, output_len, vocab_size=vocab, seed=seed)
    before = resource.getrusage(resource.RUSAGE_SELF)
    summary = asyncio.run(run_online(url, workload, float("inf"), max_concurrency=concurrency))
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    tokens = round(summary["output_tokens_per_s"] * summary["duration_s"])
    conn.send({"cpu_s": cpu, "tokens": tokens, "chunks": tokens / summary.get("tokens_per_chunk", math.nan),
               "errors": summary["errors"], "error_examples": summary["error_examples"],
               "itl_p50_ms": summary["itl_ms"]["p50"], "itl_p99_ms": summary["itl_ms"]["p99"]})


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the server did not come up")


def run_load(args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, __file__, "--serve", "--port", str(port), "--step-ms", str(args.step_ms),
           "--max-num-seqs", str(args.concurrency)] + ([] if args.detok else ["--no-detok"]) \
        + (["--tokenizer", str(args.tokenizer)] if args.tokenizer else [])
    server = subprocess.Popen(cmd)
    try:
        wait_healthy(url, server)
        vocab = 32000  # prompt ids only; any id below every tokenizer's vocabulary size
        ctx = mp.get_context("spawn")
        pipes, procs = [], []
        per_req, per_conc = args.requests // args.clients, args.concurrency // args.clients
        spy = None
        cpu0, t0 = cpu_seconds(server.pid), time.perf_counter()
        for i in range(args.clients):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=client_main, args=(url, per_req, per_conc, args.output_len, vocab, i, theirs))
            p.start()
            pipes.append(mine)
            procs.append(p)
        if args.profile:
            spy = subprocess.Popen(["py-spy", "record", "-p", str(server.pid), "-d", str(args.profile), "-r", "200",
                                    "-f", "raw", "-o", str(args.profile_out), "--threads", "--nonblocking"])
        results = [pipe.recv() for pipe in pipes]
        wall, cpu = time.perf_counter() - t0, cpu_seconds(server.pid) - cpu0
        for p in procs:
            p.join()
        if spy is not None:
            spy.wait()
    finally:
        server.terminate()
        server.wait(timeout=60)
    tokens = sum(r["tokens"] for r in results)
    client_cpu = sum(r["cpu_s"] for r in results)
    return {"concurrency": args.concurrency, "requests": args.requests, "output_len": args.output_len,
            "clients": args.clients, "step_ms": args.step_ms, "detok": args.detok, "wall_s": wall,
            "tokens": tokens, "tokens_per_s": tokens / wall, "server_cpu_s": cpu,
            "server_cpu_us_per_token": 1e6 * cpu / max(tokens, 1), "client_cpu_s": client_cpu,
            "client_cpu_us_per_token": 1e6 * client_cpu / max(tokens, 1),
            "tokens_per_chunk": tokens / max(sum(r["chunks"] for r in results), 1),
            "errors": sum(r["errors"] for r in results),
            "error_examples": sorted({e for r in results for e in r["error_examples"]})[:3],
            "itl_p50_ms": max(r["itl_p50_ms"] for r in results), "itl_p99_ms": max(r["itl_p99_ms"] for r in results),
            "load_average": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=128, help="streams open at once, all clients together")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--clients", type=int, default=1, help="load-generator processes")
    ap.add_argument("--step-ms", type=float, default=2.0, help="the fake engine's GPU time per step")
    ap.add_argument("--no-detok", dest="detok", action="store_false", help="token ids only, no text")
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer folder (default: the embedded model's)")
    ap.add_argument("--profile", type=int, default=0.0, help="py-spy the server for this many seconds")
    ap.add_argument("--profile-out", type=Path, default=Path("/tmp/bench_http.pyspy.txt"))
    ap.add_argument("--json", type=Path, help="also write the result here")
    # internal: the server process
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--max-num-seqs", type=int, default=256, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.port, args.step_ms, args.tokenizer, args.detok, args.max_num_seqs)
        return 0
    r = run_load(args)
    print(f"{r['tokens']} tokens in {r['wall_s']:.1f} s: {r['tokens_per_s']:.0f} tok/s through HTTP | server CPU "
          f"{r['server_cpu_us_per_token']:.0f} us/token | clients CPU {r['client_cpu_us_per_token']:.0f} us/token | "
          f"{r['tokens_per_chunk']:.2f} tokens/chunk | ITL p50 {r['itl_p50_ms']:.1f} p99 {r['itl_p99_ms']:.1f} ms | "
          f"errors {r['errors']} {r['error_examples']} | load {r['load_average']:.1f}")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
