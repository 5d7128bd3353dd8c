"""Where a batch-1 decode step goes: the engine's step, as a client sees it, against the same step's GPU work
replayed back to back (the decode CUDA graph alone, then with the lm_head and an argmax). If the engine's step
is no longer than the replayed work, the host costs nothing and only kernels can close a gap (issue 10).

    python3 benchmarks/step_floor.py int4[,fp8,bf16]     # Llama-3-8B shapes, random weights (bench_serving)
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import build, engine_for  # noqa: E402
from gpu_engine_check import decode_speed  # noqa: E402


def t(fn, n=300):
    """Mean ms per call of fn, launched back to back (no host wait between calls)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


for scheme in sys.argv[1].split(","):
    model = build(scheme)
    eng = engine_for(model, max_num_seqs=8)
    tps = [decode_speed(eng, 128, 256) for _ in range(2)]
    replay = eng.runner.graphs.replays[1, 1]
    g = t(replay)
    full = lambda: eng.model.compute_logits(replay()[:1]).float().argmax(-1)  # noqa: E731
    f = t(full)
    tps2 = decode_speed(eng, 128, 256)
    print(f"{scheme}: engine {tps[0]:.1f} / {tps[1]:.1f} / {tps2:.1f} tok/s = {1e3 / max(tps + [tps2]):.3f} ms "
          f"a step at best; graph replay {g:.3f} ms; + lm_head + argmax {f:.3f} ms ({1e3 / f:.1f} tok/s if the "
          "host cost nothing)", flush=True)
    del eng, model
    torch.cuda.empty_cache()
