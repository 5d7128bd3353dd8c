"""W4A16 / FP8 GEMM on the GPU: correctness at real shapes, then speed against peers, one run.

One Llama-3-8B layer's four linears (qkv K=4096 N=6144, o 4096x4096, gate_up 4096x28672, down
K=14336 N=4096). Every timing is a CUDA-graph replay of two copies of the layer's four linears
(so the weights of one copy are out of L2 when they are read again), divided by two: µs per layer.
Peers in the same run: cuBLAS bf16 F.linear, torch int4 tinygemm, torch._scaled_mm FP8.
fitllm fp8 times include the per-token activation quantization kernel (the peer's do not; the
'fp8 gemm' column is fitllm without it; 'as the decoder runs it' quantizes only o_proj's input, since
the RMSNorms and SiLU·mul before the other three hand them their input quantized; the column after it
is the same graph with the fp8 tensor-core kernel asking L2 for --prefetch-alt weight tiles before its
PDL wait, an A/B in one process). Then a sweep of tile configs per M (to tune the tables in
fitllm/kernels/*.py offline). Writes $OUT/bench_gemm.json; prints a table at the end.

  python3 benchmarks/bench_gemm.py --out $OUT [--no-sweep]
  python3 benchmarks/bench_gemm.py --out $OUT --w4-small [--budget-s 300]
      (w4a16 only, M in W4_SMALL_M: correctness of the table and of every swept config at the real
      shapes, then bf16 cuBLAS / tinygemm / fitllm per M and a sweep of the small-M kernels)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fitllm.kernels import _utils  # noqa: E402
from fitllm.kernels.fp8 import FP8_CONFIGS, fp8_gemm_triton, quantize_fp8_per_token, quantize_fp8_per_token_ref  # noqa: E402
from fitllm.kernels.fp8 import _cfg as f8cfg  # noqa: E402
from fitllm.kernels.w4a16 import W4A16_CONFIGS, dequantize_packed, w4a16_gemm_triton  # noqa: E402
from fitllm.quant.formats.packing import pack_dim0  # noqa: E402
from fitllm.kernels.w4a16 import _cfg as w4cfg  # noqa: E402
from fitllm.kernels.w4a16 import _gemv, _tc  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
CHECK_M = [1, 3, 16, 33, 128, 300, 1000, 4096]
EXTRA_M = (3, 1000)
TIME_M = [1, 16, 64, 256, 512, 1024, 4096]
BW = 4.22e12  # measured copy bandwidth on the lent H200 (bytes/s)
PEAK_BF16 = 790e12  # measured dense bf16 rate there; FP8 taken as twice that
GS = 128
EXTRA_KN = (4096, 4096)  # shape for the variant checks
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# --------------------------------------------------------------------------- weights

def make_w4(K, N, dev, bits=4, gs=None, gidx=False, dtype=torch.bfloat16):
    gs = gs or GS
    q = torch.randint(0, 1 << bits, (K, N), device=dev, dtype=torch.int32)
    G = K // gs
    return dict(qweight=pack_dim0(q, bits), scales=(torch.rand(G, N, device=dev) * 0.01 + 0.002).to(dtype),
                zeros=torch.randint(0, 1 << bits, (G, N), device=dev).to(dtype), group_size=gs, bits=bits,
                g_idx=(torch.randperm(K, device=dev) // gs).to(torch.int32) if gidx else None)


def make_fp8(K, N, dev, per_tensor=False):
    w = (torch.randn(N, K, device=dev) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand((), device=dev) * 0.01 + 0.001 if per_tensor else torch.rand(N, device=dev) * 0.01 + 0.001
    return dict(weight_fp8=w, weight_scale=s)


def rel_err(y, ref):
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y.double() - ref).norm() / ref.norm()).item()


# --------------------------------------------------------------------------- correctness

def check(dev, results):
    log("correctness at real shapes (bf16, g128 asym for w4a16; w8a8 dynamic for fp8)")
    worst = {"w4a16": 0.0, "fp8_w8a8": 0.0, "fp8_w8a16": 0.0, "extras": 0.0}
    rows = []
    for name, (K, N) in SHAPES.items():
        w4 = make_w4(K, N, dev)
        wt64 = dequantize_packed(w4["qweight"], w4["scales"], w4["zeros"], GS, 4, dtype=torch.float64)
        f8 = make_fp8(K, N, dev)
        wf64 = f8["weight_fp8"].double() * f8["weight_scale"].double()[:, None]
        for M in CHECK_M:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)  # poison
            w4a16_gemm_triton(x, **w4, out=y)
            e4 = rel_err(y, x.double() @ wt64)
            xq, xs = quantize_fp8_per_token_ref(x)
            y8 = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
            fp8_gemm_triton(x, **f8, out=y8)
            e8 = rel_err(y8, (xq.double() * xs.double()) @ wf64.t())
            y16 = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
            fp8_gemm_triton(x, **f8, mode="w8a16", out=y16)
            e16 = rel_err(y16, x.double() @ wf64.t())
            worst["w4a16"] = max(worst["w4a16"], e4)
            worst["fp8_w8a8"] = max(worst["fp8_w8a8"], e8)
            worst["fp8_w8a16"] = max(worst["fp8_w8a16"], e16)
            rows.append(dict(shape=name, M=M, w4a16=e4, fp8_w8a8=e8, fp8_w8a16=e16))
            results["correctness"] = dict(rows=rows)
        del w4, wt64, f8, wf64
    # quantization kernel against the reference (same rounding on the GPU)
    x = torch.randn(1000, EXTRA_KN[0], device=dev, dtype=torch.bfloat16) * 3
    q, s = quantize_fp8_per_token(x)
    qr, sr = quantize_fp8_per_token_ref(x)
    quant_mismatch = (q.float() != qr.float()).float().mean().item()
    scale_err = ((s - sr).abs() / sr).max().item()
    # variants on one shape: group sizes, per-channel, act-order, 8-bit, fp16, per-tensor/static fp8
    K, N = EXTRA_KN
    extras = []
    for M in EXTRA_M:
        for kw in (dict(gs=32), dict(gs=64), dict(gs=K), dict(gidx=True), dict(bits=8), dict(bits=8, gidx=True),
                   dict(dtype=torch.float16)):
            dt = kw.pop("dtype", torch.bfloat16)
            try:
                w4 = make_w4(K, N, dev, dtype=dt, **kw)
                x = torch.randn(M, K, device=dev, dtype=dt)
                bias = torch.randn(N, device=dev, dtype=dt)
                y = torch.full((M, N), float("nan"), device=dev, dtype=dt)
                w4a16_gemm_triton(x, **w4, bias=bias, out=y)
                ref = x.double() @ dequantize_packed(w4["qweight"], w4["scales"], w4["zeros"], w4["group_size"],
                                                     w4["bits"], w4["g_idx"], dtype=torch.float64) + bias.double()
                e = rel_err(y, ref)
            except Exception as ex:  # noqa: BLE001
                log(f"  w4a16 variant {kw} M={M} raised {ex!r:.200}")
                e = float("inf")
            extras.append(dict(M=M, kind="w4a16", **{k: str(v) for k, v in kw.items()}, dtype=str(dt), err=e))
            worst["extras"] = max(worst["extras"], e)
        f8 = make_fp8(K, N, dev, per_tensor=True)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        isc = x.float().abs().max() / 448.0
        y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
        fp8_gemm_triton(x, **f8, input_scale=isc, out=y)
        xq = torch.clamp(x.float() / isc, -448, 448).to(torch.float8_e4m3fn)
        e = rel_err(y, (xq.double() * isc.double()) @ (f8["weight_fp8"].double() * f8["weight_scale"].double()).t())
        extras.append(dict(M=M, kind="fp8 static per-tensor", err=e))
        worst["extras"] = max(worst["extras"], e)
    ws, cnt = _utils.splitk_workspace(torch.device(dev), 0, 0)
    clean = bool((ws == 0).all().item() and (cnt == 0).all().item())
    results["correctness"] = dict(rows=rows, extras=extras, worst=worst, quant_mismatch_frac=quant_mismatch,
                                  quant_scale_rel_err=scale_err, splitk_workspace_clean=clean)
    ok = all(v < 1e-2 for v in worst.values()) and quant_mismatch < 1e-3 and clean
    for r in rows:
        log(f"  {r['shape']:8s} M={r['M']:5d} w4a16 {r['w4a16']:.2e} fp8 w8a8 {r['fp8_w8a8']:.2e} w8a16 {r['fp8_w8a16']:.2e}")
    log(f"worst rel err {json.dumps({k: f'{v:.2e}' for k, v in worst.items()})}; quant mismatch {quant_mismatch:.1e}; "
        f"workspace clean {clean}; {'PASS' if ok else 'FAIL'}")
    for r in extras:
        if r["err"] >= 1e-2:
            log("  FAIL", r)
    return ok


# --------------------------------------------------------------------------- timing

def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """fn in a CUDA graph, run once before and once on a side stream (kernels compiled, allocator warm)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_time(fn, target_ms=60.0):
    """µs per call of fn (which runs two layer copies; result is per layer), via CUDA graph replay."""
    g = capture_graph(fn)
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    one = time.perf_counter() - t
    iters = max(3, min(200, int(target_ms / 1e3 / max(one, 1e-6))))
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    meds = []
    for _ in range(3):
        ev[0].record()
        for _ in range(iters):
            g.replay()
        ev[1].record()
        torch.cuda.synchronize()
        meds.append(ev[0].elapsed_time(ev[1]) / iters)
    del g
    return sorted(meds)[1] * 1e3 / 2


