"""Batch-1 W4A16 GEMV with its weight tiles fetched by TMA (cp.async.bulk.tensor into a ring of
shared-memory stages, `tl.range(..., num_stages=S)`), against the table's GEMV, per Llama-3-8B linear.

Why: the table's GEMV keeps one 8 KB word tile per program in flight (register loads issued just
before their math), ~32 KB per SM at 4 programs per SM, which by Little's law caps it near 2-3 TB/s
(ncu: 58.7 % of issue gaps on L1TEX, DRAM 45 %; RESULTS.md, fifth session). A TMA ring holds S tiles
per program at no register cost. Same math as the table's GEMV (w4a16_tiled._one_row_dot), so only
the fetch differs. Fetch modes (see _tma_gemv_kernel): "row" (each row's words in row order, box
[BN, 16]: the tenth session's probe), "tile16" / "tile256" (the product's tile-major storage as 64-byte
or 1 KB box lines), and "ptr" (plain pointer loads of that storage in the same loop) with "+mask",
"+pdl", "+m" adding the product GEMV's word-row mask, PDL and runtime x-row mask one at a time
(twelfth session: those masks were what made the product slower than "ptr").

Each linear is timed alone with enough weight copies per CUDA graph that every read comes from HBM
(gemv_tiled_explore's harness); every config is checked against a float64 oracle first.

  python3 benchmarks/gemv_tma_probe.py --out $OUT [--budget-s 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import SHAPES, rel_err  # noqa: E402
from benchmarks.gemv_explore import graph_us, log  # noqa: E402
from benchmarks.gemv_tiled_explore import BW, dense64, hbm_copies, read_floor  # noqa: E402
from fitllm.kernels._pdl import let_next_launch, wait_for_previous  # noqa: E402
from fitllm.kernels._utils import interpreting, num_sms, packed_math_ok, pdl_args, split_k_for, splitk_buffers  # noqa: E402
from fitllm.kernels.w4a16 import _one_row_dot, _rows_out, _store_tile  # noqa: E402
from fitllm.kernels.w4a16_tiled import (_from_blocks, _gemv, _group_raw, _pair16,  # noqa: E402
                                        _word_offsets, _x_pairs, w4a16_tiled_triton)


@triton.jit(do_not_specialize=["M"])
def _tma_gemv_kernel(x_ptr, q_desc, q_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, NUM_GROUPS, K_TILES, stride_ym,
                     K_ITERS, SPLIT, GROUP_SIZE: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr,
                     FETCH: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
                     USE_WS: tl.constexpr, M=1, M_RT: tl.constexpr = False, MASK_N: tl.constexpr = False,
                     PDL: tl.constexpr = False):
    """FETCH: "row" = descriptor [N, Kp/8] over row-major words, box [BN, 16] (the tenth session's
    probe); "tile16" = descriptor [N/128, KT*128, 16] over the product's tile-major storage, box
    [BN/128 | 1, <=128, 16] (64-byte box lines, contiguous); "tile256" = the same bytes as
    [N/128, KT*8, 256], box [BN/128 | 1, BN/16 | 8, 256] (1 KB lines); "ptr" = pointer loads of
    the tile-major storage under the same pipelined loop (cp.async stages). MASK_N, PDL and a
    runtime M (x rows masked) add what the product's GEMV has, one at a time."""
    MAGICF: tl.constexpr = 1024.0 if F16 else 128.0
    DT: tl.constexpr = tl.float16 if F16 else tl.bfloat16
    BB: tl.constexpr = BN // 128 if BN >= 128 else 1  # stored 128-row blocks per program
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    p_ar = tl.arange(0, 16)[None, :]
    xoff = (p_ar % 4) * 4 + p_ar // 4
    acc = tl.zeros((BN, 16), dtype=tl.float32)
    kt_end = tl.minimum((pid_k + 1) * K_ITERS, K_TILES)
    blk = (pid_n * BN) // 128
    sub = (pid_n * BN) % 128  # BN < 128: row offset inside the block
    wait_for_previous(PDL)
    for kt in tl.range(pid_k * K_ITERS, kt_end, num_stages=STAGES):
        if FETCH == "row":
            qw = q_desc.load([pid_n * BN, kt * 16])
        elif FETCH == "tile16":
            qw = tl.reshape(q_desc.load([blk, kt * 128 + sub, 0]), (BN, 16))
        elif FETCH == "tile256":
            qw = tl.reshape(q_desc.load([blk, kt * 8 + sub // 16, 0]), (BN, 16))
        elif MASK_N:
            qw = tl.load(q_ptr + _word_offsets(offs_n, kt, N, K_TILES * 16)[:, None] + p_ar, mask=n_mask[:, None],
                         other=0)
        else:
            qw = tl.load(q_ptr + _word_offsets(offs_n, kt, N, K_TILES * 16)[:, None] + p_ar)
        s, z = _group_raw(s_ptr, z_ptr, kt * 128, N, NUM_GROUPS, offs_n, n_mask, GROUP_SIZE, True)
        nz = tl.broadcast_to(_pair16(-(z + MAGICF), DT), qw.shape)
        x0, x1, x2, x3 = _x_pairs(x_ptr, 0, M if M_RT else 1, 0, kt, xoff, K // 2, EVEN_K)
        acc += _one_row_dot(qw, nz, x0, x1, x2, x3, F16, ASM) * s[:, None]
    let_next_launch(PDL)
    out, offs_m, m_mask = _rows_out(tl.trans(acc), acc, acc, acc, 0, 1, 1)
    _store_tile(out, y_ptr, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym, pid_n, SPLIT,
                False, USE_WS)


def row_major_words(qtile):
    """The tiled words of each row in row order, [N, Kp/8] (the layout the first probe was written for)."""
    return _from_blocks(qtile).reshape(qtile.shape[0], -1).contiguous()


def descriptor(qtile, fetch, bn):
    """The TMA descriptor each fetch mode reads through (N a multiple of 128 for the tile modes);
    "ptr" reads no descriptor but the kernel takes one: the row-major one."""
    N, kw = qtile.shape
    if fetch in ("row", "ptr"):
        return TensorDescriptor(qtile, [N, kw], [kw, 1], [bn, 16])
    bb, kt = max(1, bn // 128), kw // 16
    if fetch == "tile16":
        return TensorDescriptor(qtile, [N // 128, kt * 128, 16], [128 * kw, 16, 1], [bb, min(bn, 128), 16])
    return TensorDescriptor(qtile, [N // 128, kt * 8, 256], [128 * kw, 256, 1], [bb, min(bn, 128) // 16, 256])


def tma_gemv(x, qtile, scales, zeros, group_size, K, bn, warps, stages, waves, out, fetch="tile256", desc=None,
             extras=()):
    """y [1, N] = x [1, K] W^T. qtile: the product's tile-major storage, or for fetch "row" each
    row's words in row order (row_major_words). extras: "mask", "pdl", "m" (the product's features)."""
    N = qtile.shape[0]
    assert fetch == "row" or N % 128 == 0
    desc = desc if desc is not None else descriptor(qtile, fetch, bn)
    n_blocks = triton.cdiv(N, bn)
    split, k_iters = split_k_for(n_blocks, qtile.shape[1] // 16, num_sms(x.device.index or 0), waves)
    use_ws = split > 1
    ws, cnt, _ = splitk_buffers(x.device, N, n_blocks, split) if use_ws else (out, out, {})
    _tma_gemv_kernel[(n_blocks, split)](
        x.view(torch.int32), desc, qtile, scales, zeros, out, ws, cnt, N, K, scales.shape[0], qtile.shape[1] // 16,
        out.stride(0), k_iters, split, GROUP_SIZE=min(group_size, K), BN=bn, STAGES=stages, FETCH=fetch,
        F16=x.dtype == torch.float16, ASM=packed_math_ok(x.device.index or 0, x.dtype), EVEN_K=K % 128 == 0,
        USE_WS=use_ws, num_warps=warps, M=x.shape[0], M_RT="m" in extras,
        MASK_N="mask" in extras, **(pdl_args(x) if "pdl" in extras else {}))
    return out


CONFIGS = ([("tile256", 128, w, st, 4) for w in (4, 8) for st in (2, 3, 4)]
           + [("tile256", 64, 4, 3, 4), ("tile16", 128, 8, 3, 4), ("row", 128, 8, 3, 4)]
           + [("ptr", 128, 8, st, wv) for st in (1, 2) for wv in (4, 6)]
           + [("ptr+" + e, 128, 8, 1, 4) for e in ("mask", "pdl", "m", "mask+pdl+m")]
           + [("ptr", 64, 4, 1, 4), ("ptr", 256, 8, 1, 4)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=200)
    a = ap.parse_args()
    deadline = time.time() + a.budget_s
    dev = "cuda"
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "linears": {}}
    for lin, (K, N) in SHAPES.items():  # descriptors are built on the host: no device allocator needed
        nbytes, ws = hbm_copies(K, N, dev)
        row_ws = [dict(w, qtile=row_major_words(w["qtile"])) for w in ws]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        ref = x.double() @ dense64(ws[0])
        y = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
        sink = torch.empty(4 * 132, device=dev, dtype=torch.int32)
        row = {"roofline_us": nbytes / BW * 1e6}
        row["read_floor"] = graph_us([lambda w=w: read_floor(w, sink) for w in ws])
        row["table"] = graph_us([lambda w=w: w4a16_tiled_triton(x, **w, out=y) for w in ws])
        os.environ["FITLLM_PDL"] = "0"
        row["table_no_pdl"] = graph_us([lambda w=w: w4a16_tiled_triton(x, **w, out=y) for w in ws])
        del os.environ["FITLLM_PDL"]
        u4 = _gemv(128, 4, 8, 4)
        row["table_u4"] = graph_us([lambda w=w: w4a16_tiled_triton(x, **w, out=y, config=u4) for w in ws])
        sweep = {}
        for fetch, bn, warps, st, wv in CONFIGS:
            if time.time() > deadline:
                log("budget reached")
                break
            name = f"{fetch} BN{bn} w{warps} stages{st} waves{wv}"
            cws = row_ws if fetch == "row" else ws
            fetch, *extras = fetch.split("+")
            try:
                kw = dict(bn=bn, warps=warps, stages=st, waves=wv, fetch=fetch, extras=tuple(extras))
                descs = [descriptor(w["qtile"], fetch, bn) for w in cws]
                o = torch.full((1, N), float("nan"), device=dev, dtype=torch.bfloat16)
                tma_gemv(x, **cws[0], **kw, out=o, desc=descs[0])
                err = rel_err(o, ref)
                if not err < 1e-2:
                    log(f"  {lin} {name}: rel err {err:.2e}, skipped")
                    continue
                sweep[name] = graph_us([lambda w=w, d=d: tma_gemv(x, **w, **kw, out=y, desc=d)
                                        for w, d in zip(cws, descs)])
            except Exception as e:  # noqa: BLE001  (report, go on)
                log(f"  {lin} {name} failed: {repr(e)[:300]}")
        row["sweep"] = sweep
        row["best"] = min(sweep.items(), key=lambda kv: kv[1]) if sweep else ("-", float("nan"))
        log(f"{lin}: roofline {row['roofline_us']:.1f} read floor {row['read_floor']:.1f} table {row['table']:.1f} "
            f"(no PDL {row['table_no_pdl']:.1f}, 4 tiles a step {row['table_u4']:.1f}) "
            f"best {row['best'][1]:.1f} {row['best'][0]}")
        log("   " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(sweep.items(), key=lambda kv: kv[1])[:8]))
        res["linears"][lin] = row
        json.dump(res, open(os.path.join(a.out, "gemv_tma_probe.json"), "w"), indent=1)
        del ws, row_ws
        torch.cuda.empty_cache()
    keys = ("roofline_us", "read_floor", "table", "table_no_pdl", "table_u4")
    tot = {k: sum(r[k] for r in res["linears"].values()) for k in keys}
    names = next(iter(res["linears"].values()))["sweep"].keys()
    for n in names:  # each config's layer total (the configs that ran on every linear)
        if all(n in r["sweep"] for r in res["linears"].values()):
            log(f"  layer {n}: {sum(r['sweep'][n] for r in res['linears'].values()):.1f}")
    log(f"layer: roofline {tot['roofline_us']:.1f} read floor {tot['read_floor']:.1f} table {tot['table']:.1f} "
        f"(no PDL {tot['table_no_pdl']:.1f}, 4 tiles a step {tot['table_u4']:.1f}) "
        f"per-linear best {sum(r['best'][1] for r in res['linears'].values()):.1f}")


if __name__ == "__main__":
    assert not interpreting(), "a GPU benchmark"
    main()
