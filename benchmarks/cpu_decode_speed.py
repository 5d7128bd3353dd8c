"""Greedy decode speed of a checkpoint on this CPU (dense or quantized), the way a laptop user runs it.

    python benchmarks/cpu_decode_speed.py MODEL_DIR [--tokens 32] [--threads 2]

Loads MODEL_DIR (dense, compressed-tensors, AWQ or GPTQ), decodes 2 tokens to warm up, then times
`tokens` more from a fixed prompt. FITLLM_CPU_DEQUANT_CACHE_MB=0 times quantized weights dequantized
at every step (the budget for keeping them dequantized; fitllm.quant.layers)."""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fitllm.models.generate import generate  # noqa: E402
from fitllm.quant.layers import load_quantized_model  # noqa: E402

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30]  # any ids below the vocabulary size


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_quantized_model(a.model)
    generate(model, [PROMPT], max_new_tokens=2)
    start = time.perf_counter()
    out = generate(model, [PROMPT], max_new_tokens=a.tokens)
    took = time.perf_counter() - start
    print(f"{a.model}: {a.tokens} tokens in {took:.2f} s ({a.tokens / took:.1f} tok/s), "
          f"FITLLM_CPU_DEQUANT_CACHE_MB={os.environ.get('FITLLM_CPU_DEQUANT_CACHE_MB', 'default')}; "
          f"first ids {out[0][:8]}")


if __name__ == "__main__":
    main()