class Layer:
    """Two copies of one layer's weights in every format."""

    def __init__(self, dev, fp8=True):
        self.copies = []
        for _ in range(2):
            c = {}
            for name, (K, N) in SHAPES.items():
                w16 = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
                w4 = make_w4(K, N, dev)
                f8 = make_fp8(K, N, dev) if fp8 else None
                tg = None
                try:  # torch's tinygemm: uint8 [N, K/2] packed, innerKTiles=8; scales_and_zeros [G, N, 2]
                    q = torch.randint(0, 16, (N, K), device=dev, dtype=torch.int32)
                    q8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
                    wp = torch.ops.aten._convert_weight_to_int4pack(q8, 8)
                    sz = torch.stack([torch.rand(K // GS, N, device=dev) * 0.01, torch.randn(K // GS, N, device=dev) * 0.01],
                                     dim=-1).to(torch.bfloat16).contiguous()
                    tg = (wp, sz)
                except Exception as e:  # noqa: BLE001
                    log("tinygemm setup failed:", repr(e)[:200])
                c[name] = dict(name=name, w16=w16, w4=w4, f8=f8, tg=tg)
            self.copies.append(c)


def time_all(dev, layer, results, sweep, deadline):
    timing = []
    xs = {}
    for M in TIME_M:
        xs[M] = {K: torch.randn(M, K, device=dev, dtype=torch.bfloat16) for K in (4096, 14336)}
    for M in TIME_M:
        x = xs[M]
        xq = {K: quantize_fp8_per_token(v) for K, v in x.items()}
        outs = {name: torch.empty(M, N, device=dev, dtype=torch.bfloat16) for name, (K, N) in SHAPES.items()}

        def run(per_linear):
            def fn():
                for c in layer.copies:
                    for name, (K, N) in SHAPES.items():
                        per_linear(c[name], x[K], xq[K], outs[name])
            return fn

        methods = {
            "bf16": lambda w, a, aq, o: torch.mm(a, w["w16"].t(), out=o),
            "tinygemm": (lambda w, a, aq, o: torch.ops.aten._weight_int4pack_mm(a, w["tg"][0], GS, w["tg"][1]))
            if layer.copies[0]["o"]["tg"] is not None else None,
            "scaled_mm": lambda w, a, aq, o: torch._scaled_mm(
                aq[0], w["f8"]["weight_fp8"].t(), scale_a=aq[1], scale_b=w["f8"]["weight_scale"].view(1, -1),
                out_dtype=torch.bfloat16),
            "w4a16": lambda w, a, aq, o: w4a16_gemm_triton(a, **w["w4"], out=o),
            "fp8": lambda w, a, aq, o: fp8_gemm_triton(a, **w["f8"], out=o),
            "fp8_gemm": lambda w, a, aq, o: fp8_gemm_triton(a, **w["f8"], x_quant=aq, out=o),
            # what the decoder runs: RMSNorm / SiLU·mul quantize qkv's, gate_up's and down's input
            # (fused.rms_norm / silu_mul with fp8=...), o_proj's comes from attention and is quantized here
            "fp8_fused": lambda w, a, aq, o: fp8_gemm_triton(a, **w["f8"], out=o) if w["name"] == "o"
            else fp8_gemm_triton(a, **w["f8"], x_quant=aq, out=o),
            # the same with the tensor-core kernel asking L2 for PREFETCH_ALT weight tiles before the PDL
            # wait (the table's rows up to M = 64 ask for 2; FITLLM_FP8_PREFETCH, read at graph capture)
            "fp8_fused_alt": lambda w, a, aq, o: with_env("FITLLM_FP8_PREFETCH", str(PREFETCH_ALT), methods["fp8_fused"],
                                                          w, a, aq, o),
        }
        row = {"M": M}
        # two passes, the second in reverse order, best of both: at large M the card's clocks sag over
        # a run (a method timed last measured up to 10 % slower than the same work timed first)
        for k, f in [*methods.items(), *reversed(methods.items())]:
            if f is None:
                row[k] = None
                continue
            try:
                t = graph_time(run(f))
                row[k] = t if row.get(k) is None else min(row[k], t)
            except Exception as e:  # noqa: BLE001
                log(f"M={M} {k} failed: {repr(e)[:300]}")
                row.setdefault(k, None)
        log("M=%d " % M + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "M"))
        if sweep and time.time() < deadline:
            row["sweep_w4a16"] = []
            for cfg in w4_candidates(M):
                if time.time() > deadline:
                    break
                try:
                    t = graph_time(run(lambda w, a, aq, o, cfg=cfg: w4a16_gemm_triton(a, **w["w4"], config=cfg, out=o)),
                                   target_ms=25)
                except Exception as e:  # noqa: BLE001
                    t = None
                    log(f"  w4a16 {cfg} failed: {repr(e)[:200]}")
                row["sweep_w4a16"].append(dict(cfg=cfg, us=t))
            row["sweep_fp8"] = []
            for cfg in f8_candidates(M):
                if time.time() > deadline:
                    break
                try:
                    t = graph_time(run(lambda w, a, aq, o, cfg=cfg: fp8_gemm_triton(a, **w["f8"], config=cfg, x_quant=aq,
                                                                                       out=o)), target_ms=25)
                except Exception as e:  # noqa: BLE001
                    t = None
                    log(f"  fp8 {cfg} failed: {repr(e)[:200]}")
                row["sweep_fp8"].append(dict(cfg=cfg, us=t))
            for key in ("sweep_w4a16", "sweep_fp8"):
                ok = [r for r in row[key] if r["us"] is not None]
                if ok:
                    b = min(ok, key=lambda r: r["us"])
                    log(f"  best {key} M={M}: {b['us']:.1f} us {b['cfg']}  (of " +
                        ", ".join(f"{r['us']:.0f}" for r in ok) + ")")
        timing.append(row)
        results["timing"] = timing
    return timing


# --------------------------------------------------------------------------- small-M w4a16 mode

W4_SMALL_M = [1, 3, 16, 33, 64]


def w4_small_candidates(M):
    g, t, c = _gemv, _tc, w4cfg
    if M <= 4:
        return [g(128, 64, 4, waves=4), g(128, 64, 4, waves=8), g(64, 128, 2, waves=4), g(128, 128, 4, waves=4),
                g(256, 64, 4, waves=4), g(64, 64, 2, waves=8), t(16, 64, 128, 4, 3, 4, swap=True, unpack=2),
                t(16, 64, 128, 4, 3, 4, unpack=1), t(16, 64, 64, 4, 3, 8, swap=True, unpack=2)]
    if M <= 16:
        return [t(16, 64, 128, 4, 3, 4, swap=True, unpack=2), t(16, 64, 128, 4, 3, 4, unpack=2),
                t(16, 64, 128, 4, 3, 4, unpack=1), t(16, 64, 64, 4, 3, 8, unpack=1), t(16, 64, 64, 4, 3, 8, swap=True, unpack=2),
                t(16, 128, 128, 4, 3, 4, swap=True, unpack=3), t(16, 128, 64, 4, 3, 4, swap=True, unpack=2),
                t(16, 64, 128, 4, 3, 2, swap=True, unpack=2), c(16, 64, 128, True, 4, 4, waves=4)]
    return [t(64, 64, 128, 4, 3, 2, unpack=2), t(64, 64, 128, 8, 3, 2, unpack=2), t(64, 64, 64, 4, 3, 4, unpack=1),
            t(32, 64, 128, 4, 3, 2, unpack=2), t(64, 64, 128, 4, 3, 2, swap=True, unpack=2),
            t(64, 128, 64, 8, 3, 2, unpack=1), t(64, 64, 128, 4, 3, 1, unpack=2),
            c(128, 128, 64, False, 8, 4, backend="dequant")]


def w4_small(dev, results, budget_s):
    """Correctness (table path, real shapes, M in W4_SMALL_M, plus group/bits variants) and timing
    against bf16 cuBLAS and tinygemm, then a sweep whose every config is also checked."""
    deadline = T0 + budget_s
    log("w4a16 small-M mode; table:", json.dumps(W4A16_CONFIGS.get("sm90"), default=str)[:400])
    layer = Layer(dev, fp8=False)
    ref_w = {name: dequantize_packed(**{k: v for k, v in layer.copies[0][name]["w4"].items()}, dtype=torch.float32)
             for name in SHAPES}  # [K, N] fp32, exact values of the bf16 (q - z) * s formula up to rounding
    torch.backends.cuda.matmul.allow_tf32 = False
    rows, worst = [], 0.0

    def check_cfg(M, cfg=None, x=None):
        errs = []
        for name, (K, N) in SHAPES.items():
            xx = x[K] if x is not None else torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
            w4a16_gemm_triton(xx, **layer.copies[0][name]["w4"], config=cfg, out=y)
            errs.append(rel_err(y, xx.float() @ ref_w[name]))
        return max(errs)

    for M in W4_SMALL_M:  # the table path, fresh x each time
        e = check_cfg(M)
        rows.append(dict(M=M, err=e))
        worst = max(worst, e)
        log(f"  check table path M={M}: worst rel err over the 4 shapes {e:.2e}")
    K, N = EXTRA_KN
    extras = []
    for M in (1, 3, 16, 33):
        for kw in (dict(gs=32), dict(gs=64), dict(gs=K), dict(gidx=True), dict(bits=8), dict(dtype=torch.float16)):
            dt = kw.pop("dtype", torch.bfloat16)
            try:
                w4 = make_w4(K, N, dev, dtype=dt, **kw)
                x = torch.randn(M, K, device=dev, dtype=dt)
                bias = torch.randn(N, device=dev, dtype=dt)
                y = torch.full((M, N), float("nan"), device=dev, dtype=dt)
                w4a16_gemm_triton(x, **w4, bias=bias, out=y)
                ref = x.double() @ dequantize_packed(w4["qweight"], w4["scales"], w4["zeros"], w4["group_size"],
                                                     w4["bits"], w4["g_idx"], dtype=torch.float64) + bias.double()
                e = rel_err(y, ref)
            except Exception as ex:  # noqa: BLE001
                log(f"  variant {kw} M={M} raised {ex!r:.200}")
                e = float("inf")
            extras.append(dict(M=M, **{k: str(v) for k, v in kw.items()}, dtype=str(dt), err=e))
            worst = max(worst, e)
    ws, cnt = _utils.splitk_workspace(torch.device(dev), 0, 0)
    clean = bool((ws == 0).all().item() and (cnt == 0).all().item())
    results["correctness"] = dict(rows=rows, extras=extras, worst=worst, splitk_workspace_clean=clean)
    bad = [r for r in extras if not r["err"] < 1e-2]
    log(f"worst rel err {worst:.2e} (variants: {len(extras)}, failing {bad}); workspace clean {clean}")
    results["correct"] = worst < 1e-2 and clean

    timing = []
    cands = {M: w4_small_candidates(M)[: (4 if M in (3, 33) else None)] for M in W4_SMALL_M}
    for mi, M in enumerate(W4_SMALL_M):
        left = sum(len(cands[m]) for m in W4_SMALL_M[mi:])
        m_deadline = time.time() + max(0.0, deadline - time.time()) * len(cands[M]) / max(left, 1)
        x = {K: torch.randn(M, K, device=dev, dtype=torch.bfloat16) for K in (4096, 14336)}
        outs = {name: torch.empty(M, N, device=dev, dtype=torch.bfloat16) for name, (K, N) in SHAPES.items()}

        def run(per_linear):
            def fn():
                for c in layer.copies:
                    for name, (K, N) in SHAPES.items():
                        per_linear(c[name], x[K], outs[name])
            return fn

        row = {"M": M}
        for key, f in (("bf16", lambda w, a, o: torch.mm(a, w["w16"].t(), out=o)),
                       ("tinygemm", lambda w, a, o: torch.ops.aten._weight_int4pack_mm(a, w["tg"][0], GS, w["tg"][1])),
                       ("w4a16", lambda w, a, o: w4a16_gemm_triton(a, **w["w4"], out=o))):
            try:
                row[key] = graph_time(run(f))
            except Exception as e:  # noqa: BLE001
                log(f"M={M} {key} failed: {repr(e)[:300]}")
                row[key] = None
        log("M=%d " % M + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "M"))
        row["sweep_w4a16"] = []
        for cfg in cands[M]:
            if time.time() > m_deadline:
                log("  sweep budget spent")
                break
            try:
                e = check_cfg(M, cfg, x)
                t = graph_time(run(lambda w, a, o, cfg=cfg: w4a16_gemm_triton(a, **w["w4"], config=cfg, out=o)),
                               target_ms=20)
            except Exception as ex:  # noqa: BLE001
                e, t = None, None
                log(f"  {cfg} failed: {repr(ex)[:300]}")
            row["sweep_w4a16"].append(dict(cfg=cfg, us=t, err=e))
            log(f"  M={M} {t if t is None else round(t, 1)} us err {e if e is None else f'{e:.1e}'} {cfg}")
        ok = [r for r in row["sweep_w4a16"] if r["us"] is not None and r["err"] is not None and r["err"] < 1e-2]
        if ok:
            b = min(ok, key=lambda r: r["us"])
            row["best_sweep"] = b
            log(f"  best M={M}: {b['us']:.1f} us {b['cfg']}")
        timing.append(row)
        results["timing"] = timing
    return timing


