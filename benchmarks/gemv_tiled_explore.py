"""Batch-1 W4A16 on the tiled layout, per Llama-3-8B linear: how far each linear is from what a
plain read of the same bytes costs on this GPU, and which GEMV knobs win per shape.

Each linear is timed alone, with enough weight copies per CUDA graph that every read comes from
HBM. Columns: bf16 cuBLAS, torch tinygemm, a streaming-read floor (a Triton kernel that only reads
the linear's words + scales + zeros with 16-byte loads: the cost of the bytes at this size,
launch and ramp included), fitllm's table, an optional baseline module (an earlier
w4a16_tiled_triton) and a sweep of GEMV configs (BN, UNROLL, warps, split-K waves). Every config is
checked against a float64 oracle before it is timed. Writes $OUT/gemv_tiled_explore.json.

  python3 benchmarks/gemv_tiled_explore.py --out $OUT [--baseline MODULE] [--budget-s 240]
  python3 benchmarks/gemv_tiled_explore.py --out $OUT --layer-floor   # a layer's bytes: 1 launch vs 4
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
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import GS, SHAPES, make_w4, rel_err  # noqa: E402
from benchmarks.gemv_explore import graph_us, log  # noqa: E402
from fitllm.kernels._pdl import let_next_launch, wait_for_previous  # noqa: E402
from fitllm.kernels._utils import pdl_args, splitk_workspace  # noqa: E402
from fitllm.kernels.w4a16_tiled import _gemv, dequantize_tiled_ref, tile_pack, tile_unpack, w4a16_tiled_triton  # noqa: E402
from fitllm.quant.formats.packing import pack_dim0  # noqa: E402

BW = 4.22e12


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _read_one(ptr, n, acc, BLOCK: tl.constexpr, U: tl.constexpr):
    """Grid-stride over U * BLOCK words a step, U independent 16-byte loads a thread in flight. (Until the
    thirty-sixth session one load a step, each waiting out the last: on an H100 gate_up's bytes in 24.7
    instead of 22.5 µs, so the floor was set too high.)"""
    for start in range(tl.program_id(0) * BLOCK * U, n, tl.num_programs(0) * BLOCK * U):
        for u in tl.static_range(U):
            offs = start + u * BLOCK + tl.arange(0, BLOCK)
            acc ^= tl.load(ptr + offs, mask=offs < n, other=0, cache_modifier=".cg")
    return acc


@triton.jit
def _read_kernel(a_ptr, n_a, b_ptr, n_b, c_ptr, n_c, out_ptr, BLOCK: tl.constexpr, U: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Reads three int32 buffers once (grid-stride, 16-byte loads), writes one word per program. PDL: as the
    product's big kernels (wait, main loop, release)."""
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    wait_for_previous(PDL)
    acc = _read_one(a_ptr, n_a, acc, BLOCK, U)
    acc = _read_one(b_ptr, n_b, acc, BLOCK, U)
    acc = _read_one(c_ptr, n_c, acc, BLOCK, U)
    let_next_launch(PDL)
    tl.store(out_ptr + tl.program_id(0), tl.reduce(acc, 0, _xor))


def read_floor(w, out):
    """The cost of streaming the linear's words, scales and zeros from HBM: one program a word of `out`
    (callers give 4 per SM), 8 warps, 4 loads in flight a thread."""
    words = (w["qtile"].view(-1), w["scales"].view(torch.int32).view(-1), w["zeros"].view(torch.int32).view(-1))
    _read_kernel[(out.numel(),)](words[0], words[0].numel(), words[1], words[1].numel(), words[2], words[2].numel(),
                                 out, BLOCK=1024, U=4, num_warps=8)


def read_words(words, out, pdl=False):
    """One launch reading the int32 buffer `words` once: one program a word of `out`, as read_floor."""
    _read_kernel[(out.numel(),)](words, words.numel(), words, 0, words, 0, out, BLOCK=1024, U=4, num_warps=8,
                                 **(pdl_args(words) if pdl else {}))


