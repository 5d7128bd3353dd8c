"""GPU check and timing of fp8 activations quantized by their producer (kernels._utils.Fp8Activations):
the residual add + RMSNorm and SiLU·mul asked for an fp8 GEMM's input (quant=Fp8Input(...)) against the
same kernel's 16-bit output quantized by fp8's own quantizer (`_quantize_triton`), bit for bit (codes and
scales), at Llama-3-8B widths, dynamic and static scales, fed a tensor or a pending split-K sum. Then the
time of producer + quantizer against the producer quantizing itself (CUDA-graph replays of 32 layers'
worth of launches, PDL as in the engine).

  python3 benchmarks/fp8_act_check.py [--tokens 1,3,64,1000] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import graph_time  # noqa: E402
from fitllm.kernels import _utils, fused  # noqa: E402
from fitllm.kernels.fp8 import _quantize_triton  # noqa: E402

HIDDEN, INTER = 4096, 14336


def same(got: _utils.Fp8Activations, want: torch.Tensor, static) -> bool:
    q, s = _quantize_triton(want, static)
    return (isinstance(got, _utils.Fp8Activations) and torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))
            and torch.equal(got.scale, s))


def check(T: int, dev) -> dict:
    out = {}
    w = (1 + torch.randn(HIDDEN, device=dev) * 0.1).bfloat16()
    for static in (None, torch.tensor([0.05], device=dev)):
        kind = "static" if static is not None else "dynamic"
        req = _utils.Fp8Input(static)
        vals = torch.randn(T, HIDDEN, device=dev) * 3
        r = (torch.randn(T, HIDDEN, device=dev) * 3).bfloat16()
        want, h = fused.rms_norm(vals.bfloat16(), w, 1e-6, r)
        got, h2 = fused.rms_norm(vals.bfloat16(), w, 1e-6, r, req)
        out[f"rms_norm+residual {kind}"] = same(got, want, static) and torch.equal(h, h2)
        got, h2 = fused.rms_norm(_utils.PendingSum.holding(vals), w, 1e-6, r, req)
        ws, _ = _utils.splitk_workspace(vals.device, 0, 0)
        out[f"rms_norm+pending {kind}"] = same(got, want, static) and torch.equal(h, h2) and not ws.any().item()
        out[f"rms_norm {kind}"] = same(fused.rms_norm(vals.bfloat16(), w, 1e-6, quant=req),
                                       fused.rms_norm(vals.bfloat16(), w, 1e-6), static)
        gu = torch.randn(T, 2 * INTER, device=dev) * 2
        want = fused.silu_mul(gu.bfloat16())
        out[f"silu_mul {kind}"] = same(fused.silu_mul(gu.bfloat16(), req), want, static)
        out[f"silu_mul+pending {kind}"] = same(fused.silu_mul(_utils.PendingSum.holding(gu), req), want, static) and \
            not _utils.splitk_workspace(dev, 0, 0)[0].any().item()
    return out


def timing(T: int, dev, layers: int = 32) -> dict:
    """µs for `layers` x (RMSNorm + residual, SiLU·mul), each followed by the quantizer or quantizing itself."""
    x = [torch.randn(T, HIDDEN, device=dev).bfloat16() for _ in range(layers)]
    r = [torch.randn(T, HIDDEN, device=dev).bfloat16() for _ in range(layers)]
    gu = [torch.randn(T, 2 * INTER, device=dev).bfloat16() for _ in range(layers)]
    w = torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)
    req = _utils.Fp8Input()

    def apart():
        for i in range(layers):
            _quantize_triton(fused.rms_norm(x[i], w, 1e-6, r[i])[0], None)
            _quantize_triton(fused.silu_mul(gu[i]), None)

    def fused_quant():
        for i in range(layers):
            fused.rms_norm(x[i], w, 1e-6, r[i], req)
            fused.silu_mul(gu[i], req)

    def plain():  # the producers alone (what bf16 or int4 layers launch)
        for i in range(layers):
            fused.rms_norm(x[i], w, 1e-6, r[i])
            fused.silu_mul(gu[i])
    # graph_time halves its result (it assumes two layer copies): x2 for the whole graph
    return {k: 2 * graph_time(f) for k, f in (("producer+quantizer", apart), ("producer quantizes", fused_quant),
                                                ("producer alone", plain))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,3,64,1000")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    res, ok = {}, True
    for T in map(int, a.tokens.split(",")):
        c = check(T, dev)
        ok &= all(c.values())
        t = timing(T, dev)
        res[T] = {"check": c, "us_32_layers": t}
        print(f"T={T:5d} check {'ok' if all(c.values()) else 'FAIL ' + str([k for k, v in c.items() if not v])}  "
              + "  ".join(f"{k} {v:.1f} us" for k, v in t.items()), flush=True)
    with open(os.path.join(a.out, "fp8_act_check.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print("ALL OK" if ok else "FAILURES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