def table_w4(timing):
    lines = ["| M | bf16 cuBLAS | tinygemm | fitllm w4a16 table (x bf16, x tinygemm, % floor) | best swept config (x bf16, % floor) |",
             "|---|---|---|---|---|"]
    for r in timing:
        fl = floors(r["M"])["int4"]
        b, tg, w = r.get("bf16"), r.get("tinygemm"), r.get("w4a16")
        best = r.get("best_sweep") or {}
        bu = best.get("us")
        lines.append(f"| {r['M']} | {b:.0f} | {tg:.0f} | " if b and tg else f"| {r['M']} | {b} | {tg} | ")
        lines[-1] += (f"{w:.1f} ({b / w:.2f}x, {tg / w:.2f}x, {100 * fl / w:.0f}%)" if w and b and tg else "-") + " | "
        lines[-1] += (f"{bu:.1f} ({b / bu:.2f}x, {100 * fl / bu:.0f}%) {best['cfg']['backend']} "
                      f"BM{best['cfg']['BM']} BN{best['cfg']['BN']} BK{best['cfg']['BK']} w{best['cfg']['num_warps']} "
                      f"s{best['cfg']['num_stages']} waves{best['cfg']['waves']} "
                      + " ".join(f"{k}={v}" for k, v in best['cfg'].items() if k in ('SWAP', 'UNPACK', 'SHIFT16'))
                      if bu and b else "-") + " |"
    return "\n".join(lines)


