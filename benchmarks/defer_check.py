"""GPU check of deferred split-K sums (kernels._utils.PendingSum, FITLLM_SPLITK_DEFER=1), GEMM by GEMM:
for every table config a shape and M reach, the sum a deferring GEMM leaves in the workspace against the y
the same GEMM finishes itself, then each consumer (residual add + RMSNorm, SiLU·mul, and for the qkv
shapes RoPE + the bf16 cache write, paged_attention.rope_cache_write) fed the pending sum
against the same consumer fed y, and the workspace after each (all zero). Atomic adds differ in order
between launches, so sums are compared to bf16 rounding (a relative 2e-3), not bit for bit.

  python3 benchmarks/defer_check.py [--shapes smollm2,llama3-8b] [--m 1,2,...]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import make_w4  # noqa: E402
from fitllm.kernels import _utils, fused  # noqa: E402
from fitllm.kernels import paged_attention as pa  # noqa: E402
from fitllm.kernels.fp8 import fp8_gemm_triton  # noqa: E402
from fitllm.kernels.w4a16_tiled import tile_pack, w4a16_tiled_triton  # noqa: E402

SHAPES = {"smollm2": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)},
          "llama3-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}}
HEADS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # q heads, kv heads, head dim


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def workspace_dirty() -> float:
    ws, cnt = _utils.splitk_workspace(torch.device("cuda", 0), 0, 0)
    return max(ws.abs().max().item(), float(cnt.abs().max().item()))


def check(name, gemm, M, N, dev, heads=None):
    y = gemm(False)
    p = gemm(True)
    torch.cuda.synchronize()
    if not isinstance(p, _utils.PendingSum):
        return None
    row = {"sum": rel(p.acc, y)}
    p.materialize()
    row["ws_after_materialize"] = workspace_dirty()
    residual = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    weight = torch.rand(N, device=dev, dtype=torch.bfloat16)
    got = fused.rms_norm(gemm(True), weight, 1e-6, residual)
    want = fused.rms_norm(y, weight, 1e-6, residual)
    row["rms_norm"] = max(rel(got[0], want[0]), rel(got[1], want[1]))
    row["ws_after_rms_norm"] = workspace_dirty()
    if N % 2 == 0:
        row["silu_mul"] = rel(fused.silu_mul(gemm(True)), fused.silu_mul(y))
        row["ws_after_silu_mul"] = workspace_dirty()
    if heads is not None:
        row.update(rope_write(gemm, y, M, heads, dev))
    torch.cuda.synchronize()
    return row


def rope_write(gemm, y, M, heads, dev) -> dict:
    """The qkv GEMM's consumer: RoPE + the bf16 cache write fed the pending sum's q/k/v views against
    the same launch fed y's (rotated queries, both caches), and the workspace after it."""
    hq, hk, d = heads
    cos, sin = (torch.randn(M, d // 2, device=dev) for _ in range(2))
    slots = torch.arange(M, device=dev)
    out = []
    for qkv in (y.clone(), gemm(True)):
        q, k, v = (p.reshape(M, -1, d) for p in qkv.split([hq * d, hk * d, hk * d], -1))
        kc, vc = (torch.zeros(M, hk, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        out.append((pa.rope_cache_write(q, k, v, cos, sin, kc, vc, slots), kc, vc))
    (qw, kw, vw), (qg, kg, vg) = out
    return {"rope_write": max(rel(qg, qw), rel(kg, kw), rel(vg, vw)), "ws_after_rope_write": workspace_dirty()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="smollm2,llama3-8b")
    ap.add_argument("--m", default="1,2,3,4,8,16,17,33,64,65,96,128,200,256")
    a = ap.parse_args()
    os.environ["FITLLM_SPLITK_DEFER"] = "1"
    dev = "cuda"
    torch.manual_seed(0)
    bad = 0
    for shape in a.shapes.split(","):
        for lin, (K, N) in SHAPES[shape].items():
            w4 = make_w4(K, N, dev, gs=64 if K % 128 else 128)
            qt = dict(qtile=tile_pack(w4["qweight"]), scales=w4["scales"], zeros=w4["zeros"],
                      group_size=w4["group_size"], K=K)
            f8 = ((torch.randn(N, K, device=dev) * 0.5).to(torch.float8_e4m3fn),
                  torch.rand(N, device=dev) * 0.01 + 0.001)
            for M in map(int, a.m.split(",")):
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                for kind, gemm in (("w4", lambda d, x=x: w4a16_tiled_triton(x, **qt, defer=d)),
                                   ("fp8", lambda d, x=x: fp8_gemm_triton(x, *f8, defer=d))):
                    row = check(kind, gemm, M, N, dev, HEADS[shape] if lin == "qkv" else None)
                    if row is None:
                        continue
                    fail = (row["sum"] > 2e-3 or row["rms_norm"] > 1e-2 or row.get("silu_mul", 0) > 1e-2
                            or row.get("rope_write", 0) > 1e-2
                            or any(v != 0 for k, v in row.items() if k.startswith("ws_")))
                    bad += fail
                    print(f"{'FAIL' if fail else 'ok  '} {shape:9s} {lin:7s} {kind:3s} M={M:<4d} "
                          + "  ".join(f"{k} {v:.2e}" for k, v in row.items()), flush=True)
    print(f"\n{bad} failing (GEMM, M) pairs")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
