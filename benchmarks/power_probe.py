"""SM clock, power and throttle reasons while a GEMM layer graph runs for seconds (issue 4 at large M:
is a kernel limited by its instructions or by the card's power cap?).

One Llama-3-8B layer's four linears at M tokens, two weight copies per CUDA graph, replayed for
--seconds per phase: fp8 W8A8 on the TMA kernel, on the pointer kernel with the same tiles
(FITLLM_FP8_TMA=0), bf16 cuBLAS, the TMA kernel again. `nvidia-smi -lms 50` logs the card meanwhile;
each phase's last seconds are averaged.

  python3 benchmarks/power_probe.py [--m 4096] [--seconds 3]
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import SHAPES, capture_graph, make_fp8  # noqa: E402

from fitllm.kernels.fp8 import fp8_gemm_triton, quantize_fp8_per_token  # noqa: E402

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def run_phase(g: torch.cuda.CUDAGraph, seconds: float) -> float:
    """µs a layer (two copies per replay), replaying for `seconds`."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    t0, n = time.time(), 0
    ev[0].record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            g.replay()
        n += 20
        torch.cuda.synchronize()
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) * 1e3 / n / 2


def samples(text: str) -> list[tuple]:
    rows = []
    for line in text.strip().splitlines():
        p = [v.strip() for v in line.split(",")]
        try:  # nvidia-smi prints local time, as time.time() counts it
            rows.append((datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(p[1]),
                         float(p[2]), float(p[3]), p[4]))
        except (ValueError, IndexError):
            continue
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    x16 = {K: torch.randn(a.m, K, device=dev, dtype=torch.bfloat16) for K in (4096, 14336)}
    xq = {K: quantize_fp8_per_token(v) for K, v in x16.items()}
    ws = {n: [make_fp8(K, N, dev) for _ in range(2)] for n, (K, N) in SHAPES.items()}
    w16 = {n: [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(2)]
           for n, (K, N) in SHAPES.items()}
    ys = {n: torch.empty(a.m, N, device=dev, dtype=torch.bfloat16) for n, (K, N) in SHAPES.items()}

    def fp8_layer():
        for c in range(2):
            for n, (K, _) in SHAPES.items():
                fp8_gemm_triton(x16[K], **ws[n][c], x_quant=xq[K], out=ys[n])

    def bf16_layer():
        for c in range(2):
            for n, (K, _) in SHAPES.items():
                torch.mm(x16[K], w16[n][c].t(), out=ys[n])

    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    phases = []
    for name, tma, fn in (("fp8 TMA", "1", fp8_layer), ("fp8 pointer", "0", fp8_layer),
                          ("bf16 cuBLAS", "1", bf16_layer), ("fp8 TMA", "1", fp8_layer)):
        os.environ["FITLLM_FP8_TMA"] = tma  # read when the graph is captured
        g = capture_graph(fn)
        torch.cuda.synchronize()
        time.sleep(0.5)
        start = time.time()
        us = run_phase(g, a.seconds)
        phases.append((name, start + a.seconds / 3, time.time(), us))
        time.sleep(1.0)
    smi.terminate()
    rows = samples(smi.communicate()[0])
    print(f"M = {a.m}, {torch.cuda.get_device_name()}")
    for name, lo, hi, us in phases:
        sel = [r for r in rows if lo <= r[0] <= hi]
        if not sel:
            print(f"{name:12s} {us:8.1f} µs a layer  (no nvidia-smi samples in the phase)")
            continue
        print(f"{name:12s} {us:8.1f} µs a layer  SM clock {sum(r[1] for r in sel) / len(sel):5.0f} MHz "
              f"(min {min(r[1] for r in sel):.0f})  power {sum(r[2] for r in sel) / len(sel):4.0f} W "
              f"(max {max(r[2] for r in sel):.0f})  {max(r[3] for r in sel):.0f} C  throttle reasons "
              f"{sorted({r[4] for r in sel})}  ({len(sel)} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
