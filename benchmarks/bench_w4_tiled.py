"""The tiled-layout W4A16 kernel (fitllm/kernels/w4a16_tiled.py) on the GPU: correctness at the real
shapes, then speed per M against bf16 cuBLAS, torch's tinygemm and fitllm's standard-layout table,
with a sweep of tile configs (every swept config is checked for correctness first).

One Llama-3-8B layer's four linears (as benchmarks/bench_gemm.py: CUDA-graph replay of two weight
copies, µs per layer), also as the decoder runs them: split-K sums left pending for the kernel after
each linear (column "decoder"). Writes $OUT/bench_w4_tiled.json; prints a table at the end.

  python3 benchmarks/bench_w4_tiled.py --out $OUT [--budget-s 420] [--m 1,16,64]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import BW, GS, SHAPES, graph_time, log, make_w4, rel_err  # noqa: E402
from fitllm.kernels._utils import pick_config, splitk_workspace  # noqa: E402
from fitllm.kernels.w4a16 import dequantize_packed, w4a16_gemm_triton  # noqa: E402
from fitllm.kernels.w4a16_tiled import TILED_CONFIGS, _gemv, _tiled, _ws, tile_pack, w4a16_tiled_triton  # noqa: E402

CHECK_M = [1, 3, 7, 16, 24, 33, 100, 128, 200, 300, 512, 1000, 4096]  # issue 4's M and one inside every table row
TIME_M = [1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]
INT4_BYTES = sum(K * N // 2 + 2 * (K // GS) * N * 2 for K, N in SHAPES.values())  # words + bf16 scales, zeros


def candidates(M):
    t = _tiled
    if M <= 2:  # around the table's GEMV row (BN 128 / 1 tile a step / 8 warps for M=1) and the tc row for M=2
        return [_gemv(128, 1, 8, w) for w in (2, 4, 6)] + [_gemv(128, 4, 8, 4), _gemv(128, 2, 8, 4), _gemv(256, 1, 8, 2)] + \
               [t(16, 64, 4, 3, w) for w in (2, 3, 4, 6, 8)] + [t(16, 64, 4, 4, 4), t(16, 128, 8, 3, 2)]
    if M <= 16:
        return [t(16, 64, 4, 3, w) for w in (2, 3, 4, 6, 8)] + [t(16, 64, 4, 4, 4), t(16, 128, 8, 3, 2),
                                                              t(16, 128, 8, 3, 4), t(16, 64, 4, 3, 4, True)]
    if M <= 32:
        return [t(32, 64, 4, 3, w) for w in (2, 3, 4, 6, 8)] + [t(32, 128, 8, 3, 2), t(32, 64, 4, 3, 3, True),
                                                              t(32, 128, 4, 3, 2), t(32, 128, 4, 3, 4)]
    if M <= 64:
        return [t(64, 64, 4, 3, w, siw) for w in (1, 2, 3, 4, 6) for siw in (False, True)] + \
               [t(64, 128, 8, 3, 2), t(64, 128, 8, 3, 1, True), t(64, 64, 4, 4, 2, True)] + \
               [t(64, 128, 4, 3, w) for w in (2, 3, 4)]
    if M <= 256:
        return [t(128, 128, 8, 3, 1, True), t(64, 128, 8, 3, 1, True), t(64, 64, 4, 3, 1, True),
                t(128, 64, 4, 3, 1, True), t(128, 128, 8, 4, 1, True), t(0, 0, 4, 1, backend="dequant")]
    return [_ws(128, 3), _ws(128, 4), _ws(256, 2), _ws(256, 3), t(128, 128, 8, 4, 0, True),
            t(0, 0, 4, 1, backend="dequant")]


class Weights:
    """Two copies of the layer: bf16, standard int4 (w4), tiled int4, tinygemm."""

    def __init__(self, dev):
        self.copies = []
        for _ in range(2):
            c = {}
            for name, (K, N) in SHAPES.items():
                w4 = make_w4(K, N, dev)
                tg = None
                try:
                    q = torch.randint(0, 16, (N, K), device=dev, dtype=torch.int32)
                    wp = torch.ops.aten._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), 8)
                    sz = torch.stack([torch.rand(K // GS, N, device=dev) * 0.01, torch.randn(K // GS, N, device=dev) * 0.01],
                                     dim=-1).to(torch.bfloat16).contiguous()
                    tg = (wp, sz)
                except Exception as e:  # noqa: BLE001
                    log("tinygemm setup failed:", repr(e)[:200])
                c[name] = dict(w16=torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02, w4=w4,
                               qt=dict(qtile=tile_pack(w4["qweight"]), scales=w4["scales"], zeros=w4["zeros"],
                                       group_size=GS, K=K), tg=tg)
            self.copies.append(c)


def probe_start(default_m: str, ref_copy: int = 0):
    """What the W4A16 probes start with: --out (made) and --m parsed, two weight copies on the GPU
    (seed 0), float64 dequantized weights of one copy. Returns (args, [M...], weights, references)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--m", default=default_m)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    W = Weights("cuda")
    ref_w = {n: dequantize_packed(**W.copies[ref_copy][n]["w4"], dtype=torch.float64) for n in SHAPES}
    return a, [int(m) for m in a.m.split(",")], W, ref_w


