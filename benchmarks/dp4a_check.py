"""The batch-1 W4A16 GEMV on dp4a (fitllm/kernels/w4a16_dp4a.py) on a GPU, Llama-3-8B layer shapes, random
weights: correctness first (the Triton quantizer and the fused producers bit for bit against the torch
reference of X16; the GEMV against its exact integer math and against float64 of the dequantized weights
and the bf16 x), then µs per linear and for a layer's four linears with their split-K sums pending (as the
decoder runs them), the 16-bit GEMV of the table against dp4a, weights from HBM (enough copies per CUDA
graph). o_proj is timed on both, though the engine keeps it on the 16-bit GEMV (its producer is the
attention). Also issue 4's M = 1 ratio: bf16 cuBLAS over the same four linears in the same run against the
decoder's layer (issue4_ratio). Writes $OUT/dp4a_check.json.

  python3 benchmarks/dp4a_check.py --out $OUT [--checks-only] [--sweep]

--sweep also times each linear over the GEMV's configs (BN, warps, split-K waves; sums ended) to retune
GEMV_CONFIG for the card at hand.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import GS, SHAPES, rel_err  # noqa: E402
from benchmarks.gemv_explore import graph_us, log  # noqa: E402
from benchmarks.gemv_tiled_explore import dense64, hbm_copies  # noqa: E402
from fitllm.kernels import fused  # noqa: E402
from fitllm.kernels._utils import X16, Fp8Input, X16Input, splitk_workspace  # noqa: E402
from fitllm.kernels.w4a16_dp4a import dp4a_gemv, quantize_x16, quantize_x16_ref, w4a16_dp4a_ref  # noqa: E402
from fitllm.kernels.w4a16_tiled import w4a16_tiled_triton  # noqa: E402


def same(a: X16, b: X16) -> bool:
    return torch.equal(a.codes, b.codes) and torch.equal(a.stats, b.stats)


def checks(dev) -> dict:
    out = {}
    g = torch.Generator(device=dev).manual_seed(0)
    for K in (4096, 14336, 576):
        x = torch.randn(1, K, device=dev, generator=g).bfloat16() * 3
        x[0, 7] = 200.0
        out[f"quantizer K={K}"] = same(quantize_x16(x), quantize_x16_ref(x))
        w = (torch.rand(K, device=dev, generator=g) + 0.5).bfloat16()
        r = torch.randn(1, K, device=dev, generator=g).bfloat16()
        got, _ = fused.rms_norm(x, w, 1e-5, r, X16Input())
        out[f"rms_norm K={K}"] = isinstance(got, X16) and same(got, quantize_x16_ref(fused.rms_norm(x, w, 1e-5, r)[0]))
        gu = torch.randn(1, 2 * K, device=dev, generator=g).bfloat16() * 2
        got = fused.silu_mul(gu, X16Input())
        out[f"silu_mul K={K}"] = isinstance(got, X16) and same(got, quantize_x16_ref(fused.silu_mul(gu)))
    for name, (K, N) in SHAPES.items():
        _, qts = hbm_copies(K, N, dev)
        qt = qts[0]
        x = torch.randn(1, K, device=dev, generator=g).bfloat16()
        x16 = quantize_x16(x)
        y = torch.full((1, N), float("nan"), device=dev, dtype=torch.bfloat16)
        dp4a_gemv(x16, qt["qtile"], qt["scales"], qt["zeros"], GS, out=y)
        out[f"{name} vs its integer math"] = rel_err(y, w4a16_dp4a_ref(x16, qt["qtile"], qt["scales"], qt["zeros"], GS))
        out[f"{name} vs float64"] = rel_err(y, x.double() @ dense64(qt))
        y16 = w4a16_tiled_triton(x, **qt)
        out[f"{name} 16-bit GEMV vs float64"] = rel_err(y16, x.double() @ dense64(qt))
        del qts
    out["workspace clean"] = bool((splitk_workspace(torch.device(dev), 1, 1)[0] == 0).all())
    return out


def producer_timings(dev) -> dict:
    """µs a call (graphs of 8 calls) of the producers that feed the dp4a GEMVs, each writing plain bf16, fp8
    (dynamic per-row scale) or X16: RMSNorm + residual at K = 4096, SiLU·mul at I = 14336."""
    res = {}
    for name, quant in (("plain", None), ("fp8", Fp8Input()), ("X16", X16Input())):
        x, r = (torch.randn(1, 4096, device=dev).bfloat16() for _ in range(2))
        w = torch.rand(4096, device=dev).bfloat16()
        gu = torch.randn(1, 2 * 14336, device=dev).bfloat16()
        res[f"RMSNorm + residual K=4096, {name}"] = graph_us([lambda: fused.rms_norm(x, w, 1e-5, r, quant)] * 8)
        res[f"SiLU·mul I=14336, {name}"] = graph_us([lambda: fused.silu_mul(gu, quant)] * 8)
    return res


def timings(dev) -> dict:
    res, lin = producer_timings(dev), {}
    for name, (K, N) in SHAPES.items():
        _, qts = hbm_copies(K, N, dev)
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        x16, y = quantize_x16(x), torch.empty(1, N, device=dev, dtype=torch.bfloat16)
        res[f"{name} 16-bit"] = graph_us([lambda q=q: w4a16_tiled_triton(x, **q, out=y) for q in qts])
        res[f"{name} dp4a"] = graph_us([lambda q=q: dp4a_gemv(x16, q["qtile"], q["scales"], q["zeros"], GS, out=y)
                                        for q in qts])
        lin[name] = (x, x16, qts)
        log(f"{name}: 16-bit {res[f'{name} 16-bit']:.1f} µs, dp4a {res[f'{name} dp4a']:.1f} µs")
    n = min(len(q) for _, _, q in lin.values())

    def chain(i, dp4a_for):
        for name, (x, x16, qts) in lin.items():
            q = qts[i]
            if name in dp4a_for:
                dp4a_gemv(x16, q["qtile"], q["scales"], q["zeros"], GS, defer=True)
            else:
                w4a16_tiled_triton(x, **q, defer=True)
    for label, dp4a_for in (("16-bit", ()), ("dp4a but o", ("qkv", "gate_up", "down")),
                            ("dp4a", tuple(SHAPES)), ("16-bit again", ())):
        res[f"layer, sums pending: {label}"] = graph_us([lambda i=i, d=dp4a_for: chain(i, d) for i in range(n)])
    splitk_workspace(torch.device(dev), 1, 1)[0].zero_()
    res.update(issue4_ratio(dev, res))
    return res


def issue4_ratio(dev, res: dict) -> dict:
    """Issue 4's M = 1 measure in the same run: bf16 cuBLAS over the layer's four linears (two bf16 copies of
    the layer: 0.87 GB, past L2) against the dp4a layer with its sums pending, alone and charged with what its
    producers' X16 epilogue costs beyond a plain bf16 output (two RMSNorms and one SiLU·mul a layer; the
    attention feeds o_proj, so "dp4a but o" is the decoder's layer)."""
    copies = [{n: (torch.randn(N, K, device=dev, dtype=torch.bfloat16), torch.empty(1, N, device=dev,
                                                                                    dtype=torch.bfloat16))
               for n, (K, N) in SHAPES.items()} for _ in range(2)]
    xs = {K: torch.randn(1, K, device=dev, dtype=torch.bfloat16) for K, _ in SHAPES.values()}
    bf16 = graph_us([lambda c=c: [torch.mm(xs[w.shape[1]], w.t(), out=y) for w, y in c.values()] for c in copies])
    extra = 2 * (res["RMSNorm + residual K=4096, X16"] - res["RMSNorm + residual K=4096, plain"]) + \
        res["SiLU·mul I=14336, X16"] - res["SiLU·mul I=14336, plain"]
    layer = res["layer, sums pending: dp4a but o"]
    return {"layer, bf16 cuBLAS": bf16, "layer dp4a but o, with its producers' extra epilogue": layer + extra,
            "issue 4 M=1: bf16 / (dp4a but o)": bf16 / layer,
            "issue 4 M=1: bf16 / (dp4a but o + producers' extra)": bf16 / (layer + extra),
            "issue 4 M=1: bf16 / 16-bit GEMV layer": bf16 / res["layer, sums pending: 16-bit"]}


