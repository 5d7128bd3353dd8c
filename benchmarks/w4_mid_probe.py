"""W4A16 tensor-core tiles for M = 16..256, per linear: does a wider weight tile (BN) pay?

At M = 64 a BM 64 / BN 64 tile reads a [128 x 64] bf16 x tile (16 KB) from L2 for every 4 KB of
weights it streams from DRAM: over a Llama-3-8B layer ~435 MB of x against ~116 MB of weights. BN 128 /
256 read x half / a quarter as often. This probe checks every config against a float64 reference at
the real shapes (NaN-poisoned outputs), then times each linear alone (CUDA-graph replay of two weight
copies), the layer on the table (per weight width) and the layer with the best config per linear.
(Eighteenth session: the wide gate_up gains 10-20 %, the x bytes do not explain it, the other linears
lose; RESULTS.md.)

  python3 benchmarks/w4_mid_probe.py --out $OUT [--m 16,32,64,128]
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import SHAPES, graph_time, log, rel_err  # noqa: E402
from benchmarks.bench_w4_tiled import probe_start  # noqa: E402
from fitllm.kernels._utils import pick_config  # noqa: E402
from fitllm.kernels.w4a16_tiled import TILED_CONFIGS, _tiled, _ws, w4a16_tiled_triton  # noqa: E402


def candidates(M):
    """Wider weight tiles (the first sweeps also tried register caps, maxnreg: no gain at any M, and a
    capped config that spilled failed with a misaligned address, RESULTS.md eighteenth session)."""
    t = _tiled
    if M <= 32:
        bm = max(16, M)
        return [t(bm, 128, 8, 3, 2), t(bm, 128, 4, 3, 2), t(bm, 64, 4, 3, 2)] + \
            [t(bm, 64, 4, 3, w) for w in (3, 6, 8)]  # split counts, since the cheaper ticket (34th session)
    if M <= 64:
        return [t(64, 128, 4, 3, 2), t(64, 128, 4, 3, 2, True), t(64, 128, 8, 3, 1, True), t(64, 128, 8, 3, 2)] + \
            [t(64, 64, 4, 3, w, siw) for w in (2, 4, 6) for siw in (False, True)] + [_ws(64, 4, t(64, 64, 4, 3, 3))]
    return [t(128, 256, 8, 3, 1, True), t(128, 128, 8, 3, 2), t(128, 256, 8, 3, 2, True), t(128, 128, 8, 3, 1)]


def name(c):
    if c["backend"] == "ws":
        return f"ws BM{c['BM']} s{c['num_stages']}"
    return f"BM{c['BM']} BN{c['BN']} w{c['num_warps']} s{c['num_stages']} wv{c['waves']} siw{int(c.get('SCALE_IN_W', False))}"


def main():
    a, ms, W, ref_w = probe_start("16,32,64,128")
    dev = "cuda"
    res = []
    for M in ms:
        x = {K: torch.randn(M, K, device=dev, dtype=torch.bfloat16) for K in (4096, 14336)}
        outs = {n: torch.empty(M, N, device=dev, dtype=torch.bfloat16) for n, (K, N) in SHAPES.items()}
        table = pick_config(TILED_CONFIGS, "sm90", M)
        per = {}  # config name -> {linear: µs}
        cfgs = {"table (per width)": table, **{name(c): c for c in candidates(M)}}
        for cname, cfg in cfgs.items():
            row = {}
            for n, (K, N) in SHAPES.items():
                try:
                    xc = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                    y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
                    w4a16_tiled_triton(xc, **W.copies[0][n]["qt"], config=cfg, out=y)
                    err = rel_err(y, xc.double() @ ref_w[n])
                    if not err < 1e-2:
                        log(f"M={M} {cname} {n}: FAIL rel err {err:.2e}")
                        continue

                    def fn(n=n, K=K, cfg=cfg):
                        for c in W.copies:
                            w4a16_tiled_triton(x[K], **c[n]["qt"], config=cfg, out=outs[n])
                    row[n] = graph_time(fn, target_ms=20)
                except Exception as e:  # noqa: BLE001
                    log(f"M={M} {cname} {n}: {repr(e)[:200]}")
            per[cname] = row
            log(f"M={M:4d} {cname:42s} " + "  ".join(f"{n} {row.get(n, float('nan')):6.1f}" for n in SHAPES)
                + f"  sum {sum(row.values()):6.1f}")
        best = {n: min((c for c in per if n in per[c]), key=lambda c: per[c][n]) for n in SHAPES}

        def layer(pick):
            def fn():
                for c in W.copies:
                    for n, (K, N) in SHAPES.items():
                        w4a16_tiled_triton(x[K], **c[n]["qt"], config=cfgs[pick[n]], out=outs[n])
            return fn
        bf16 = graph_time(lambda: [torch.mm(x[K], c[n]["w16"].t(), out=outs[n]) for c in W.copies
                                   for n, (K, N) in SHAPES.items()])
        t_table = graph_time(layer({n: next(iter(cfgs)) for n in SHAPES}))
        t_best = graph_time(layer(best))
        log(f"M={M}: layer table {t_table:.1f}  best-per-linear {t_best:.1f}  bf16 cuBLAS {bf16:.1f}  "
            f"({bf16 / t_table:.2f}x -> {bf16 / t_best:.2f}x)  best: {best}")
        res.append(dict(M=M, per=per, best=best, layer_table=t_table, layer_best=t_best, bf16=bf16))
        json.dump(res, open(os.path.join(a.out, "w4_mid_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