def w4_candidates(M):
    c = w4cfg
    if M <= 16:
        return [c(16, 64, 256, True, 4, 3, 4), c(16, 64, 128, True, 4, 4, 4), c(16, 128, 256, True, 4, 3, 4),
                c(16, 64, 256, True, 4, 3, 8), c(16, 32, 256, True, 4, 3, 8), c(16, 64, 128, False, 4, 4, 4),
                c(16, 64, 512, True, 8, 2, 4)]
    if M <= 64:
        return [c(64, 64, 128, True, 4, 3, 2), c(64, 64, 256, True, 4, 3, 2), c(32, 64, 128, True, 4, 3, 2),
                c(64, 128, 64, False, 4, 4, 1), c(64, 128, 128, True, 8, 3, 1)]
    if M <= 256:
        return [c(64, 128, 64, False, 4, 4, 1), c(128, 128, 64, False, 8, 4, 1), c(128, 128, 128, True, 8, 3, 0),
                c(128, 128, 64, False, 8, 4, backend="dequant")]
    return [c(128, 128, 64, False, 8, 4), c(128, 256, 64, False, 8, 3), c(128, 128, 128, True, 8, 3),
            c(128, 128, 64, False, 8, 4, backend="dequant")]


def f8_candidates(M):
    c = f8cfg
    if M <= 16:
        return [c(16, 64, 256, 4, 4, 4), c(16, 64, 256, 4, 4, 4, swap=True), c(16, 128, 256, 4, 3, 4, swap=True),
                c(16, 128, 128, 4, 4, 8, swap=True), c(16, 64, 512, 4, 3, 4)]
    if M <= 64:
        return [c(64, 64, 256, 4, 4, 2), c(64, 128, 128, 4, 4, 1), c(64, 128, 256, 4, 3, 2, swap=True),
                c(32, 64, 256, 4, 4, 2)]
    if M <= 256:
        return [c(64, 128, 128, 4, 4, 1), c(128, 128, 128, 8, 4, 0), c(128, 128, 128, 8, 4, backend="scaled_mm")]
    return [c(128, 256, 128, 8, 3), c(128, 128, 128, 8, 4), c(128, 128, 128, 8, 4, backend="scaled_mm")]


