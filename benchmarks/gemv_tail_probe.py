"""What the end of a split-K batch-1 GEMV costs: the table's W4A16 GEMV (fitllm/kernels/w4a16_tiled.py)
against twins of its kernel that differ only after the main loop. Timing only: the twins' outputs
are not the product (they do not reduce the splits); the table is checked against float64 first.

Tails, per program, after the same loop:
  * table:   fp32 atomic adds into the workspace, then a per-tile counter (an atomic that returns,
             so a round trip to L2), and the last program of a tile reads the sum back, zeroes it
             and writes y (a second round trip);
  * red:     the atomic adds alone (fire-and-forget): what a GEMV would cost if its consumer read
             the fp32 sum (and zeroed it) instead;
  * slots:   a plain store of the partial into the split's own slice (the consumer would sum them);
  * none:    no store at all (the loop alone; a never-true branch keeps it alive).
Each linear is timed alone over enough weight copies that every read comes from HBM, PDL on as in
the engine, beside the streaming-read floor of gemv_tiled_explore. Writes $OUT/gemv_tail_probe.json.

  python3 benchmarks/gemv_tail_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import SHAPES, rel_err  # noqa: E402
from benchmarks.gemv_explore import graph_us, log  # noqa: E402
from benchmarks.gemv_tiled_explore import dense64, hbm_copies, read_floor  # noqa: E402
from fitllm.kernels._pdl import let_next_launch, wait_for_previous  # noqa: E402
from fitllm.kernels._utils import num_sms, pdl_args, pick_config, split_k_for, splitk_buffers  # noqa: E402
from fitllm.kernels.w4a16 import _rows_out, _store_tile  # noqa: E402
from fitllm.kernels.w4a16_tiled import TILED_CONFIGS, _gemv_tile, w4a16_tiled_triton  # noqa: E402

TAILS = {"table": 0, "red": 1, "slots": 2, "none": 3}


@triton.jit
def _tail_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, NUM_GROUPS, stride_q, K_ITERS, SPLIT,
                      TAIL: tl.constexpr, BN: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr = False):
    """The table's M = 1 GEMV (BM 1, 1 tile a step, EVEN_K) with a choice of tail (module docstring)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    w_mask = None if EVEN_N else n_mask
    p_ar = tl.arange(0, 16)[None, :]
    xoff = (p_ar % 4) * 4 + p_ar // 4
    acc0 = tl.zeros((BN, 16), dtype=tl.float32)
    kt_end = tl.minimum((pid_k + 1) * K_ITERS, stride_q // 16)
    wait_for_previous(PDL)
    for kt in range(pid_k * K_ITERS, kt_end):
        acc0, _a1, _a2, _a3 = _gemv_tile(x_ptr, q_ptr, s_ptr, z_ptr, kt, 0, 1, N, K, NUM_GROUPS, stride_q, 0, offs_n,
                                            n_mask, w_mask, p_ar, xoff, acc0, acc0, acc0, acc0, 128, 1, False, True,
                                            True)
    let_next_launch(PDL)
    out = tl.sum(acc0, axis=1)
    if TAIL == 0:
        out2, offs_m, m_mask = _rows_out(tl.trans(acc0), tl.trans(acc0), tl.trans(acc0), tl.trans(acc0), 0, 1, 1)
        _store_tile(out2, y_ptr, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, N, pid_n, SPLIT, False,
                    True, False, pid_k, N)
    elif TAIL == 1:
        tl.atomic_add(ws_ptr + offs_n, out, mask=n_mask, sem="relaxed")
    elif TAIL == 2:
        tl.store(ws_ptr + pid_k * N + offs_n, out, mask=n_mask)
    else:
        if tl.sum(out) == 1234.5:  # never true on these inputs: keeps the loop
            tl.store(ws_ptr + offs_n, out, mask=n_mask)


_SCRATCH = {}


def _scratch(n, device):
    if _SCRATCH.get("t") is None or _SCRATCH["t"].numel() < n:
        _SCRATCH["t"] = torch.zeros(n, dtype=torch.float32, device=device)
    return _SCRATCH["t"]


def tail_gemv(x, qt, tail, y, cfg):
    qtile, K = qt["qtile"], qt["K"]
    N = qtile.shape[0]
    BN = cfg["BN"]
    n_blocks = triton.cdiv(N, BN)
    split, k_iters = split_k_for(n_blocks, qtile.shape[1] // 16, num_sms(x.device.index), cfg["waves"])
    ws, cnt, _ = splitk_buffers(x.device, N, n_blocks, split)
    if tail:  # the twins leave garbage: never in the product's workspace, which must stay zero
        ws = _scratch(split * N, x.device)
    _tail_gemv_kernel[(n_blocks, split)](x.view(torch.int32), qtile, qt["scales"], qt["zeros"], y, ws, cnt, N, K,
                                         qt["scales"].shape[0], qtile.shape[1], k_iters, split, TAIL=tail, BN=BN,
                                         EVEN_N=N % BN == 0, num_warps=cfg["num_warps"], **pdl_args(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    cfg = pick_config(TILED_CONFIGS, "sm90", 1)
    assert cfg["backend"] == "gemv" and cfg["UNROLL"] == 1, cfg  # the twin's loop is the 1-tile-a-step GEMV
    res = {"device": torch.cuda.get_device_name(), "config": cfg, "linears": {}}
    for lin, (K, N) in SHAPES.items():
        nbytes, qts = hbm_copies(K, N, dev)
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        y = torch.full((1, N), float("nan"), device=dev, dtype=torch.bfloat16)
        tail_gemv(x, qts[0], 0, y, cfg)  # the twin with the table's tail is the product: check it
        err = rel_err(y, x.double() @ dense64(qts[0]))
        ok = err < 1e-2 and not torch.isnan(y).any()
        sink = torch.empty(4 * 132, device=dev, dtype=torch.int32)
        row = {"bytes": nbytes, "check": float(err), "ok": bool(ok),
               "read_floor": graph_us([lambda q=q: read_floor(q, sink) for q in qts]),
               "product": graph_us([lambda q=q: w4a16_tiled_triton(x, **q, out=y) for q in qts])}
        for name, t in TAILS.items():
            row[name] = graph_us([lambda q=q, t=t: tail_gemv(x, q, t, y, cfg) for q in qts])
        res["linears"][lin] = row
        log(lin, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()})
        del qts
        torch.cuda.empty_cache()
    json.dump(res, open(os.path.join(a.out, "gemv_tail_probe.json"), "w"), indent=1)
    cols = ["read_floor", "product", *TAILS]
    print("\n| linear | check | " + " | ".join(cols) + " |\n|---|---|" + "---|" * len(cols))
    tot = dict.fromkeys(cols, 0.0)
    for lin, r in res["linears"].items():
        print(f"| {lin} | {r['check']:.1e} {'ok' if r['ok'] else 'FAIL'} | "
              + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
        for c in cols:
            tot[c] += r[c]
    print("| layer | | " + " | ".join(f"{tot[c]:.2f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