def sweep(dev) -> dict:
    """µs of each linear alone (sums ended) for each config: the best one per linear first in the log."""
    res = {}
    for name, (K, N) in SHAPES.items():
        _, qts = hbm_copies(K, N, dev)
        x16 = quantize_x16(torch.randn(1, K, device=dev, dtype=torch.bfloat16))
        y = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
        for bn, warps, waves in itertools.product((128, 256), (4, 8), (2.0, 3.0, 4.0, 6.0, 8.0)):
            cfg = dict(BN=bn, num_warps=warps, waves=waves, wide=None)
            res[f"{name} BN{bn} w{warps} waves{waves:g}"] = graph_us(
                [lambda q=q: dp4a_gemv(x16, q["qtile"], q["scales"], q["zeros"], GS, out=y, config=cfg) for q in qts])
        best = min((k for k in res if k.startswith(name + " ")), key=res.get)
        log(f"{name}: best {best} {res[best]:.1f} µs")
    splitk_workspace(torch.device(dev), 1, 1)[0].zero_()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--checks-only", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "checks": checks(dev)}
    bad = [k for k, v in res["checks"].items() if v is False or (isinstance(v, float) and not v < 1e-2)]
    print("\n| check | result |\n|---|---|")
    for k, v in res["checks"].items():
        print(f"| {k} | {v if isinstance(v, bool) else f'{v:.2e}'} |")
    print("CHECKS", "FAIL: " + ", ".join(bad) if bad else "PASS")
    if a.checks_only:
        json.dump(res, open(os.path.join(a.out, "dp4a_check.json"), "w"), indent=1)
        return
    res["us"] = timings(dev)
    print("\n| µs, M = 1 | value |\n|---|---|")
    for k, v in res["us"].items():
        print(f"| {k} | {v:.2f}x |" if k.startswith("issue 4") else f"| {k} | {v:.1f} |")
    if a.sweep:
        res["sweep"] = sweep(dev)
    json.dump(res, open(os.path.join(a.out, "dp4a_check.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