PREFETCH_ALT = 0  # --prefetch-alt


def with_env(name, value, fn, *args):
    """fn(*args) with the environment variable `name` set to `value` for the call."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn(*args)
    finally:
        if before is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before


def floors(M):
    """Lower bounds (µs) per layer: max(bytes / BW, flops / peak)."""
    P = sum(K * N for K, N in SHAPES.values())
    act = sum(M * (K + N) * 2 for K, N in SHAPES.values())
    flops = 2 * M * P
    return {"bf16": max((2 * P + act) / BW, flops / PEAK_BF16) * 1e6,
            "int4": max((P / 2 + P / GS * 4 + act) / BW, flops / PEAK_BF16) * 1e6,
            "fp8": max((P + act) / BW, flops / (2 * PEAK_BF16)) * 1e6}


def table(timing):
    lines = ["| M | bf16 cuBLAS | tinygemm | _scaled_mm | fitllm w4a16 (x bf16, % floor) | fitllm fp8 (x bf16, % floor) "
             f"| fp8 as the decoder runs it (vs bf16) | the same, L2 prefetch {PREFETCH_ALT} | fp8 gemm only |",
             "|---|---|---|---|---|---|---|---|---|"]
    f = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    for r in timing:
        fl = floors(r["M"])
        b = r.get("bf16")
        w, p = r.get("w4a16"), r.get("fp8")
        lines.append(
            f"| {r['M']} | {f(b)} | {f(r.get('tinygemm'))} | {f(r.get('scaled_mm'))} | "
            + (f"{w:.0f} ({b / w:.2f}x, {100 * fl['int4'] / w:.0f}%)" if w and b else "-") + " | "
            + (f"{p:.0f} ({b / p:.2f}x, {100 * fl['fp8'] / p:.0f}%)" if p and b else "-") + " | "
            + " | ".join(f"{r[k]:.0f} ({b / r[k]:.2f}x)" if r.get(k) and b else "-" for k in ("fp8_fused", "fp8_fused_alt"))
            + f" | {f(r.get('fp8_gemm'))} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--budget-s", type=float, default=230, help="stop sweeping after this many seconds")
    ap.add_argument("--w4-small", action="store_true", help="w4a16 small-M mode (see the module docstring)")
    ap.add_argument("--prefetch-alt", type=int, default=0,
                    help="fp8 weight tiles prefetched to L2 in the A/B column (0: none; the table: 2 up to M = 64)")
    args = ap.parse_args()
    global PREFETCH_ALT
    PREFETCH_ALT = args.prefetch_alt
    dev = "cuda"
    torch.manual_seed(int(time.time()))
    results = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, arch=_utils.gpu_arch(0),
                   configs=dict(w4a16=W4A16_CONFIGS.get("sm90"), fp8=FP8_CONFIGS.get("sm90")))
    import triton
    results["triton"] = triton.__version__
    log(results["gpu"], results["torch"], "triton", triton.__version__)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_gemm.json")

    def dump():
        with open(path, "w") as fh:
            json.dump(results, fh, indent=1, default=str)

    if args.w4_small:
        try:
            w4_small(dev, results, args.budget_s)
        finally:
            results["floors_us"] = {M: round(floors(M)["int4"], 1) for M in W4_SMALL_M}
            dump()
        print("\nµs per layer (4 linears), CUDA-graph replay\n" + table_w4(results.get("timing", [])))
        return

    try:
        results["correct"] = check(dev, results)
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        results["correct"] = f"error: {e!r}"
    dump()
    torch.cuda.empty_cache()
    layer = Layer(dev)
    try:
        time_all(dev, layer, results, not args.no_sweep, T0 + args.budget_s)
    finally:
        dump()
    fl = {M: {k: round(v, 1) for k, v in floors(M).items()} for M in TIME_M}
    results["floors_us"] = fl
    dump()
    print("\nfloors (µs, max of bytes/4.22TB/s and flops/peak):", json.dumps(fl))
    print("\nµs per layer (4 linears), CUDA-graph replay\n" + table(results["timing"]))


if __name__ == "__main__":
    main()
