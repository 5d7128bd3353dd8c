"""FP8 W8A8 tensor-core GEMM configs per Llama-3-8B linear and M (issue 4's fp8 rows): each linear alone,
its activations already quantized (as the decoder hands them over, kernels._utils.Fp8Activations), enough
weight copies per CUDA graph that every read comes from HBM. Every config is checked against a float64
oracle (relative error < 1e-2) before it is timed; the table's own config, torch._scaled_mm and bf16
cuBLAS are timed the same way in the same run. Prints per M the best config of each linear and the
layer sums (table, best per linear, _scaled_mm, bf16). Writes $OUT/fp8_sweep.json.

  python3 benchmarks/fp8_sweep.py --out $OUT [--m 16,64,256,1024,4096] [--budget-s 400] [--more] [--tma | --only-tma]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import SHAPES, make_fp8, rel_err  # noqa: E402
from benchmarks.gemv_explore import graph_us, log  # noqa: E402
from fitllm.kernels import _utils  # noqa: E402
from fitllm.kernels._utils import config_for  # noqa: E402
from fitllm.kernels.fp8 import FP8_CONFIGS, _cfg, _tma_cfg, fp8_gemm_triton, quantize_fp8_per_token  # noqa: E402


def candidates(M: int) -> list[dict]:
    c = _cfg
    if M <= 16:
        return [c(16, bn, bk, w, s, wv, swap=True) for bn, bk, w, s in ((64, 256, 4, 4), (128, 256, 4, 3), (128, 128, 4, 4),
                                                                         (64, 512, 4, 3), (128, 256, 8, 4))
                for wv in (2, 4, 8)]
    if M <= 64:
        return ([c(64, bn, bk, w, s, wv) for bn, bk, w, s in ((64, 256, 4, 4), (128, 128, 4, 4), (128, 256, 8, 3),
                                                               (64, 128, 4, 5)) for wv in (1, 2, 4)]
                + [c(64, 128, 256, 4, 3, wv, swap=True) for wv in (1, 2, 4)])
    if M <= 256:
        return ([c(bm, bn, bk, w, s, wv) for bm, bn, bk, w, s in ((128, 128, 128, 8, 4), (64, 128, 128, 4, 4),
                                                                   (128, 256, 128, 8, 3), (64, 256, 128, 8, 3),
                                                                   (128, 64, 256, 4, 4)) for wv in (0, 1, 2)])
    return [c(bm, bn, bk, w, s) for bm, bn, bk, w, s in ((128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (256, 128, 128, 8, 3),
                                                         (128, 256, 64, 8, 4), (128, 128, 128, 4, 4), (128, 128, 256, 8, 3),
                                                         (64, 256, 128, 8, 3), (128, 64, 128, 4, 4))]


def more_candidates(M: int) -> list[dict]:
    """--more: the neighbours of the table's winners (fourteenth session) at M <= 256."""
    c = _cfg
    if M <= 16:
        return [c(16, 64, 256, 4, s, wv, swap=True) for s in (5, 6) for wv in (1, 2, 3)] + [
            c(16, 32, 256, 4, 4, wv, swap=True) for wv in (2, 4)] + [
            c(16, 128, 256, 8, s, wv, swap=True) for s in (3, 5) for wv in (6, 8, 12)]
    if M <= 64:
        return ([c(64, 64, bk, w, s, wv) for bk, w, s in ((256, 4, 5), (256, 4, 6), (512, 4, 3), (256, 8, 4),
                                                            (128, 4, 6)) for wv in (1, 1.5)]
                + [c(64, 32, 256, 4, 4, wv) for wv in (1, 2)] + [c(32, 64, 256, 4, 4, wv) for wv in (1, 2)]
                + [c(64, 128, 128, 4, s, 1) for s in (5, 6)] + [c(64, 128, 256, 4, 3, 1)])
    if M <= 256:
        return [c(bm, bn, bk, w, s) for bm, bn, bk, w, s in (
            (128, 64, 256, 4, 5), (128, 64, 128, 4, 6), (64, 128, 256, 4, 4), (128, 128, 256, 8, 3),
            (64, 256, 128, 4, 4), (256, 64, 128, 8, 4), (128, 64, 256, 8, 4), (128, 128, 128, 8, 5))]
    return []


def tma_candidates(M: int) -> list[dict]:
    """--tma: the TMA kernel. M <= 64: the pointer rows' winners and neighbours, split over K; M >= 256:
    tile shapes x (persistent + flattened, persistent, one program a tile, persistent +
    warp-specialised, persistent with M-fastest order)."""
    t = _tma_cfg
    if M <= 16:
        return [t(16, bn, bk, 4, s, wv, swap=True) for bn, bk, s in ((64, 256, 4), (64, 256, 6), (128, 128, 4),
                                                                      (128, 256, 3), (32, 256, 6))
                for wv in (1, 2, 4)]
    if M <= 64:
        return ([t(64, bn, bk, 4, s, wv) for bn, bk, s in ((32, 256, 4), (64, 256, 5), (128, 128, 4), (64, 128, 6))
                 for wv in (1, 2)] + [t(64, bn, 256, 4, 4, wv, swap=True) for bn in (64, 128) for wv in (1, 2)])
    if M < 256:
        return []
    tiles = ((128, 256, 128, 8, 3), (128, 256, 128, 8, 4), (128, 128, 128, 8, 4), (128, 128, 128, 4, 4),
             (128, 128, 256, 8, 3), (256, 128, 128, 8, 3), (128, 256, 64, 8, 5), (64, 256, 128, 4, 4))
    kinds = (dict(), dict(flatten=False), dict(persistent=False), dict(warp_spec=True), dict(group_m=64))
    return [t(*tile, **kind) for tile in tiles for kind in kinds]


