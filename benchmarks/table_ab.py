"""The engine with two W4A16 config tables in one process: did a table change help where the
engine runs, not only in the kernel benchmark? Random Llama-3-8B-shaped int4 model (as
bench_serving), CUDA graphs, bf16 KV. For each table: batch-1 decode tok/s, then the output
tokens/s of B concurrent requests (prompt 128, 128 new tokens) for each B in --batches. The tables:
'current' (fitllm.kernels.w4a16_tiled.TILED_CONFIGS) and 'previous' (the rows before the
2026-12-01 second-session sweep, kept here).

  python3 benchmarks/table_ab.py [--batches 8,16,32,64,128]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import build, engine_for  # noqa: E402
from gpu_engine_check import decode_speed, free, throughput  # noqa: E402

from fitllm.kernels import w4a16_tiled as wt  # noqa: E402

PREVIOUS = [
    (1, wt._gemv(128, 4, 8, waves=4)),
    (16, wt._tiled(16, 64, 4, 3, waves=8)),
    (32, wt._tiled(32, 64, 4, 3, waves=4)),
    (64, wt._tiled(64, 128, 8, 3, waves=2)),
    (128, wt._tiled(64, 128, 8, 3, waves=1, scale_in_w=True)),
    (1 << 62, wt._tiled(0, 0, 4, 1, backend="dequant")),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,16,32,64,128")
    a = ap.parse_args()
    model = build("int4")
    current = list(wt.TILED_CONFIGS["sm90"])
    for name, rows in (("previous", PREVIOUS), ("current", current), ("previous", PREVIOUS)):
        wt.TILED_CONFIGS["sm90"] = rows
        engine = engine_for(model, kv_dtype="auto", max_num_seqs=128)
        line = [f"b1 {decode_speed(engine, 128, 256):6.1f} tok/s"]
        for b in (int(x) for x in a.batches.split(",")):
            out_tps, _ = throughput(engine, b, 128, 128)
            line.append(f"B={b} {out_tps:7.0f}")
        print(f"{name:8s} " + "  ".join(line), flush=True)
        free(engine)
    wt.TILED_CONFIGS["sm90"] = current
    return 0


if __name__ == "__main__":
    sys.exit(main())
