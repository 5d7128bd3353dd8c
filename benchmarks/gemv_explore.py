"""Batch-1 W4A16 GEMV on the GPU, per Llama-3-8B linear: where the time goes and which variant wins.

Times each linear alone (enough weight copies per CUDA graph that every read comes from HBM) for:
bf16 cuBLAS, torch tinygemm int4, fitllm's table GEMV, and a sweep of the GEMV kernel's knobs
(tile BN/BK, warps, split-K waves, register prefetch of the next word tile). Checks every variant
against a float64 oracle first. Prints a table; writes $OUT/gemv_explore.json.

  python3 benchmarks/gemv_explore.py --out $OUT [--budget-s 240]
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import GS, SHAPES, capture_graph, make_w4, rel_err  # noqa: E402
from fitllm.kernels.fp8 import _cfg as f8cfg, fp8_gemm_triton, quantize_fp8_per_token  # noqa: E402
from fitllm.kernels.w4a16 import _pairs, _tc, dequantize_packed, w4a16_gemm_triton  # noqa: E402

BW = 4.22e12
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def graph_us(fns, target_ms=40.0):
    """µs per call: one CUDA graph runs every fn in `fns` (distinct weight copies) once."""
    g = capture_graph(lambda: [f() for f in fns])
    g.replay()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    t = []
    for _ in range(5):
        ev[0].record()
        for _ in range(10):
            g.replay()
        ev[1].record()
        torch.cuda.synchronize()
        t.append(ev[0].elapsed_time(ev[1]) / 10)
    del g
    return sorted(t)[2] * 1e3 / len(fns)


def candidates(M):
    out = [("table", None), ("tc M<=16 row", _tc(16, 64, 128, 4, 3, waves=4, swap=True, unpack=2))]
    sweep = [(64, 128, 2, 8), (64, 128, 4, 8), (128, 64, 4, 4), (256, 64, 4, 4), (128, 128, 4, 4), (64, 64, 2, 8)]
    if M == 1:
        sweep = list(itertools.product((64, 128, 256), (64, 128), (2, 4, 8), (2, 4, 8)))
    for bn, bk, warps, waves in sweep:
        out.append((f"pairs bn{bn} bk{bk} w{warps} wv{waves}", _pairs(bn, bk, warps, waves)))
    return out


def fp8_candidates():
    out = [("table", None)]
    for bn, bk, warps, waves in itertools.product((8, 16, 32), (256, 512), (2, 4, 8), (1, 2, 4)):
        out.append((f"gemv bn{bn} bk{bk} w{warps} wv{waves}", f8cfg(1, bn, bk, warps, 1, waves=waves, backend="gemv")))
    return out


def fp8_part(dev, budget_s, baseline=None, sweep=True):
    """M=1 FP8 W8A8 per linear: _scaled_mm peer, fitllm table (GEMV, swap-AB tensor cores for the
    wide gate_up), optionally an earlier fp8 module's table ('baseline', e.g. `git show
    REV:fitllm/kernels/fp8.py > fitllm/kernels/_fp8_prev.py`, not committed) and a GEMV sweep.
    fitllm numbers include the per-token activation quantization kernel; 'quant' is that alone."""
    results = {}
    cands = fp8_candidates() if sweep else [("table", None)]
    if baseline is not None:
        cands.insert(1, ("baseline", None))
    for name, (K, N) in SHAPES.items():
        nbytes = K * N + 4 * N
        copies = max(2, int(200e6 // nbytes) + 1)
        ws = [((torch.randn(N, K, device=dev) * 0.5).to(torch.float8_e4m3fn), torch.rand(N, device=dev) * 0.01 + 0.001)
              for _ in range(copies)]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        xq, xs = quantize_fp8_per_token(x)
        ref = (xq.double() * xs.double()) @ (ws[0][0].double() * ws[0][1].double()[:, None]).t()
        row = {"bytes": nbytes, "roof_us": nbytes / BW * 1e6}
        one = torch.ones(1, 1, device=dev)
        row["scaled_mm"] = graph_us([lambda w=w: torch._scaled_mm(xq, w[0].t(), scale_a=xs, scale_b=w[1].view(1, -1),
                                                                    out_dtype=torch.bfloat16) for w in ws])
        row["quant"] = graph_us([lambda: quantize_fp8_per_token(x)] * 8)
        del one
        for cname, cfg in cands:
            if time.time() - T0 > budget_s:
                break
            try:
                fn = baseline.fp8_gemm_triton if cname == "baseline" else fp8_gemm_triton
                y = torch.full((1, N), float("nan"), device=dev, dtype=torch.bfloat16)
                fn(x, ws[0][0], ws[0][1], config=cfg, out=y)
                err = rel_err(y, ref)
                if not err < 1e-2:
                    row[cname] = f"ERR {err:.2e}"
                    continue
                outs = [torch.empty(1, N, device=dev, dtype=torch.bfloat16) for _ in ws]
                row[cname] = graph_us([lambda w=w, o=o, fn=fn, cfg=cfg: fn(x, w[0], w[1], config=cfg, out=o)
                                       for w, o in zip(ws, outs)])
            except Exception as e:  # noqa: BLE001
                row[cname] = f"FAIL {repr(e)[:300]}"
        results[name] = row
        log("fp8", name, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                          if k in ("roof_us", "scaled_mm", "quant", "table", "baseline")})
        del ws
        torch.cuda.empty_cache()
    summarize(results, [c for c, _ in cands], ["scaled_mm", "quant", "roof_us"])
    return results


def summarize(results, names, peers):
    tot = {}
    for c in peers + names:
        vals = [results[s].get(c) for s in SHAPES]
        if all(isinstance(v, float) for v in vals):
            tot[c] = sum(vals)
    print("\nlayer total µs (qkv+o+gate_up+down), best first:")
    for v, k in sorted((v, k) for k, v in tot.items() if k != "roof_us")[:10]:
        print(f"  {k:32s} {v:7.1f}   " + " ".join(f"{s}={results[s][k]:.1f}" for s in SHAPES))
    print(f"  roofline {tot.get('roof_us', 0):.1f}; table {tot.get('table', 0):.1f}")
    bad = {s: {k: v for k, v in results[s].items() if isinstance(v, str)} for s in SHAPES}
    print("errors:", {s: dict(list(v.items())[:2]) for s, v in bad.items() if v})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--parts", default="w4,fp8")
    ap.add_argument("--m", default="1", help="w4: comma-separated batch sizes")
    ap.add_argument("--fp8-baseline", default=None, help="fp8: module with an earlier fp8_gemm_triton")
    ap.add_argument("--no-sweep", action="store_true", help="fp8: the table (and baseline) only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if "fp8" in args.parts:
        baseline = importlib.import_module(args.fp8_baseline) if args.fp8_baseline else None
        res = fp8_part(dev, args.budget_s, baseline, not args.no_sweep)
        json.dump(res, open(os.path.join(args.out, "gemv_fp8.json"), "w"), indent=1)
    if "w4" not in args.parts:
        return
    for M in [int(m) for m in args.m.split(",")]:
        res = w4_part(dev, M, args.budget_s)
        json.dump(res, open(os.path.join(args.out, f"gemv_w4_m{M}.json"), "w"), indent=1)


def w4_part(dev, M, budget_s):
    """W4A16 at batch M per linear: bf16 cuBLAS, tinygemm, fitllm's table, the tc tile, pairs GEMV configs."""
    results = {}
    cands = candidates(M)
    for name, (K, N) in SHAPES.items():
        nbytes = K * N // 2 + 2 * (K // GS) * N * 2
        copies = max(2, int(200e6 // nbytes) + 1)
        ws = [make_w4(K, N, dev) for _ in range(copies)]
        w16 = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(max(2, copies // 4))]
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        ref = x.double() @ dequantize_packed(**{k: ws[0][k] for k in ("qweight", "scales", "zeros", "group_size", "bits")},
                                             dtype=torch.float64)
        row = {"bytes": nbytes, "roof_us": nbytes / BW * 1e6, "rel_err": {}}
        row["cublas"] = graph_us([lambda w=w: F.linear(x, w) for w in w16])
        try:
            tg = []
            for _ in range(copies):
                q = torch.randint(0, 16, (N, K), device=dev, dtype=torch.int32)
                wp = torch.ops.aten._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), 8)
                sz = (torch.rand(K // GS, N, 2, device=dev) * 0.01).to(torch.bfloat16)
                tg.append((wp, sz))
            row["tinygemm"] = graph_us([lambda t=t: torch.ops.aten._weight_int4pack_mm(x, t[0], GS, t[1]) for t in tg])
        except Exception as e:  # noqa: BLE001
            log("tinygemm failed", repr(e)[:120])
        for cname, cfg in cands:
            if time.time() - T0 > budget_s:
                break
            try:
                y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
                w4a16_gemm_triton(x, **ws[0], config=cfg, out=y)
                err = rel_err(y, ref)
                if not err < 1e-2:
                    row[cname] = f"ERR {err:.2e}"
                    continue
                row["rel_err"][cname] = err
                outs = [torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in ws]
                row[cname] = graph_us([lambda w=w, o=o: w4a16_gemm_triton(x, **w, config=cfg, out=o)
                                       for w, o in zip(ws, outs)])
            except Exception as e:  # noqa: BLE001
                row[cname] = f"FAIL {repr(e)[:300]}"
        results[name] = row
        log(f"w4 M={M}", name, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                                if k in ("roof_us", "cublas", "tinygemm", "table")})
        del ws, w16
        torch.cuda.empty_cache()
    print(f"\n== W4A16 M={M}")
    summarize(results, [c for c, _ in cands], ["cublas", "tinygemm", "roof_us"])
    print("rel. error vs float64, table config:",
          {s: f"{results[s]['rel_err'].get('table', float('nan')):.1e}" for s in SHAPES})
    return results


if __name__ == "__main__":
    main()