def check_tiled(dev, W, ref_w, M, cfg=None):
    errs = []
    for name, (K, N) in SHAPES.items():
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)  # poison
        w4a16_tiled_triton(x, **W.copies[0][name]["qt"], config=cfg, out=y)
        errs.append(rel_err(y, x.double() @ ref_w[name]))
    return max(errs)


def variants(dev):
    """Group 32 / 64 / per-channel, fp16, bias, K not a multiple of 128, both scale modes, dequant."""
    out = []
    for M in (1, 3, 1000):
        for kw in (dict(gs=32), dict(gs=64), dict(gs=4096), dict(dtype=torch.float16), dict(K=576, gs=64),
                   dict(scale_in_w=True), dict(gs=64, scale_in_w=True), dict(dequant=True, gs=64)):
            kw = dict(kw)
            dt, K = kw.pop("dtype", torch.bfloat16), kw.pop("K", 4096)
            siw, dq = kw.pop("scale_in_w", False), kw.pop("dequant", False)
            N = 4096
            w4 = make_w4(K, N, dev, dtype=dt, **kw)
            x = torch.randn(M, K, device=dev, dtype=dt)
            bias = torch.randn(N, device=dev, dtype=dt)
            y = torch.full((M, N), float("nan"), device=dev, dtype=dt)
            bm = 16 if M < 64 else 128
            cfg = _tiled(0, 0, 4, 1, backend="dequant") if dq else _tiled(bm, 128, 8, 3, 2 if M < 64 else 0, siw)
            if M == 1 and not (dq or siw):
                cfg = None  # the table: the batch-1 GEMV where the group size allows
            w4a16_tiled_triton(x, tile_pack(w4["qweight"]), w4["scales"], w4["zeros"], w4["group_size"], K, bias=bias,
                               config=cfg, out=y)
            ref = x.double() @ dequantize_packed(w4["qweight"], w4["scales"], w4["zeros"], w4["group_size"], 4,
                                                 dtype=torch.float64) + bias.double()
            e = rel_err(y, ref)
            out.append(dict(M=M, K=K, gs=kw.get("gs", GS), dtype=str(dt), scale_in_w=siw, dequant=dq, err=e))
            log(f"  variant M={M} K={K} gs={kw.get('gs', GS)} {dt} scale_in_w={siw} dequant={dq}: {e:.2e}")
    return out


def model_check(shape="smollm2-135m"):
    """A whole random model, int4 RTN: logits with the tiled layout vs the standard layout (same
    integers and scales; only the kernels differ) and vs the bf16 model."""
    import copy

    from benchmarks.gpu_engine_check import random_model
    from fitllm.quant.inplace import quantize_in_memory
    from fitllm.quant.pipeline import CalibContext

    base = random_model(shape, "cuda", torch.bfloat16)
    models = {}
    for layout in ("tiled", "standard"):
        os.environ["FITLLM_W4_LAYOUT"] = layout
        models[layout] = quantize_in_memory(copy.deepcopy(base), "int4")
    os.environ.pop("FITLLM_W4_LAYOUT")
    kinds = {layout: type(next(m for m in models[layout].modules() if hasattr(m, "parts")).parts[0]).__name__
             for layout in models}
    ids = torch.randint(0, base.config.vocab_size, (96,), device="cuda")
    pos = torch.arange(96, device="cuda")
    with torch.inference_mode():
        logits = {k: m.compute_logits(m(ids, pos, CalibContext(1, 96))).float() for k, m in
                  [("bf16", base)] + list(models.items())}
    e = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    out = dict(shape=shape, weight_types=kinds, tiled_vs_standard=e(logits["tiled"], logits["standard"]),
               standard_vs_bf16=e(logits["standard"], logits["bf16"]), tiled_vs_bf16=e(logits["tiled"], logits["bf16"]),
               argmax_agree=(logits["tiled"].argmax(-1) == logits["standard"].argmax(-1)).float().mean().item())
    # split-K sums left pending for the fused kernels (the default) vs finished in each GEMM, at the
    # tensor-core kernel's M (96 tokens) and the batch-1 GEMV's (one token at a time)
    for tokens in (96, 1):
        got = {}
        for defer in ("1", "0", "0 again"):  # the last: what atomics' order alone changes
            os.environ["FITLLM_SPLITK_DEFER"] = defer[0]
            with torch.inference_mode():
                got[defer] = torch.cat([models["tiled"].compute_logits(models["tiled"](
                    ids[i:i + tokens], pos[i:i + tokens], CalibContext(1, tokens))).float() for i in range(0, 8, tokens)])
        os.environ.pop("FITLLM_SPLITK_DEFER")
        out[f"defer_vs_not_M{tokens}"] = e(got["1"], got["0"])
        out[f"not_vs_not_M{tokens}"] = e(got["0 again"], got["0"])
        out[f"defer_argmax_agree_M{tokens}"] = (got["1"].argmax(-1) == got["0"].argmax(-1)).float().mean().item()
    # the same over a paged bf16 cache, where RoPE rides in the cache write's launch and qkv_proj's sum is
    # taken there too: a prefill of 88 tokens, then 8 decode steps
    got = {}
    for defer in ("1", "0", "0 again"):
        os.environ["FITLLM_SPLITK_DEFER"] = defer[0]
        got[defer] = paged_logits(models["tiled"], ids)
    os.environ.pop("FITLLM_SPLITK_DEFER")
    out["paged_defer_vs_not"], out["paged_not_vs_not"] = e(got["1"], got["0"]), e(got["0 again"], got["0"])
    out["paged_defer_argmax_agree"] = (got["1"].argmax(-1) == got["0"].argmax(-1)).float().mean().item()
    log(f"model check {shape}: {out}")
    return out


