"""W4A16 at large M: hide the dequantization behind the previous linear's cuBLAS GEMM.

Above M = 256 fitllm's W4A16 linears dequantize the whole weight to bf16 (int4 in, bf16 out: ~545 MB
of traffic a Llama-3-8B layer, ~130 µs at 4.2 TB/s) and then call cuBLAS; that dequantization is
the whole gap to bf16 cuBLAS (M = 512 0.78x, 1024 0.87x; RESULTS.md eighteenth session). Weights do
not depend on the activations, so linear i+1's weight can be dequantized on a side stream while
linear i's GEMM runs: at M = 512-1024 those GEMMs are compute-bound (HBM mostly idle) and the small
ones (qkv, o, down) leave SMs idle. This probe times, per Llama-3-8B layer (two weight copies, every
read from HBM):
  cublas     bf16 weights, torch.mm (the peer)
  serial     the table's path: dequantize, then torch.mm, linear after linear
  overlap    dequantize linear i+1 on a side stream into the other of two buffers during GEMM i
  prio       the same with the GEMMs on a high-priority stream (the block scheduler serves it
             first, so the dequantization fills what the GEMM leaves)
each eager (events around 10 layer passes) and as a CUDA graph, after checking that every variant's
output is bit-identical to the serial path and within 1e-2 of float64.

  python3 benchmarks/dequant_overlap_probe.py --out $OUT [--m 512,1024,2048,4096]
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import SHAPES, capture_graph, log, rel_err  # noqa: E402
from benchmarks.bench_w4_tiled import probe_start  # noqa: E402
from fitllm.kernels.w4a16_tiled import dequantize_tiled  # noqa: E402


def dequant_into(buf, qt, dtype):
    """dequantize_tiled into the front of a preallocated flat buffer."""
    N, K = qt["qtile"].shape[0], qt["K"]
    return dequantize_tiled(**qt, dtype=dtype, out=buf[: N * K].view(N, K))


class Runner:
    def __init__(self, W, xs, outs, dev):
        self.order = [(c, n) for c in W.copies for n in SHAPES]  # 8 linears
        self.W, self.xs, self.outs = W, xs, outs
        big = max(SHAPES[n][0] * SHAPES[n][1] for n in SHAPES)
        self.bufs = [torch.empty(big, dtype=torch.bfloat16, device=dev) for _ in range(2)]
        self.side = torch.cuda.Stream(priority=0)
        self.hi = torch.cuda.Stream(priority=-5)
        self.lo = torch.cuda.Stream(priority=0)

    def cublas(self):
        for c, n in self.order:
            K = SHAPES[n][0]
            torch.mm(self.xs[K], c[n]["w16"].t(), out=self.outs[n])

    def serial(self):
        for c, n in self.order:
            K = SHAPES[n][0]
            w = dequant_into(self.bufs[0], c[n]["qt"], torch.bfloat16)
            torch.mm(self.xs[K], w.t(), out=self.outs[n])

    def overlapped(self, main, side):
        """Linear i's GEMM on `main`, linear i+1's dequantization on `side` (buffer i % 2)."""
        cur = torch.cuda.current_stream()
        main.wait_stream(cur)
        side.wait_stream(cur)
        ready, freed = [None] * len(self.order), [None] * len(self.order)

        def issue(i):
            c, n = self.order[i]
            with torch.cuda.stream(side):
                if i >= 2:
                    side.wait_event(freed[i - 2])
                w = dequant_into(self.bufs[i % 2], c[n]["qt"], torch.bfloat16)
                ready[i] = torch.cuda.Event()
                ready[i].record(side)
            return w

        ws = [issue(0)]
        for i, (c, n) in enumerate(self.order):
            if i + 1 < len(self.order):
                ws.append(issue(i + 1))
            with torch.cuda.stream(main):
                main.wait_event(ready[i])
                torch.mm(self.xs[SHAPES[n][0]], ws[i].t(), out=self.outs[n])
                freed[i] = torch.cuda.Event()
                freed[i].record(main)
        cur.wait_stream(main)
        cur.wait_stream(side)

    def overlap(self):
        self.overlapped(torch.cuda.current_stream(), self.side)

    def prio(self):
        self.overlapped(self.hi, self.lo)


def eager_us(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    meds = []
    for _ in range(3):
        ev[0].record()
        for _ in range(reps):
            fn()
        ev[1].record()
        torch.cuda.synchronize()
        meds.append(ev[0].elapsed_time(ev[1]) / reps)
    return sorted(meds)[1] * 1e3 / 2  # two layer copies per call


def graph_us(fn, reps=10):
    g = capture_graph(fn)
    us = eager_us(g.replay, reps)
    del g
    return us


def main():
    a, ms, W, ref_w = probe_start("512,1024,2048,4096", ref_copy=1)  # the serial path's last outputs
    dev = "cuda"
    res = []
    variants = ("cublas", "serial", "overlap", "prio")
    for M in ms:
        xs = {K: torch.randn(M, K, device=dev, dtype=torch.bfloat16) for K in (4096, 14336)}
        outs = {n: torch.empty(M, N, device=dev, dtype=torch.bfloat16) for n, (K, N) in SHAPES.items()}
        r = Runner(W, xs, outs, dev)
        ok = True
        r.serial()
        torch.cuda.synchronize()
        want = {n: outs[n].clone() for n in SHAPES}  # the last copy's outputs
        for n, (K, N) in SHAPES.items():
            err = rel_err(want[n], xs[K].double() @ ref_w[n])
            ok &= err < 1e-2
            log(f"M={M} {n}: serial vs float64 {err:.2e}")
        for v in ("overlap", "prio"):
            for t in outs.values():
                t.fill_(float("nan"))
            getattr(r, v)()
            torch.cuda.synchronize()
            same = all(torch.equal(outs[n], want[n]) for n in SHAPES)
            ok &= same
            log(f"M={M} {v}: bit-identical to serial: {same}")
        row = dict(M=M, check=ok)
        for v in variants:
            fn = getattr(r, v)
            row[v + "_eager"] = eager_us(fn)
            row[v + "_graph"] = graph_us(fn)
        # the graph path once more, in the opposite order (the card's clocks drift between runs)
        for v in reversed(variants):
            row[v + "_graph2"] = graph_us(getattr(r, v))
        res.append(row)
        log(json.dumps(row))
        del r
        torch.cuda.empty_cache()
    print("\n| M | check | cuBLAS bf16 | serial (table) | overlap | prio | best vs cuBLAS |")
    print("|---|---|---|---|---|---|---|")
    for row in res:
        cells = []
        for v in variants:
            e, g = row[v + "_eager"], min(row[v + "_graph"], row[v + "_graph2"])
            cells.append(f"{e:.1f} / {g:.1f}")
        best = min(min(row[v + "_graph"], row[v + "_graph2"], row[v + "_eager"]) for v in ("overlap", "prio"))
        cub = min(row["cublas_graph"], row["cublas_graph2"], row["cublas_eager"])
        print(f"| {row['M']} | {'PASS' if row['check'] else 'FAIL'} | " + " | ".join(cells) + f" | {cub / best:.2f}x |")
    print("(µs per layer, eager / CUDA graph)")
    with open(os.path.join(a.out, "dequant_overlap.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
