"""NF4 (bitsandbytes 4-bit) GEMMs on one Llama-3-8B layer's four linears, on a GPU: fitllm's codebook kernel
(and its other path, the weight dequantized then cuBLAS; "fitllm nf4" is what the dispatch picks at each M)
against bitsandbytes' own matmul_4bit (the peer, when the wheel is installed), cuBLAS bf16 and fitllm's int4
tiled kernel (the affine int4 the same bytes could hold).

    PYTHONPATH=$PWD python benchmarks/bench_codebook4.py [--m 1,16,64,256,1024] [--out DIR]

First checks the kernel against its torch reference (float64) at every shape and M, then times each variant as
CUDA-graph replays (two copies of the layer, so reads come from HBM), in µs per layer. Writes DIR/codebook4.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_gemm import SHAPES, graph_time, log, make_w4, rel_err  # noqa: E402
from fitllm.kernels.codebook4 import codebook4_gemm_triton  # noqa: E402
from fitllm.quant.nf4 import nf4_quantize  # noqa: E402


def make_layer(dev):
    """Per linear: the NF4 weight (fitllm's form), bitsandbytes' packed weight and state of the same codes, a bf16
    weight and an int4 tiled weight."""
    try:
        import bitsandbytes.functional as bnb_f
    except ImportError:
        bnb_f = None
    layer = {}
    for name, (K, N) in SHAPES.items():
        w = torch.randn(N, K, device=dev) * 0.02
        nf4 = nf4_quantize(w, 64).to(dev)
        peer = bnb_f.quantize_4bit(w.to(torch.bfloat16), blocksize=64, quant_type="nf4") if bnb_f else None
        layer[name] = dict(nf4=nf4, bf16=w.to(torch.bfloat16), w4=make_w4(K, N, dev), bnb=peer)
    return layer


def check(layer, ms, dev) -> float:
    worst = 0.0
    for name, p in layer.items():
        nf4 = p["nf4"]
        exact = nf4.dequantize(torch.float64)
        for m in ms:
            x = torch.randn(m, exact.shape[1], device=dev, dtype=torch.bfloat16)
            for path in ("kernel", "dequant"):
                y = codebook4_gemm_triton(x, nf4.codes, nf4.absmax, nf4.codebook, nf4.blocksize, path=path)
                err = rel_err(y, x.double() @ exact.t())
                worst = max(worst, err)
                if err > 1e-2:
                    log(f"FAIL {name} M={m} {path}: rel err {err:.2e}")
    return worst


def variants(layers, m, dev):
    import torch.nn.functional as F
    from fitllm.kernels.w4a16_tiled import w4a16_tiled_gemm
    from fitllm.quant.formats.packing import KernelWeight, TiledWeight

    xs = {name: torch.randn(m, K, device=dev, dtype=torch.bfloat16) for name, (K, _) in SHAPES.items()}
    tiled = [{n: TiledWeight.from_kernel(KernelWeight(p["w4"]["qweight"], p["w4"]["scales"], p["w4"]["zeros"], 4, 128))
              for n, p in lay.items()} for lay in layers]

    def run(one):
        def fn():
            for li, lay in enumerate(layers):
                for n, p in lay.items():
                    one(xs[n], p, tiled[li][n])
        return fn

    def nf4(path):
        return run(lambda x, p, t: codebook4_gemm_triton(x, p["nf4"].codes, p["nf4"].absmax, p["nf4"].codebook, 64,
                                                         path=path))

    out = {
        "fitllm nf4": nf4("auto"),
        "fitllm nf4 kernel": nf4("kernel"),
        "fitllm nf4 dequant+cuBLAS": nf4("dequant"),
        "cuBLAS bf16": run(lambda x, p, t: F.linear(x, p["bf16"])),
        "fitllm int4 tiled": run(lambda x, p, t: w4a16_tiled_gemm(x, t.qtile, t.scales, t.zeros, 128, t.in_features)),
    }
    if layers[0]["qkv"]["bnb"] is not None:
        import bitsandbytes as bnb

        out["bitsandbytes nf4"] = run(lambda x, p, t: bnb.matmul_4bit(x, p["bnb"][0].t(), quant_state=p["bnb"][1]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,16,64,256,1024")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ms = [int(v) for v in args.m.split(",")]
    layers = [make_layer(dev), make_layer(dev)]
    worst = check(layers[0], sorted(set(ms + [3, 33])), dev)
    log(f"codebook4 vs float64 reference: worst rel err {worst:.2e} {'PASS' if worst < 1e-2 else 'FAIL'}")
    rows = []
    for m in ms:
        times = {name: graph_time(fn) for name, fn in variants(layers, m, dev).items()}
        rows.append({"M": m, **{k: round(v, 1) for k, v in times.items()}})
        log(f"M={m:5d} " + "  ".join(f"{k} {v:8.1f}" for k, v in times.items()) + "  (µs per layer)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "codebook4.json"), "w") as f:
            json.dump({"worst_rel_err": worst, "rows": rows, "gpu": torch.cuda.get_device_name()}, f, indent=2)


if __name__ == "__main__":
    main()
