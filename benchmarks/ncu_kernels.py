"""Hardware counters for fitllm's GEMM kernels on one Llama-3-8B linear (gate_up, K=4096 N=28672), to
say where the time goes when a speed target is missed (issue 4): achieved DRAM bandwidth, issue
slots, occupancy and the warp stall reasons, from Nsight Compute.

Run the script under ncu (it launches each kernel a few times; ncu profiles the last launch of each):

  ncu --clock-control none --target-processes all -k regex:'tiled|fp8|gemv' --launch-skip-before-match 0 \\
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \\
      python3 benchmarks/ncu_kernels.py [M,M,...] > $OUT/ncu.txt      (M: default 1,16,64)
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import make_fp8, make_w4  # noqa: E402
from fitllm.kernels.fp8 import fp8_gemm_triton, quantize_fp8_per_token  # noqa: E402
from fitllm.kernels.w4a16_tiled import tile_pack, w4a16_tiled_triton  # noqa: E402

K, N = 4096, 28672


def main() -> None:
    ms = [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "1,16,64").split(",")]  # M values to profile
    torch.manual_seed(0)
    w4 = make_w4(K, N, "cuda")
    qt = dict(qtile=tile_pack(w4["qweight"]), scales=w4["scales"], zeros=w4["zeros"], group_size=128, K=K)
    f8 = make_fp8(K, N, "cuda")
    for M in ms:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        xq = quantize_fp8_per_token(x)
        for _ in range(2):  # compile, then the profiled launch
            w4a16_tiled_triton(x, **qt)
            fp8_gemm_triton(x, **f8, x_quant=xq)
        torch.cuda.synchronize()
        print(f"M={M} done", flush=True)


if __name__ == "__main__":
    main()
