"""Paged decode attention on the GPU: correctness, then speed against torch SDPA (same run).

Llama-3-8B heads (32 query / 8 KV heads, head_dim 128), pages of the product's default size per KV
dtype (16 tokens; 64 for fp8 and int8; --block-size overrides) scattered at random over the pool, batch x
context grid, KV in bf16 / fp8 / int8 / int4. Times are CUDA-graph replays of back-to-back calls
(launch overhead excluded, as a served decode step sees it); bandwidth counts the K/V bytes each
call must read (codes + scales), against the measured copy bandwidth.

    python benchmarks/bench_attention.py --out DIR
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fitllm.budget import default_block_size  # noqa: E402
from fitllm.kernels import paged_attention as pa  # noqa: E402
from fitllm.kernels._utils import num_sms  # noqa: E402

HQ, HKV, D = 32, 8, 128
PAGE = None  # tokens per block; None: the product's default per KV dtype (budget.default_block_size)
KINDS = {"bf16": pa.KIND_FLOAT, "fp8": pa.KIND_FP8, "int8": pa.KIND_INT8, "int4": pa.KIND_INT4}
INT4_GROUPS = (16, 32)  # (key, value) values per scale/zero: the cache's defaults


def graph_time_us(fn, inner: int = 10, outer: int = 0) -> float:
    """Mean µs per call: `inner` calls captured in one CUDA graph, replayed `outer` times
    (outer=0: as many as fill ~40 ms)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    torch.cuda.synchronize()
    if outer == 0:
        t = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        outer = max(3, min(50, int(0.04 / max(time.perf_counter() - t, 1e-6))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(outer):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (inner * outer)


def copy_bandwidth() -> float:
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = graph_time_us(lambda: y.copy_(x), inner=2, outer=10)
    return 2 * x.numel() / us / 1e3  # GB/s (read + write)


class Pool:
    """A paged cache of one kind for B sequences of `ctx` tokens, pages in random order."""

    def __init__(self, kind: str, batch: int, ctx: int, seed: int = 0, max_len: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.kind, self.k_id = kind, KINDS[kind]
        self.group = INT4_GROUPS if kind == "int4" else D
        self.k_group, self.v_group = pa.split_group(self.group)
        self.page = page = PAGE or default_block_size(kind)
        pages = math.ceil(ctx / page)
        nb = batch * pages
        dc = D // 2 if kind == "int4" else D
        if kind == "bf16":
            mk = lambda shape: torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        elif kind == "fp8":
            mk = lambda shape: (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) * 8).to(torch.float8_e4m3fn)  # noqa: E731
        elif kind == "int8":
            mk = lambda shape: torch.randint(-127, 128, shape, device="cuda", dtype=torch.int8, generator=g)  # noqa: E731
        else:
            mk = lambda shape: torch.randint(0, 256, shape, device="cuda", dtype=torch.uint8, generator=g)  # noqa: E731
        self.k = mk(pa.cache_shape(nb, page, HKV, D, self.k_id))
        self.v = mk(pa.cache_shape(nb, page, HKV, D, self.k_id, values=True))
        kms, vms = (pa.scales_shape(nb, page, HKV, D, g) for g in (self.k_group, self.v_group))
        self.ks = self.vs = self.kz = self.vz = None
        if kind in ("int8", "int4"):
            self.ks = (torch.rand(kms, device="cuda", generator=g) * 0.02 + 0.01).half()
            self.vs = (torch.rand(vms, device="cuda", generator=g) * 0.02 + 0.01).half()
        if kind == "int4":
            self.kz = (torch.randn(kms, device="cuda", generator=g) * 0.1).half()
            self.vz = (torch.randn(vms, device="cuda", generator=g) * 0.1).half()
        perm = torch.randperm(nb, device="cuda", generator=g).int()
        self.tables = perm.view(batch, pages)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.query_start = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        # max_len: the max_seq_len the kernel is told (its splits are sized for it), as in the engine's
        # CUDA graphs, which are captured for max_model_len whatever the sequences' lengths
        self.batch, self.ctx, self.max_len = batch, ctx, max(max_len, ctx)
        qdt = torch.bfloat16 if kind == "bf16" else torch.float16
        self.q = torch.randn(batch, HQ, D, device="cuda", generator=g).to(qdt)
        def row_bytes(scales, zeros):  # one head of one token: codes + its scales/zeros
            return dc * self.k.element_size() + sum(t.shape[-1] * 2 for t in (scales, zeros) if t is not None)

        self.bytes = batch * ctx * HKV * (row_bytes(self.ks, self.kz) + row_bytes(self.vs, self.vz))

    def run(self, mod=pa, v=None, q=None, query_start=None, max_query_len=1, **cfg):
        """`mod.paged_attention` over the pool: decode by default, or the queries q at query_start
        (extend); v replaces the value codes (an earlier kernel file wants its own layout: values_for())."""
        out_dtype = torch.float32 if self.kind in ("int8", "int4") else None
        return mod.paged_attention(self.q if q is None else q, self.k, self.v if v is None else v, self.ks, self.vs,
                                   self.kz, self.vz, self.tables,
                                   self.query_start if query_start is None else query_start, self.seq_lens,
                                   D ** -0.5, self.k_id, self.group, None, out_dtype, max_query_len=max_query_len,
                                   max_seq_len=self.max_len, **cfg)

    def values_for(self, mod) -> torch.Tensor:
        """The value codes in the layout kernel module `mod` reads (files before the transposed fp8
        values have no `values_transposed`: rows for every kind)."""
        same = getattr(mod, "values_transposed", lambda kind: False)(self.k_id) == pa.values_transposed(self.k_id)
        return self.v if same else self.v_rows()

    def v_rows(self) -> torch.Tensor:
        """The value codes as [blocks, page, HKV, dc] whatever the cache's layout."""
        return self.v.permute(0, 3, 1, 2).contiguous() if pa.values_transposed(self.k_id) else self.v

    def dense(self):
        """Contiguous dequantized K/V [B, HKV, ctx, D] bf16 (for SDPA and for checking)."""
        def one(codes, s, z, group):
            rows = codes[self.tables.long()].flatten(1, 2)[:, : self.ctx]  # [B, ctx, HKV, dc]
            if self.kind == "bf16":
                return rows.transpose(1, 2).contiguous()
            sr = None if s is None else s[self.tables.long()].flatten(1, 2)[:, : self.ctx]
            zr = None if z is None else z[self.tables.long()].flatten(1, 2)[:, : self.ctx]
            return pa.dequantize_ref(rows, sr, zr, self.k_id, group).to(torch.bfloat16).transpose(1, 2).contiguous()
        return one(self.k, self.ks, self.kz, self.k_group), one(self.v_rows(), self.vs, self.vz, self.v_group)


def sdpa_gqa_folded(q, k, v):
    """Decode as SDPA over contiguous K/V: the 4 query heads of a KV head ride the query axis."""
    b = q.shape[0]
    return F.scaled_dot_product_attention(q.view(b, HKV, HQ // HKV, D), k, v, scale=D ** -0.5).view(b, HQ, D)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_correctness(log) -> bool:
    ok = True
    torch.manual_seed(0)
    # 1) decode and mixed prefill/extend batches against the torch reference, every kind, windows.
    for kind in KINDS:
        pool = Pool(kind, 6, 300, seed=1)
        lens = [300, 1, 17, 129, 64, 250]
        pool.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        for qlens in ([1] * 6, [5, 1, 17, 40, 1, 64]):
            qs = [0]
            for n in qlens:
                qs.append(qs[-1] + n)
            q = torch.randn(qs[-1], HQ, D, device="cuda").to(pool.q.dtype)
            for window in (None, 100):
                args = (q, pool.k, pool.v, pool.ks, pool.vs, pool.kz, pool.vz, pool.tables)
                ref = pa.paged_attention_ref(*args, qs, lens, D ** -0.5, pool.k_id, pool.group, window, torch.float32)
                narrow = pa.narrow_program(pool.k_id)
                variants = [(None, {}), (3, {}), (3, dict(fused_reduce=False)), (40, {}), (3, narrow), (40, narrow)]
                variants += [(3, pa.NARROW)] if narrow is not pa.NARROW else []
                variants = variants if max(qlens) == 1 else [(None, {})]
                for splits, knobs in variants:
                    out = pa.paged_attention(*args, torch.tensor(qs, dtype=torch.int32, device="cuda"), pool.seq_lens,
                                             D ** -0.5, pool.k_id, pool.group, window, torch.float32,
                                             max_query_len=max(qlens), max_seq_len=max(lens), num_splits=splits,
                                             **knobs)
                    e = rel(out, ref)
                    tol = 1e-2
                    good = e < tol and torch.isfinite(out).all().item()
                    ok &= good
                    log(f"check {kind:5s} q_lens={'decode' if max(qlens) == 1 else 'mixed '} window={window} "
                        f"splits={splits} {knobs or ''} rel_err={e:.2e} {'ok' if good else 'FAIL'}")
    # 1b) the fused split combine under CUDA-graph replays (forced on: by default it serves only few
    # splits): many splits of a long sequence, every replay must give the reference (arrival
    # counters reset by each launch's last split)
    for kind in ("bf16", "fp8"):
        pool = Pool(kind, 2, 8192, seed=4)
        args = (pool.q, pool.k, pool.v, pool.ks, pool.vs, pool.kz, pool.vz, pool.tables)
        ref = pa.paged_attention_ref(*args, list(range(3)), [8192] * 2, D ** -0.5, pool.k_id, pool.group, None,
                                     torch.float32)
        for _ in range(2):
            pool.run(num_splits=64, fused_reduce=True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = [pool.run(num_splits=64, fused_reduce=True) for _ in range(4)]
        errs = []
        for _ in range(3):  # poisoned before each replay: a combine that did not run would show
            for o in outs:
                o.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            errs += [rel(o, ref) if torch.isfinite(o).all() else float("inf") for o in outs]
        good = max(errs) < 1e-2
        ok &= good
        log(f"check {kind:5s} fused combine, 64 splits, graph replays: worst rel_err={max(errs):.2e} "
            f"{'ok' if good else 'FAIL'}")
    # 1c) out_cols (an act-order o_proj's input order): the output written in that column order, bit for
    # bit the plain output scattered so, on every store path (one split, fused combine, reduce, extend)
    cols = torch.randperm(HQ * D, device="cuda").to(torch.int32)
    for kind in ("bf16", "fp8"):
        pool = Pool(kind, 2, 8192, seed=5)
        q = torch.randn(40, HQ, D, device="cuda").to(pool.q.dtype)
        extend = dict(q=q, query_start=torch.tensor([0, 24, 40], dtype=torch.int32, device="cuda"), max_query_len=24)
        for name, cfg in (("direct", dict(num_splits=1)), ("fused 64", dict(num_splits=64, fused_reduce=True)),
                          ("reduce 40", dict(num_splits=40, fused_reduce=False)), ("default", {}), ("extend", extend)):
            plain = pool.run(**cfg)
            got = pool.run(out_cols=cols, **cfg)
            good = torch.equal(got, pa.scatter_columns(plain, cols))
            ok &= good
            log(f"check {kind:5s} out_cols {name}: {'bit-equal ok' if good else 'FAIL'}")
    # 2) cache write kernel == reference quantizer (dequantized values)
    for kind in KINDS:
        pool = Pool(kind, 2, 64, seed=2)
        k = torch.randn(40, HKV, D, device="cuda") * 3
        v = torch.randn(40, HKV, D, device="cuda")
        slots = torch.randperm(pool.k.shape[0] * pool.page, device="cuda")[:40]
        slots[3] = -1  # padding token: must not be written
        outs = []
        for fn in (pa.cache_write, pa.cache_write_ref):
            c = [None if t is None else t.clone() for t in (pool.k, pool.v, pool.ks, pool.vs, pool.kz, pool.vz)]
            fn(k, v, c[0], c[1], c[2], c[3], c[4], c[5], slots, pool.k_id, pool.group)
            rows = lambda t: None if t is None else t.flatten(0, 1)  # noqa: E731
            v_codes = c[1].permute(0, 3, 1, 2) if pa.values_transposed(pool.k_id) else c[1]  # as rows
            outs.append(torch.cat([
                pa.dequantize_ref(rows(c[0]), rows(c[2]), rows(c[4]), pool.k_id, pool.k_group).flatten(),
                pa.dequantize_ref(rows(v_codes), rows(c[3]), rows(c[5]), pool.k_id, pool.v_group).flatten()]))
        e = rel(outs[0], outs[1])
        good = e < 1e-3 and (kind != "fp8" or torch.equal(*outs))  # fp8: bit for bit
        ok &= good
        log(f"check write {kind:5s} rel_err={e:.2e} {'ok' if good else 'FAIL'}")
    # 2b) RoPE fused into the float cache's write == RoPE, then the reference write (to 1e-5: the GPU
    # contracts x1 * c - x2 * s into an FMA, torch does not)
    for dt in (torch.bfloat16, torch.float32):
        t, hq = 40, HKV * 4
        qkv = torch.randn(t, (hq + 2 * HKV) * D, device="cuda").to(dt)
        q, k, v = qkv[:, :hq * D].view(t, hq, D), qkv[:, hq * D:(hq + HKV) * D].view(t, HKV, D), \
            qkv[:, (hq + HKV) * D:].view(t, HKV, D)
        angle = torch.randint(0, 8000, (t, 1), device="cuda").float() * 5e5 ** -(torch.arange(D // 2, device="cuda")
                                                                              / (D // 2))
        cos, sin = angle.cos(), angle.sin()
        slots = torch.randperm(64 * 16, device="cuda")[:t]
        slots[3] = -1
        res = []
        for fn in (pa.rope_cache_write, pa.rope_cache_write_ref):
            qc = q.clone()
            kc, vc = (torch.zeros(64, 16, HKV, D, device="cuda", dtype=dt) for _ in range(2))
            fn(qc, k, v, cos, sin, kc, vc, slots)
            res.append((qc, kc, vc))
        same = all(a.equal(b) for a, b in zip(*res))
        near = max(rel(a.float(), b.float()) for a, b in zip(*res))
        ok &= near < 1e-5
        log(f"check rope+write {str(dt)[6:]:8s} bit-equal={same} rel_err={near:.2e} {'ok' if near < 1e-5 else 'FAIL'}")
    # 3) real shapes: paged bf16 decode == SDPA over contiguous K/V
    pool = Pool("bf16", 16, 4096, seed=3)
    k, v = pool.dense()
    e = rel(pool.run(), sdpa_gqa_folded(pool.q, k, v))
    ok &= e < 1e-2
    log(f"check bf16 B=16 ctx=4096 vs SDPA rel_err={e:.2e} {'ok' if e < 1e-2 else 'FAIL'}")
    return ok


def measure(row, b, ctx, kinds, sweep, baseline=None, max_len=0):
    for kind in kinds:
        pool = Pool(kind, b, ctx, max_len=max_len)
        base_splits = pa.decode_config(pool.k_id, pool.k.element_size(), b, HKV, pool.max_len,
                                       num_sms(0))["num_splits"]
        if baseline is not None:  # an earlier kernel file, default config, cache rows as it expects them
            v_base = pool.values_for(baseline)
            row[f"{kind}_baseline_us"] = graph_time_us(lambda: pool.run(baseline, v_base))
            del v_base
        best = None
        for i, cfg in enumerate(sweep):
            cfg = dict(cfg)
            mul = cfg.pop("split_mul", 1)
            splits = max(1, int(base_splits * mul))
            try:
                us = graph_time_us(lambda: pool.run(num_splits=splits, **cfg))
            except Exception as exc:  # noqa: BLE001  (a config that does not compile or fit loses, the rest go on)
                print(f"B={b} ctx={ctx} {kind} {cfg} splits={splits} FAILED: {exc!r}"[:300], flush=True)
                us = math.inf
            if i == 0:
                row[f"{kind}_us"] = us
                row[f"{kind}_GBs"] = pool.bytes / us / 1e3
            row.setdefault(f"{kind}_sweep", []).append(({**cfg, "num_splits": splits}, us))
            if best is None or us < best[0]:
                best = (us, {**cfg, "num_splits": splits})
        row[f"{kind}_best_us"], row[f"{kind}_best_cfg"] = best
        if kind == "bf16":
            k, v = pool.dense()
            del pool
            q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
            row["sdpa_us"] = graph_time_us(lambda: sdpa_gqa_folded(q, k, v))
            del k, v
        else:
            del pool
        torch.cuda.empty_cache()


def measure_prefill(kinds, contexts, chunk: int, baseline, log, batch: int = 4) -> None:
    """Extend attention: `batch` sequences at full context, each with its last `chunk` tokens as new
    queries (a chunked prefill's step), through the prefill/extend kernel."""
    for ctx in contexts:
        for kind in kinds:
            pool = Pool(kind, batch, ctx)
            extend = dict(q=torch.randn(batch * chunk, HQ, D, device="cuda").to(pool.q.dtype),
                          query_start=torch.arange(batch + 1, dtype=torch.int32, device="cuda") * chunk,
                          max_query_len=chunk)
            us = graph_time_us(lambda: pool.run(**extend))
            msg = f"prefill B={batch} ctx={ctx} chunk={chunk} {kind}: {us:.1f}us"
            if baseline is not None:
                v_base = pool.values_for(baseline)
                msg += f" (baseline {graph_time_us(lambda: pool.run(baseline, v_base, **extend)):.1f}us)"
                del v_base
            log(msg)
            del pool
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--kinds", default="bf16,fp8,int8,int4")
    ap.add_argument("--no-sweep", action="store_true", help="default kernel config only")
    ap.add_argument("--skip-check", action="store_true", help="timings only (no correctness checks first)")
    ap.add_argument("--wide", action="store_true", help="add a split x tile x stages grid to the sweep")
    ap.add_argument("--narrow", action="store_true", help="add programs of 1-2 warps x split counts to the sweep")
    ap.add_argument("--fused-ab", action="store_true", help="time every config also with the separate "
                    "reduce kernel forced (fused_reduce=False) and with the kernel's own combine forced (True)")
    ap.add_argument("--engine-max-len", type=int, default=0, help="tell the kernel this max_seq_len (>= each "
                    "context), as the engine's CUDA graphs do with max_model_len; adds the fused combine forced on")
    ap.add_argument("--max-gib", type=float, default=40.0, help="skip combos whose bf16 K/V exceed this")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="also time the extend kernel: 4 sequences at "
                    "each context, their last N tokens as new queries")
    ap.add_argument("--block-size", type=int, default=None, help="tokens per block for every kind "
                    "[default: the product's per KV dtype: 64 for fp8 and int8, else 16]")
    ap.add_argument("--baseline", default=None, help="module name of an earlier paged_attention.py timed in the "
                    "same run with its default config, on the value layout it reads: column 'baseline'")
    args = ap.parse_args()
    baseline = importlib.import_module(args.baseline) if args.baseline else None
    global PAGE
    PAGE = args.block_size
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    t0 = time.time()
    log(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {__import__('triton').__version__}  "
        f"block size {PAGE or 'default per kind'}")
    ok = True if args.skip_check else check_correctness(log)
    log(f"correctness: {'skipped' if args.skip_check else 'all ok' if ok else 'FAILURES'} ({time.time() - t0:.0f}s)")
    if args.prefill_chunk:
        measure_prefill(args.kinds.split(","), list(map(int, args.contexts.split(","))), args.prefill_chunk,
                        baseline, log)
    bw = copy_bandwidth()  # a device-to-device copy, read + write counted
    log(f"copy bandwidth: {bw:.0f} GB/s")

    # Configs tried per shape (the default first): BLOCK_N, warps, stages, split multiplier.
    # Triton double-buffers these loops' K/V tiles only from num_stages=5 (the page-table load comes
    # first in the chain): below that, one buffer.
    sweep = [dict(), dict(block_n=64, num_warps=4, num_stages=2), dict(block_n=128, num_warps=4, num_stages=3),
             dict(block_n=64, num_warps=4, num_stages=5), dict(block_n=128, num_warps=4, num_stages=5),
             dict(block_n=128, num_warps=8, num_stages=5), dict(block_n=256, num_warps=8, num_stages=3),
             dict(split_mul=2), dict(split_mul=2, block_n=128, num_warps=4, num_stages=5),
             dict(block_n=128, num_warps=4, num_stages=6)][: 1 if args.no_sweep else None]
    if args.engine_max_len:  # the default, and the split combine forced into the decode kernel
        sweep += [dict(fused_reduce=True), dict(split_mul=0.5), dict(split_mul=0.5, fused_reduce=True)]
    if args.fused_ab:  # each config also with the separate reduce kernel, and with the fused combine
        sweep += [dict(cfg, fused_reduce=f) for f in (False, True) for cfg in sweep]
    if args.wide:  # split count x tile shape x pipeline depth, for the small-batch regime (fused only)
        sweep += [dict(split_mul=mul, block_n=bn, num_warps=w, num_stages=st)
                  for mul in (0.5, 1, 2, 4)
                  for bn, w, st in ((64, 4, 3), (64, 4, 5), (128, 4, 4), (128, 4, 5), (128, 8, 5), (256, 8, 3))]
    if args.narrow:  # programs of one or two warps: no cross-warp softmax reductions, more programs an SM
        sweep += [dict(split_mul=mul, block_n=bn, num_warps=w, num_stages=st)
                  for mul in (1, 2)
                  for bn, w, st in ((64, 2, 5), (128, 2, 3), (128, 2, 5))]
    log(f"sweep configs, in the order of each 'sweep' line: {sweep}")
    results = []
    for b in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            if b * ctx * HKV * D * 2 * 2 / 2**30 > args.max_gib:
                log(f"skip B={b} ctx={ctx}")
                continue
            row = {"batch": b, "ctx": ctx}
            try:
                measure(row, b, ctx, args.kinds.split(","), sweep, baseline, args.engine_max_len)
            except Exception as exc:  # noqa: BLE001  (report and go on: one bad shape must not lose the rest)
                log(f"B={b} ctx={ctx} FAILED: {exc!r}")
                torch.cuda.empty_cache()
                continue
            sd = row.get("sdpa_us", math.nan)  # measured with the bf16 kind
            msg = f"B={b:4d} ctx={ctx:6d} sdpa {sd:8.1f}us"
            for kind in args.kinds.split(","):
                msg += (f" | {kind} {row[f'{kind}_us']:8.1f}us {row[f'{kind}_GBs']:6.0f}GB/s "
                        f"(best {row[f'{kind}_best_us']:.1f} {row[f'{kind}_best_cfg']})")
                if baseline is not None:
                    msg += f" baseline {row[f'{kind}_baseline_us']:.1f}us"
                by_reduce = {}
                for cfg, us in row.get(f"{kind}_sweep", []):
                    key = "reduce kernel" if cfg.get("fused_reduce") is False else "default combine"
                    by_reduce[key] = min(us, by_reduce.get(key, us))
                if len(by_reduce) == 2:
                    msg += (f" best with the default combine {by_reduce['default combine']:.1f} vs the reduce kernel "
                            f"{by_reduce['reduce kernel']:.1f}")
                msg += "\n    sweep " + ", ".join(f"{us:.1f}" for _, us in row.get(f"{kind}_sweep", []))
            log(msg)
            results.append(row)

    log("\n| B | ctx | SDPA µs | bf16 µs | bf16 GB/s (% of 4.3 TB/s) | fp8 µs | fp8 speedup vs bf16 | int8 µs | int4 µs | bf16 vs SDPA |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in results if "bf16" in args.kinds.split(",") else ():
        sd = r["sdpa_us"]
        bf = r["bf16_best_us"]
        gbs = r["bf16_GBs"] * r["bf16_us"] / bf
        log(f"| {r['batch']} | {r['ctx']} | {sd:.1f} | {bf:.1f} | {gbs:.0f} ({100 * gbs / 4300:.0f}%) | "
            f"{r.get('fp8_best_us', float('nan')):.1f} | {bf / r.get('fp8_best_us', float('nan')):.2f}x | "
            f"{r.get('int8_best_us', float('nan')):.1f} | {r.get('int4_best_us', float('nan')):.1f} | {sd / bf:.2f}x |")
    (out_dir / "bench_attention.json").write_text(json.dumps({"copy_GBs": bw, "ok": ok, "rows": results}, indent=1))
    (out_dir / "bench_attention.log").write_text("\n".join(lines))
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