def paged_logits(model, ids, prefill: int = 88):
    """Logits of the last prefill token and of each decode step after it, over a fresh paged bf16 cache."""
    from fitllm.models.kv_cache import AttentionMetadata, ForwardContext, PagedKVCache

    c, dev = model.config, ids.device
    cache = PagedKVCache(c.num_layers, 8, 16, c.num_kv_heads, c.head_dim, dtype=torch.bfloat16, device=dev,
                         kv_dtype="bf16")
    table = list(range(8))
    rows = []
    with torch.inference_mode():
        for lo, hi in [(0, prefill)] + [(t, t + 1) for t in range(prefill, ids.numel())]:
            meta = AttentionMetadata.build([hi - lo], [hi], [table], 16, dev)
            pos = torch.arange(lo, hi, device=dev)
            rows.append(model.compute_logits(model(ids[lo:hi], pos, ForwardContext(cache, meta))[-1:]).float())
    return torch.cat(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--m", default=None, help="comma-separated M values to time (default: all)")
    ap.add_argument("--no-sweep", action="store_true", help="time the table only")
    ap.add_argument("--check-only", action="store_true",
                    help="correctness only (e.g. under compute-sanitizer --tool memcheck), no timing")
    ap.add_argument("--model-check", action="store_true", help="also compare whole-model logits (SmolLM2 shape)")
    ap.add_argument("--baseline", default=None,
                    help="module with an earlier w4a16_tiled_triton (e.g. a copy of the last commit's file under "
                         "fitllm/kernels/) timed in the same run as column 'baseline'")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    deadline = time.time() + a.budget_s
    baseline = importlib.import_module(a.baseline) if a.baseline else None
    dev = "cuda"
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "table": TILED_CONFIGS.get("sm90")}
    W = Weights(dev)
    if baseline is not None:
        for c in W.copies:
            for w in c.values():
                w["qt_base"] = dict(w["qt"], qtile=baseline.tile_pack(w["w4"]["qweight"]))
    ref_w = {name: dequantize_packed(**W.copies[0][name]["w4"], dtype=torch.float64) for name in SHAPES}
    log("correctness, table path, real shapes")
    res["check"] = [dict(M=M, err=check_tiled(dev, W, ref_w, M)) for M in CHECK_M]
    for r in res["check"]:
        log(f"  M={r['M']:5d} worst rel err {r['err']:.2e}")
    res["variants"] = variants(dev)
    worst = max([r["err"] for r in res["check"]] + [r["err"] for r in res["variants"]])
    log(f"worst rel err {worst:.2e} {'PASS' if worst < 1e-2 else 'FAIL'}")
    if a.model_check:
        res["model_check"] = model_check()
    if a.check_only:
        json.dump(res, open(os.path.join(a.out, "bench_w4_tiled.json"), "w"), indent=1, default=str)
        return

    rows = []
    for M in [int(m) for m in a.m.split(",")] if a.m else TIME_M:
        x = {K: torch.randn(M, K, device=dev, dtype=torch.bfloat16) for K in (4096, 14336)}
        outs = {name: torch.empty(M, N, device=dev, dtype=torch.bfloat16) for name, (K, N) in SHAPES.items()}

        def layer(per_linear):
            def fn():
                for c in W.copies:
                    for name, (K, N) in SHAPES.items():
                        per_linear(c[name], x[K], outs[name])
            return fn

        methods = {
            "bf16": lambda w, a_, o: torch.mm(a_, w["w16"].t(), out=o),
            "tinygemm": lambda w, a_, o: torch.ops.aten._weight_int4pack_mm(a_, w["tg"][0], GS, w["tg"][1]),
            "standard": lambda w, a_, o: w4a16_gemm_triton(a_, **w["w4"], out=o),
            "tiled": lambda w, a_, o: w4a16_tiled_triton(a_, **w["qt"], out=o),
            # as the decoder runs it: split-K sums left pending for the next kernel (RMSNorm, SiLU·mul,
            # RoPE + cache write), which rounds them and zeroes the workspace (_utils.PendingSum). Timing
            # only: nothing takes them here, so the workspace is zeroed after the timings.
            "decoder": lambda w, a_, o: w4a16_tiled_triton(a_, **w["qt"], defer=True),
        }
        if baseline is not None:  # on words packed by its own tile_pack (the layout may differ)
            methods["baseline"] = lambda w, a_, o: baseline.w4a16_tiled_triton(a_, **w["qt_base"], out=o)
        row = {"M": M}
        # both orders, best of the two (a method's place in the run moves its time by a few %)
        for k, f in [*methods.items(), *reversed(methods.items())]:
            try:
                t = graph_time(layer(f))
                row[k] = t if row.get(k) is None else min(row[k], t)
            except Exception as e:  # noqa: BLE001
                log(f"M={M} {k} failed: {repr(e)[:300]}")
                row.setdefault(k, None)
        splitk_workspace(torch.device(dev), 1, 1)[0].zero_()  # what "decoder" left pending
        sweep = []
        for cfg in [] if a.no_sweep else candidates(M):
            if time.time() > deadline:
                log("budget reached: sweep cut short")
                break
            try:
                err = check_tiled(dev, W, ref_w, M, cfg)
                us = graph_time(layer(lambda w, a_, o, cfg=cfg: w4a16_tiled_triton(a_, **w["qt"], config=cfg, out=o)),
                                target_ms=25)
            except Exception as e:  # noqa: BLE001
                log(f"  M={M} {cfg} failed: {repr(e)[:300]}")
                continue
            sweep.append(dict(cfg=cfg, us=us, err=err))
            log(f"  M={M} {cfg['backend']} BN{cfg['BN']} w{cfg['num_warps']} waves{cfg['waves']} wide{cfg.get('wide')}: "
                f"{us:.1f} us, err {err:.2e}")
        ok = [s for s in sweep if s["err"] < 1e-2]
        best = min(ok, key=lambda s: s["us"]) if ok else None
        if best is None and row["tiled"] is not None:  # no sweep: the table is the best we know
            best = dict(cfg=pick_config(TILED_CONFIGS, "sm90", M), us=row["tiled"], err=None)
        row["best"] = best
        row["sweep"] = sweep
        floor = INT4_BYTES / BW * 1e6
        log(f"M={M:5d} bf16 {row['bf16']:.1f}  tinygemm {row['tinygemm'] or 0:.1f}  standard {row['standard']:.1f}  "
            f"tiled-table {row['tiled'] or 0:.1f}  as the decoder runs it {row['decoder'] or 0:.1f}  baseline {row.get('baseline') or 0:.1f}  best {best['us'] if best else 0:.1f} {best['cfg'] if best else ''}"
            f"  (int4 floor {floor:.1f})")
        rows.append(row)
        res["timing"] = rows
        json.dump(res, open(os.path.join(a.out, "bench_w4_tiled.json"), "w"), indent=1, default=str)
    print("\n| M | bf16 cuBLAS | tinygemm | fitllm standard | baseline | tiled table | tiled table as the decoder runs it "
          "(vs bf16) | tiled best (vs bf16) | best config |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["best"]
        bs = f"{b['us']:.1f} ({r['bf16'] / b['us']:.2f}x)" if b else "-"
        c = b["cfg"] if b else {}
        cfg = (f"{c['backend']} BM{c['BM']} BN{c['BN']} w{c['num_warps']} s{c['num_stages']} waves{c['waves']} "
               f"siw{int(c.get('SCALE_IN_W', False))} unroll{c.get('UNROLL', '-')}") if b else ""
        fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else "-"  # noqa: E731
        dec = f"{r['decoder']:.1f} ({r['bf16'] / r['decoder']:.2f}x)" if r.get("decoder") else "-"
        print(f"| {r['M']} | {fmt(r['bf16'])} | {fmt(r['tinygemm'])} | {fmt(r['standard'])} | {fmt(r.get('baseline'))} | "
              f"{fmt(r['tiled'])} | {dec} | {bs} | {cfg} |")


if __name__ == "__main__":
    main()