def layer_floor(dev):
    """A layer's bytes (the four linears' words, scales and zeros; random, 4 copies: every read from HBM)
    read by one launch, by four (one a linear) without and with PDL, against the table's four GEMVs at M = 1
    with their split-K sums ended and left pending (as the decoder runs them: the kernel after each linear
    takes the sum; here nothing does, so it is timing only and the workspace is zeroed after). µs a layer."""
    sizes = [(K * N // 2 + 2 * (K // GS) * N * 2) // 4 for K, N in SHAPES.values()]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = torch.empty(4 * sms, device=dev, dtype=torch.int32)
    copies = [torch.randint(-2**31, 2**31 - 1, (sum(sizes),), device=dev, dtype=torch.int32) for _ in range(4)]

    def four(buf, pdl):
        for part in buf.split(sizes):
            read_words(part, out, pdl)
    res = {"MB": sum(sizes) * 4 / 1e6,
           "one launch": graph_us([lambda b=b: read_words(b, out) for b in copies]),
           "four launches": graph_us([lambda b=b: four(b, False) for b in copies]),
           "four launches, PDL": graph_us([lambda b=b: four(b, True) for b in copies])}
    del copies
    torch.cuda.empty_cache()
    lin = []
    for K, N in SHAPES.values():
        _, qts = hbm_copies(K, N, dev)
        lin.append((torch.randn(1, K, device=dev, dtype=torch.bfloat16), torch.empty(1, N, device=dev,
                                                                                      dtype=torch.bfloat16), qts))
    n = min(len(q) for _, _, q in lin)

    def chain(i, defer):
        for x, y, qts in lin:
            if defer:
                w4a16_tiled_triton(x, **qts[i], defer=True)
            else:
                w4a16_tiled_triton(x, **qts[i], out=y)
    res["GEMVs, sums ended"] = graph_us([lambda i=i: chain(i, False) for i in range(n)])
    res["GEMVs, sums pending"] = graph_us([lambda i=i: chain(i, True) for i in range(n)])
    splitk_workspace(torch.device(dev), 1, 1)[0].zero_()
    print(f"\n| a layer's bytes ({res['MB']:.1f} MB), M = 1 | µs | TB/s |\n|---|---|---|")
    for k, v in res.items():
        if k != "MB":
            print(f"| {k} | {v:.1f} | {res['MB'] / v:.2f} |")
    return res


def configs(fine_waves: bool = False, regs: bool = False):
    if regs:  # register caps (more programs per SM) x split-K
        return [_gemv(bn, u, w, wv, maxnreg=r) for bn, u, w in ((128, 4, 8), (64, 4, 4), (128, 1, 8))
                for r in (None, 56, 48, 40) for wv in (4, 5, 6)]
    if fine_waves:  # the table's families with many split-K counts: how much the last partial wave costs
        return [_gemv(bn, u, w, wv) for bn, u, w in ((128, 1, 8), (128, 2, 8), (128, 4, 8))
                for wv in (3, 4, 5, 6, 8, 12)]
    out = [_gemv(bn, u, w, wv) for bn, u, w, wv in itertools.product((64, 128), (1, 2, 4), (4, 8), (1, 2, 4))]
    return out + [_gemv(32, 2, 4, wv) for wv in (1, 2, 4)] + [_gemv(256, 1, 8, wv) for wv in (1, 2)]


def name(c):
    return f"gemv BN{c['BN']} U{c['UNROLL']} w{c['num_warps']} waves{c['waves']} regs{c.get('maxnreg')}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--baseline", default=None, help="module with an earlier w4a16_tiled_triton")
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--fine-waves", action="store_true", help="sweep split-K finely for the table's configs")
    ap.add_argument("--regs", action="store_true", help="sweep register caps (maxnreg) x split-K")
    ap.add_argument("--layer-floor", action="store_true", help="only the layer in one launch vs four (layer_floor)")
    a = ap.parse_args()
    if a.layer_floor:
        res = layer_floor("cuda")
        json.dump(dict(res, device=torch.cuda.get_device_name()), open(os.path.join(a.out, "layer_floor.json"), "w"),
                  indent=1)
        return
    deadline = time.time() + a.budget_s
    dev = "cuda"
    torch.manual_seed(0)
    baseline = importlib.import_module(a.baseline) if a.baseline else None
    res = {"device": torch.cuda.get_device_name(), "linears": {}}
    cfgs = configs(a.fine_waves, a.regs)
    for lin, (K, N) in SHAPES.items():
        nbytes, qts = hbm_copies(K, N, dev)
        ws = [dict(qt=qt, w16=torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02) for qt in qts]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        ref = x.double() @ dense64(ws[0]["qt"])
        y = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
        sink = torch.empty(4 * 132, device=dev, dtype=torch.int32)
        row = {"bytes": nbytes, "roofline_us": nbytes / BW * 1e6, "copies": len(ws)}
        row["bf16"] = graph_us([lambda w=w: torch.mm(x, w["w16"].t(), out=y) for w in ws])
        row["read_floor"] = graph_us([lambda w=w: read_floor(w["qt"], sink) for w in ws])
        row["table"] = graph_us([lambda w=w: w4a16_tiled_triton(x, **w["qt"], out=y) for w in ws])
        if baseline is not None:  # on words packed by its own tile_pack (the layout may differ)
            base = [dict(w["qt"], qtile=baseline.tile_pack(pack_dim0(tile_unpack(w["qt"]["qtile"], K), 4))) for w in ws]
            row["baseline"] = graph_us([lambda q=q: baseline.w4a16_tiled_triton(x, **q, out=y) for q in base])
        sweep = {}
        for c in cfgs:
            if time.time() > deadline:
                log("budget reached: sweep cut short")
                break
            out = torch.full((1, N), float("nan"), device=dev, dtype=torch.bfloat16)
            w4a16_tiled_triton(x, **ws[0]["qt"], config=c, out=out)
            err = rel_err(out, ref)
            if not err < 1e-2:
                log(f"  {lin} {name(c)}: rel err {err:.2e}, skipped")
                continue
            sweep[name(c)] = graph_us([lambda w=w, c=c: w4a16_tiled_triton(x, **w["qt"], config=c, out=y) for w in ws])
        row["sweep"] = sweep
        best = min(sweep.items(), key=lambda kv: kv[1]) if sweep else ("-", float("nan"))
        row["best"] = best
        log(f"{lin} K={K} N={N}: roofline {row['roofline_us']:.1f}  read floor {row['read_floor']:.1f}  bf16 "
            f"{row['bf16']:.1f}  table {row['table']:.1f}  baseline {row.get('baseline', float('nan')):.1f}  "
            f"best {best[1]:.1f} {best[0]}")
        res["linears"][lin] = row
        json.dump(res, open(os.path.join(a.out, "gemv_tiled_explore.json"), "w"), indent=1)
        del ws
        torch.cuda.empty_cache()
    print("\n| linear | roofline | read floor | bf16 | table | baseline | best | best config |")
    print("|---|---|---|---|---|---|---|---|")
    tot = {k: 0.0 for k in ("roofline_us", "read_floor", "bf16", "table", "baseline")}
    tot_best = 0.0
    for lin, r in res["linears"].items():
        for k in tot:
            tot[k] += r.get(k, float("nan"))
        tot_best += r["best"][1]
        print(f"| {lin} | {r['roofline_us']:.1f} | {r['read_floor']:.1f} | {r['bf16']:.1f} | {r['table']:.1f} | "
              f"{r.get('baseline', float('nan')):.1f} | {r['best'][1]:.1f} | {r['best'][0]} |")
    print(f"| layer | {tot['roofline_us']:.1f} | {tot['read_floor']:.1f} | {tot['bf16']:.1f} | {tot['table']:.1f} | "
          f"{tot['baseline']:.1f} | {tot_best:.1f} | per-linear best |")


def hbm_copies(K, N, dev):
    """(bytes of one copy, random tiled int4 weights [K, N] in enough copies that a CUDA graph
    replaying one call per copy reads every byte from HBM, not L2)."""
    nbytes = K * N // 2 + 2 * (K // GS) * N * 2
    qts = []
    for _ in range(max(2, -(-200_000_000 // nbytes))):
        w4 = make_w4(K, N, dev)
        qts.append(dict(qtile=tile_pack(w4["qweight"]), scales=w4["scales"], zeros=w4["zeros"], group_size=GS, K=K))
    return nbytes, qts


def dense64(qt):
    """The float64 weight [K, N] the tiled words encode (the oracle)."""
    return dequantize_tiled_ref(qt["qtile"], qt["scales"], qt["zeros"], qt["group_size"], qt["K"],
                                torch.float64).t()


if __name__ == "__main__":
    main()