def name(cfg: dict) -> str:
    tma = ""
    if cfg.get("backend") == "tma":
        tma = (f" tma{' persistent' if cfg['persistent'] else ''}{' flat' if cfg['flatten'] and not cfg['waves'] else ''}"
               f"{' ws' if cfg['warp_spec'] else ''} g{cfg['group_m']}")
    return (f"BM{cfg['BM']} BN{cfg['BN']} BK{cfg['BK']} w{cfg['num_warps']} s{cfg['num_stages']} "
            f"waves{cfg.get('waves', 0)}{' swap' if cfg.get('SWAP') else ''}{tma}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--m", default="16,64,256,1024,4096")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--more", action="store_true", help="also the table winners' neighbours (M <= 256)")
    ap.add_argument("--tma", action="store_true", help="also the TMA kernel's configs (M >= 256)")
    ap.add_argument("--only-tma", action="store_true", help="the table's config and the TMA kernel's only")
    a = ap.parse_args()
    deadline = time.time() + a.budget_s
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "m": {}}
    for M in map(int, a.m.split(",")):
        row_cfg = _utils.pick_config(FP8_CONFIGS, _utils.gpu_arch(0), M)
        rows = {}
        for lin, (K, N) in SHAPES.items():
            table = config_for(row_cfg, N)
            copies = max(2, -(-200_000_000 // (K * N)))
            ws = [make_fp8(K, N, dev) for _ in range(copies)]
            w16 = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(max(2, copies // 2))]
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            xq = quantize_fp8_per_token(x)
            ref = (xq[0].double() * xq[1].double()) @ (ws[0]["weight_fp8"].double()
                                                       * ws[0]["weight_scale"].double()[:, None]).t()
            y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            row = {"bf16": graph_us([lambda w=w: torch.mm(x, w.t(), out=y) for w in w16]),
                   "scaled_mm": graph_us([lambda w=w: torch._scaled_mm(
                       xq[0], w["weight_fp8"].t(), scale_a=xq[1], scale_b=w["weight_scale"].view(1, -1),
                       out_dtype=torch.bfloat16) for w in ws])}
            sweep = []
            cands = [] if a.only_tma else candidates(M) + (more_candidates(M) if a.more else [])
            cands += tma_candidates(M) if a.tma or a.only_tma else []
            for cfg in [table] + cands + [table]:  # table last
                # again too: clocks settle
                if time.time() > deadline:
                    break
                try:
                    y.fill_(float("nan"))
                    fp8_gemm_triton(x, **ws[0], config=cfg, x_quant=xq, out=y)
                    err = rel_err(y, ref)
                    if not err < 1e-2:
                        log(f"  M={M} {lin} {name(cfg)}: rel err {err:.2e}, skipped")
                        continue
                    t = graph_us([lambda w=w, cfg=cfg: fp8_gemm_triton(x, **w, config=cfg, x_quant=xq, out=y)
                                  for w in ws])
                except Exception as e:  # noqa: BLE001  (a config that does not compile, e.g. shared memory)
                    log(f"  M={M} {lin} {name(cfg)} failed: {repr(e)[:160]}")
                    continue
                sweep.append({"cfg": cfg, "us": t})
            row["table"] = min((r["us"] for r in sweep if r["cfg"] is table), default=None)
            best = min(sweep, key=lambda r: r["us"]) if sweep else None
            row["best"], row["best_cfg"] = (best["us"], name(best["cfg"])) if best else (None, None)
            row["sweep"] = [{"cfg": name(r["cfg"]), "us": r["us"]} for r in sweep]
            rows[lin] = row
            log(f"M={M:5d} {lin:8s} bf16 {row['bf16']:7.1f}  scaled_mm {row['scaled_mm']:7.1f}  table {row['table']}  "
                f"best {row['best']} ({row['best_cfg']})")
            del ws, w16
            torch.cuda.empty_cache()
        tot = {k: sum(r[k] for r in rows.values()) if all(r.get(k) for r in rows.values()) else None
               for k in ("bf16", "scaled_mm", "table", "best")}
        res["m"][M] = {"linears": rows, "layer": tot}
        log(f"M={M:5d} LAYER " + "  ".join(f"{k} {v:.1f}" for k, v in tot.items() if v)
            + (f"  table {tot['bf16'] / tot['table']:.2f}x bf16, best {tot['bf16'] / tot['best']:.2f}x"
               if tot["table"] and tot["best"] else ""))
        with open(os.path.join(a.out, "fp8_sweep.json"), "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
