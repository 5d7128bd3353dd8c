"""Hardware counters for the paged decode attention kernel, bf16 vs fp8 KV (issue 5's 1.6x): DRAM
throughput, issue slots, pipe utilisation, shared-memory conflicts and warp stall reasons.

  ncu --clock-control none -k regex:_decode_kernel --section SpeedOfLight --section Occupancy \\
      --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats \\
      --section MemoryWorkloadAnalysis_Tables python3 benchmarks/ncu_attention.py [B CTX] > $OUT/ncu.txt
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import Pool  # noqa: E402


def main() -> None:
    batch, ctx = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (64, 32768)
    for kind in ("bf16", "fp8"):
        pool = Pool(kind, batch, ctx)
        for _ in range(2):  # compile, then the profiled launch
            pool.run()
        torch.cuda.synchronize()
        print(f"{kind} B={batch} ctx={ctx} done", flush=True)
        del pool
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
