"""Would a head-major KV block layout read faster? A probe that needs no kernel change.

fitllm's blocks are token-major, [num_blocks, block_size, kv_heads, head_dim]: one kv head's rows of a
page are runs of head_dim values, kv_heads * head_dim apart. Head-major blocks ([num_blocks, kv_heads,
block_size, head_dim], FlashInfer's HND) make a head's page one contiguous run. The decode kernel
cannot read that layout, but a batch of B sequences x H kv heads is the same work as B * H
sequences of one kv head (with the G query heads of that kv head), and with one kv head the
token-major layout IS head-major. Same bytes, same programs, same default config (it depends on
B * H); only where the bytes sit differs. SDPA over contiguous K/V is timed in the same run.

    python benchmarks/kv_layout_probe.py [--batches 32,128] [--contexts 1024,4096] [--kinds bf16,fp8]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_attention import D, HKV, HQ, graph_time_us, sdpa_gqa_folded  # noqa: E402
from fitllm.budget import default_block_size  # noqa: E402
from fitllm.kernels import paged_attention as pa  # noqa: E402

KINDS = {"bf16": pa.KIND_FLOAT, "fp8": pa.KIND_FP8}


def make_pool(kind: str, seqs: int, kv_heads: int, ctx: int, g: torch.Generator):
    page = default_block_size(kind)
    pages = math.ceil(ctx / page)
    nb = seqs * pages

    def mk(shape):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        return x if kind == "bf16" else (x * 8).to(torch.float8_e4m3fn)

    k = mk(pa.cache_shape(nb, page, kv_heads, D, KINDS[kind]))
    v = mk(pa.cache_shape(nb, page, kv_heads, D, KINDS[kind], values=True))
    tables = torch.randperm(nb, device="cuda", generator=g).int().view(seqs, pages)
    return k, v, tables


def decode_us(kind: str, q, k, v, tables, ctx: int) -> float:
    seqs = tables.shape[0]
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    qs = torch.arange(seqs + 1, dtype=torch.int32, device="cuda")

    def fn():
        return pa.paged_attention(q, k, v, None, None, None, None, tables, qs, lens, D ** -0.5, KINDS[kind], D,
                                  max_query_len=1, max_seq_len=ctx)

    return graph_time_us(fn)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--kinds", default="bf16,fp8")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| kind | B | ctx | SDPA µs | token-major µs | head-major (emulated) µs | head-major gain |")
    print("|---|---|---|---|---|---|---|")
    for kind in a.kinds.split(","):
        qdt = torch.bfloat16 if kind == "bf16" else torch.float16
        for b in map(int, a.batches.split(",")):
            for ctx in map(int, a.contexts.split(",")):
                q = torch.randn(b, HQ, D, device="cuda", generator=g).to(qdt)
                token_major = decode_us(kind, q, *make_pool(kind, b, HKV, ctx, g), ctx)
                torch.cuda.empty_cache()
                # B * HKV sequences of one kv head each: query heads [b, kvh*G:(kvh+1)*G] -> row b*HKV + kvh
                head_major = decode_us(kind, q.reshape(b * HKV, HQ // HKV, D), *make_pool(kind, b * HKV, 1, ctx, g),
                                       ctx)
                torch.cuda.empty_cache()
                sd = float("nan")
                if kind == "bf16":
                    kc = torch.randn(b, HKV, ctx, D, device="cuda", dtype=torch.bfloat16, generator=g)
                    vc = torch.randn_like(kc)
                    sd = graph_time_us(lambda: sdpa_gqa_folded(q, kc, vc))
                    del kc, vc
                    torch.cuda.empty_cache()
                print(f"| {kind} | {b} | {ctx} | {sd:.1f} | {token_major:.1f} | {head_major:.1f} | "
                      f"{token_major / head_major:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
