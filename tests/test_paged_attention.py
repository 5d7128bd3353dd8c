"""Paged attention kernels: Triton (under TRITON_INTERPRET=1, set by conftest.py) == torch reference
== plain attention."""
import math
import sys

import pytest
import torch
import triton
import triton.language as tl

from fitllm.kernels import paged_attention as pa
from fitllm.kernels.paged_attention import _load_rows
from fitllm.kernels._utils import splitk_workspace
from fitllm.models.kv_cache import causal_attention

H, G, D, PAGE = 2, 2, 32, 4
STORE = {"fp32": (pa.KIND_FLOAT, torch.float32, D), "bf16": (pa.KIND_FLOAT, torch.bfloat16, D),
         "fp8": (pa.KIND_FP8, torch.float8_e4m3fn, D), "int8": (pa.KIND_INT8, torch.int8, D),
         "int8-g": (pa.KIND_INT8, torch.int8, 8),  # scales per group of channels: applied to the rows
         "int4": (pa.KIND_INT4, torch.uint8, 8),
         "int4-kv": (pa.KIND_INT4, torch.uint8, (4, 16))}  # smaller key groups than value groups


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class Pool:
    """Random K/V for a few sequences, pages scattered over a pool whose unused slots hold NaN
    (fp8 values: 448, the largest finite code; see below)."""

    def __init__(self, name, seq_lens, seed=0):
        self.kind, dtype, self.group = STORE[name]
        g = torch.Generator().manual_seed(seed)
        pages = [math.ceil(n / PAGE) for n in seq_lens]
        nb = sum(pages) + 3
        k_shape = pa.cache_shape(nb, PAGE, H, D, self.kind)
        v_shape = pa.cache_shape(nb, PAGE, H, D, self.kind, values=True)
        nan = float("nan")
        if self.kind in (pa.KIND_FLOAT, pa.KIND_FP8):
            self.k = torch.full(k_shape, nan).to(dtype)
            # The kernels may read the unwritten tail of a sequence's last page of fp8 values, which
            # the cache keeps finite, and must weight it by exactly 0: poison with a huge finite value.
            self.v = torch.full(v_shape, pa.FP8_MAX if self.kind == pa.KIND_FP8 else nan).to(dtype)
        else:
            self.k, self.v = torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype)
        self.k_group, self.v_group = pa.split_group(self.group)
        kms, vms = (pa.scales_shape(nb, PAGE, H, D, g) for g in (self.k_group, self.v_group))
        # Poison: any slot never written dequantizes to NaN, so reading one shows in the output.
        self.ks = self.vs = self.kz = self.vz = None
        if self.kind >= pa.KIND_INT8:
            self.ks, self.vs = torch.full(kms, nan).half(), torch.full(vms, nan).half()
        if self.kind == pa.KIND_INT4:
            self.kz, self.vz = torch.full(kms, nan).half(), torch.full(vms, nan).half()
        perm = torch.randperm(nb, generator=g).tolist()
        self.tables, o = [], 0
        for n in pages:
            self.tables.append(perm[o:o + n])
            o += n
        width = max(pages)
        self.bt = torch.zeros(len(pages), width, dtype=torch.int32)
        for i, t in enumerate(self.tables):
            self.bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        self.seq_lens = list(seq_lens)
        self.k_raw = [torch.randn(n, H, D, generator=g) * 2 + torch.randn(D, generator=g) for n in seq_lens]
        self.v_raw = [torch.randn(n, H, D, generator=g) for n in seq_lens]

    def slots(self, i, lo, hi):
        return [self.tables[i][p // PAGE] * PAGE + p % PAGE for p in range(lo, hi)]

    def tensors(self):
        return self.k, self.v, self.ks, self.vs, self.kz, self.vz

    def write_all(self, fn):
        slots = torch.tensor([s for i, n in enumerate(self.seq_lens) for s in self.slots(i, 0, n)])
        k, v = torch.cat(self.k_raw), torch.cat(self.v_raw)
        fn(k, v, *self.tensors(), slots, self.kind, self.group)


def run_both(pool, q, q_lens, window=None, num_splits=None, out_cols=None, **knobs):
    qs = [0]
    for n in q_lens:
        qs.append(qs[-1] + n)
    args = (q, *pool.tensors(), pool.bt)
    ref = pa.paged_attention_ref(*args, qs, pool.seq_lens, 0.3, pool.kind, pool.group, window, torch.float32,
                                 out_cols=out_cols)
    out = pa.paged_attention(*args, torch.tensor(qs, dtype=torch.int32), torch.tensor(pool.seq_lens, dtype=torch.int32),
                             0.3, pool.kind, pool.group, window, torch.float32, max_query_len=max(q_lens),
                             max_seq_len=max(pool.seq_lens), num_splits=num_splits, block_n=16, out_cols=out_cols,
                             **knobs)
    return out, ref


@pytest.fixture
def nan_buffers(monkeypatch):
    """Every floating-point buffer the launchers allocate with torch.empty starts as NaN."""
    real_empty = torch.empty
    monkeypatch.setattr(pa.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
                        if (k.get("dtype") or torch.get_default_dtype()).is_floating_point else real_empty(*a, **k))


@pytest.mark.parametrize("name", list(STORE))
def test_cache_write_triton_matches_reference(name):
    a, b = Pool(name, [7, 13]), Pool(name, [7, 13])
    a.write_all(pa.cache_write_ref)
    b.write_all(pa.cache_write)
    for i, n in enumerate(a.seq_lens):
        va = pa.gather_ref(a.v, a.vs, a.vz, a.bt[i], n, a.kind, a.v_group, values=True)
        vb = pa.gather_ref(b.v, b.vs, b.vz, b.bt[i], n, b.kind, b.v_group, values=True)
        assert torch.isfinite(vb).all() and rel(vb, va) < (1e-6 if a.kind >= pa.KIND_INT8 else 0.13)
        ka = pa.gather_ref(a.k, a.ks, a.kz, a.bt[i], n, a.kind, a.k_group)
        kb = pa.gather_ref(b.k, b.ks, b.kz, b.bt[i], n, b.kind, b.k_group)
        # The interpreter rounds fp32 -> bf16/fp8 by truncation, the GPU and torch to nearest:
        # allow one step of the format there, nothing elsewhere.
        tol = {"bf16": 1e-2, "fp8": 0.13}.get(name, 1e-6)
        atol = 4e-3 if name == "fp8" else 1e-6  # fp8's subnormal step is 2 ** -9
        assert torch.isfinite(kb).all()
        close = (ka - kb).abs() <= tol * ka.abs() + atol
        if name == "fp8":
            # triton 3.6's interpreter also drops the carry when rounding up to the next power of
            # two (1.997 -> 1.0): a few elements; the GPU run (bench_attention.py) checks bit-exactness.
            assert close.float().mean() > 0.95
        else:
            assert close.all()
        # and the stored values are the quantization of the input
        err = rel(ka, a.k_raw[i])
        assert err < {"fp32": 1e-7, "bf16": 5e-3, "fp8": 5e-2, "int8": 1e-2, "int8-g": 1e-2, "int4": 0.12,
                       "int4-kv": 0.1}[name]


@pytest.mark.parametrize("fn", [pa.cache_write_ref, pa.cache_write])
def test_fp8_values_are_stored_transposed_and_never_nan(fn):
    """The documented layout, checked by index: token slot s of head h sits at
    v[s // PAGE, h, :, s % PAGE]; keys stay rows k[s // PAGE, s % PAGE, h, :]. NaN is stored as 0."""
    pool = Pool("fp8", [8])
    g = torch.Generator().manual_seed(4)
    # multiples of 1/8 in [-2, 2]: exact in e4m3, so no rounding (the interpreter's is off) enters
    k, v = (torch.randint(-16, 17, (2, 3, H, D), generator=g) / 8).unbind(0)
    v[1, 0, 3] = float("nan")
    slots = torch.tensor([2, 5, 7])
    fn(k, v, *pool.tensors(), slots, pool.kind, pool.group)
    for i, s in enumerate(slots.tolist()):
        for h in range(H):
            assert torch.equal(pool.v[s // PAGE, h, :, s % PAGE].float(), v[i, h].nan_to_num(0.0))
            assert torch.equal(pool.k[s // PAGE, s % PAGE, h, :].float(), k[i, h])


@pytest.mark.parametrize("name", ["int8", "int8-g"])
@pytest.mark.parametrize("fn", [pa.cache_write_ref, pa.cache_write])
def test_int8_values_are_stored_transposed_with_row_scales(fn, name):
    """int8 codes of token slot s, head h at v[s // PAGE, h, :, s % PAGE] (keys rows, as fp8), their
    scales in rows beside them: vs[s // PAGE, s % PAGE, h, :], one per group of the head."""
    pool = Pool(name, [8])
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 3, H, D, generator=g).unbind(0)
    slots = torch.tensor([2, 5, 7])
    fn(k, v, *pool.tensors(), slots, pool.kind, pool.group)
    codes, scales, _ = pa.quantize_ref(v, pa.KIND_INT8, pool.v_group, torch.int8)
    for i, s in enumerate(slots.tolist()):
        for h in range(H):
            assert torch.equal(pool.v[s // PAGE, h, :, s % PAGE], codes[i, h])
            assert torch.equal(pool.vs[s // PAGE, s % PAGE, h], scales[i, h])


def test_padding_slots_are_not_written():
    pool = Pool("int8", [8])
    k, v = torch.randn(3, H, D), torch.randn(3, H, D)
    before = pool.k.clone()
    pa.cache_write(k, v, *pool.tensors(), torch.tensor([-1, 5, -1]), pool.kind, pool.group)
    changed = (pool.k != before).flatten(2).any(-1).flatten()
    assert changed.nonzero().flatten().tolist() == [5]


@pytest.mark.parametrize("name,window", [(n, None) for n in STORE] + [("bf16", 5), ("fp8", 5), ("int8", 5),
                                                                      ("int4", 5), ("int4-kv", 5)])
def test_decode_and_mixed_batches_match_reference(name, window, nan_buffers):
    # every buffer the launcher allocates starts as NaN: outputs must be fully written, and a
    # combine that read a split's partials before they were written would show
    pool = Pool(name, [1, 9, 23, 16], seed=1)
    pool.write_all(pa.cache_write_ref)
    qdt = torch.bfloat16 if name == "bf16" else torch.float32
    # splits: one (direct), three combined by the last split to finish or by the reduce kernel, and
    # more splits than tiles both ways: the idle ones write nothing (their partials stay NaN), so
    # a combine that read past a sequence's `used` splits would show
    decode = [1, 1, 1, 1]
    for q_lens, splits, knobs in ((decode, 1, {}), (decode, 3, {}), (decode, 3, dict(fused_reduce=False)),
                                  (decode, 7, {}), (decode, 12, {}), (decode, 12, dict(fused_reduce=False)),
                                  (decode, 40, dict(fused_reduce=True)), ([1, 4, 23, 2], None, {})):
        q = torch.randn(sum(q_lens), H * G, D).to(qdt)
        out, ref = run_both(pool, q, q_lens, window, splits, **knobs)
        assert torch.isfinite(out).all() and torch.isfinite(ref).all()
        assert rel(out, ref) < 1e-5, (splits, knobs)
    # the fused combine's arrival counters are left at zero for the next launch (and graph replay)
    assert not splitk_workspace(torch.device("cpu"), 0, 0)[1].any()


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_gemma_heads_of_256_with_a_window(name, nan_buffers, monkeypatch):
    """Gemma 3's head_dim of 256 (1B-12B) on its sliding layers' window: decode and mixed batches."""
    monkeypatch.setattr(sys.modules[__name__], "D", 256)
    pool = Pool(name, [3, 21], seed=2)
    pool.write_all(pa.cache_write_ref)
    for q_lens, splits in (([1, 1], 1), ([1, 1], 3), ([2, 5], None)):
        q = torch.randn(sum(q_lens), H * G, 256)
        out, ref = run_both(pool, q, q_lens, 8, splits)
        assert torch.isfinite(out).all() and rel(out, ref) < 1e-5, (q_lens, splits)


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_outputs_written_in_a_given_column_order(name, nan_buffers):
    """out_cols (an act-order o_proj's input order): every kernel store path (one split, the fused
    combine, the reduce kernel, prefill/extend) writes head h's value d at column out_cols[h D + d],
    bit for bit the plain output scattered so; the reference does the same. A bad map is refused."""
    pool = Pool(name, [1, 9, 23, 16], seed=3)
    pool.write_all(pa.cache_write_ref)
    cols = torch.randperm(H * G * D, generator=torch.Generator().manual_seed(7)).to(torch.int32)
    decode = [1, 1, 1, 1]
    for q_lens, splits, knobs in ((decode, 1, {}), (decode, 3, {}), (decode, 3, dict(fused_reduce=False)),
                                  ([1, 4, 23, 2], None, {})):
        q = torch.randn(sum(q_lens), H * G, D).to(torch.bfloat16 if name == "bf16" else torch.float32)
        out, ref = run_both(pool, q, q_lens, None, splits, **knobs)
        got, got_ref = run_both(pool, q, q_lens, None, splits, out_cols=cols, **knobs)
        want = pa.scatter_columns(out, cols)
        assert torch.equal(want.view(len(q), -1)[:, cols.long()], out.view(len(q), -1))
        assert torch.equal(got, want), (splits, knobs)
        assert torch.equal(got_ref, pa.scatter_columns(ref, cols))
    with pytest.raises(ValueError, match="out_cols"):
        run_both(pool, q, q_lens, out_cols=cols[:-1])
    with pytest.raises(ValueError, match="out_cols"):
        run_both(pool, q, q_lens, out_cols=cols.long())


@pytest.mark.parametrize("splits,fused", [(1, None), (12, True), (12, False)])
def test_an_empty_sequence_decodes_to_zeros(splits, fused, nan_buffers):
    """Graph padding: a sequence of length 0 gets an all-zero output (split 0 writes it), the
    others are unaffected."""
    pool = Pool("bf16", [9, 23], seed=5)
    pool.write_all(pa.cache_write_ref)
    q = torch.randn(3, H * G, D).to(torch.bfloat16)
    lens = torch.tensor([9, 0, 23], dtype=torch.int32)
    bt = torch.stack([pool.bt[0], pool.bt[0], pool.bt[1]])
    out = pa.paged_attention(q, *pool.tensors(), bt, torch.arange(4, dtype=torch.int32), lens, 0.3, pool.kind,
                             pool.group, None, torch.float32, max_query_len=1, max_seq_len=23, num_splits=splits,
                             block_n=16, fused_reduce=fused)
    ref = pa.paged_attention_ref(q[[0, 2]], *pool.tensors(), pool.bt, [0, 1, 2], [9, 23], 0.3, pool.kind, pool.group, None,
                                 torch.float32)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel(out[[0, 2]], ref) < 1e-5


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_paged_equals_plain_attention(name):
    """The reference paged path against causal attention over the contiguous K/V (GQA, chunks)."""
    pool = Pool(name, [5, 17, 12], seed=2)
    pool.write_all(pa.cache_write)
    q_lens = [5, 3, 1]
    qdt = torch.bfloat16 if name == "bf16" else torch.float32
    q = torch.randn(sum(q_lens), H * G, D).to(qdt)
    out, _ = run_both(pool, q, q_lens)
    lo = 0
    for i, n in enumerate(q_lens):
        k, v = pool.k_raw[i], pool.v_raw[i]
        plain = causal_attention(q[lo:lo + n].float(), k, v, 0.3)
        assert rel(out[lo:lo + n], plain) < (1e-2 if name == "bf16" else 1e-5)
        lo += n


def test_quantized_attention_error_is_small():
    """Against attention over the unquantized K/V: the error each format should roughly give."""
    for name, bound in (("fp8", 0.08), ("int8", 0.02), ("int4", 0.2)):
        pool = Pool(name, [40], seed=3)
        pool.write_all(pa.cache_write_ref)
        q = torch.randn(40, H * G, D) * 0.3
        out = pa.paged_attention_ref(q, *pool.tensors(), pool.bt, [0, 40], [40], 0.3, pool.kind, pool.group)
        plain = causal_attention(q, pool.k_raw[0], pool.v_raw[0], 0.3)
        assert rel(out, plain) < bound, name


def _wide(splits, bn, stages):
    """A decode_config of 4-warp programs."""
    return dict(num_splits=splits, block_n=bn, num_warps=4, num_stages=stages)


def _narrow(splits, kind=pa.KIND_FP8):
    """A decode_config of 2-warp programs (int8's hold 128-token tiles)."""
    return dict(num_splits=splits, **(pa.NARROW_INT8 if kind == pa.KIND_INT8 else pa.NARROW))


def test_decode_defaults():
    """One wave of single-program-per-SM 16-bit tiles; about two waves for quantized KV; splits of
    >= 256 tokens, or of 128 from 512 tokens on while the combine stays fused; the fused combine
    only for few splits; narrow programs where they fill the GPU better (fp8, int8, int4)."""
    cfg = lambda kind, nbytes, b, ctx: pa.decode_config(kind, nbytes, b, 8, ctx, 132)  # noqa: E731
    assert cfg(pa.KIND_FLOAT, 2, 1, 32768) == _wide(16, 128, 5)
    assert cfg(pa.KIND_FLOAT, 2, 16, 32768) == _wide(1, 128, 5)
    assert cfg(pa.KIND_FLOAT, 2, 80, 32768) == _wide(1, 64, 2)  # one wave, 5 per SM
    assert cfg(pa.KIND_FLOAT, 2, 96, 4096) == _wide(1, 128, 3)  # past it
    assert cfg(pa.KIND_FLOAT, 2, 256, 32768) == _wide(1, 128, 3)
    assert cfg(pa.KIND_FLOAT, 4, 1, 32768)["block_n"] == 64
    assert cfg(pa.KIND_FP8, 1, 256, 32768) == _wide(1, 128, 3)
    assert cfg(pa.KIND_INT8, 1, 1, 100)["num_splits"] == 1
    assert cfg(pa.KIND_INT8, 1, 16, 32768) == _wide(3, 128, 3)
    # short sequences: splits of one 128-token tile, up to the fused combine's limit; not below 512
    assert [cfg(pa.KIND_FLOAT, 2, 1, n)["num_splits"] for n in (256, 511, 512, 1024, 2048, 4096)] == [1, 1, 4, 8, 8, 16]
    assert cfg(pa.KIND_FP8, 1, 1, 1024)["num_splits"] == pa.SHORT_SPLITS_MAX
    assert cfg(pa.KIND_FLOAT, 2, 16, 1024)["num_splits"] == 1  # B x H fills the GPU: no split
    assert 1 < pa.SHORT_SPLITS_MAX <= pa.FUSED_COMBINE_MAX_SPLITS < 33
    # an engine graph sized for 4096 tokens at batch 1 combines its splits in the decode kernel
    assert cfg(pa.KIND_FLOAT, 2, 1, 4096)["num_splits"] <= pa.FUSED_COMBINE_MAX_SPLITS


def test_decode_tiles_of_wide_heads_fit_in_shared_memory():
    """Gemma 3's 256-wide heads: 16-bit and fp32 tiles hold half the tokens, as many bytes as at 128
    (a double-buffered 128-token bf16 tile of them would need 256 KB; an H100 has 227); quantized
    rows (a byte or less) keep their tiles."""
    for b in (1, 16, 80, 256):
        for nbytes in (2, 4):
            at128 = pa.decode_config(pa.KIND_FLOAT, nbytes, b, 8, 32768, 132)
            at256 = pa.decode_config(pa.KIND_FLOAT, nbytes, b, 8, 32768, 132, head_dim=256)
            assert at256 == {**at128, "block_n": at128["block_n"] // 2}
            buffers = 2 if at256["num_stages"] >= 5 else 1  # (Triton double-buffers this loop from 5 stages)
            assert at256["block_n"] * 256 * nbytes * 2 * buffers <= 128 << 10  # K and V tiles
    for kind in (pa.KIND_FP8, pa.KIND_INT8, pa.KIND_INT4):
        assert pa.decode_config(kind, 1, 1, 8, 32768, 132, head_dim=256) == pa.decode_config(kind, 1, 1, 8, 32768, 132)


def test_decode_defaults_narrow_programs():
    """fp8 and int8: a small batch with enough tokens fills one wave of narrow programs; a split batch
    whose wide programs would not fit in one wave keeps its splits on narrow ones; else the wide
    tiles. int4: narrow programs with twice the splits at every batch. Splits never shorter than a
    tile."""
    cfg = lambda kind, b, ctx: pa.decode_config(kind, 1, b, 8, ctx, 132)  # noqa: E731
    one_wave = pa.NARROW_PER_SM[pa.KIND_FP8] * 132
    assert cfg(pa.KIND_FP8, 1, 32768) == _narrow(64)  # split cap
    assert cfg(pa.KIND_FP8, 4, 8192) == _narrow(one_wave // 32)
    assert cfg(pa.KIND_FP8, 8, 32768) == _narrow(one_wave // 64)
    assert cfg(pa.KIND_FP8, 1, 8192) == _wide(32, 128, 5)  # too little work
    assert cfg(pa.KIND_FP8, 16, 32768) == _wide(3, 128, 5)  # 384 fit
    assert cfg(pa.KIND_FP8, 32, 32768) == _narrow(2)  # 512 wide programs would take 1.3 waves
    for b, ctx in ((1, 32768), (4, 8192), (8, 32768), (32, 2048)):
        c = cfg(pa.KIND_FP8, b, ctx)
        assert b * 8 * c["num_splits"] <= one_wave
    # int8 (wide programs 3 an SM, narrow ones of 128-token tiles 4): B = 32 and 64 make 512 programs
    assert cfg(pa.KIND_INT8, 32, 32768) == _narrow(2, pa.KIND_INT8)
    assert cfg(pa.KIND_INT8, 64, 2048) == _narrow(1, pa.KIND_INT8)
    assert cfg(pa.KIND_INT8, 128, 2048)["num_warps"] == 4  # more than a wave either way
    assert cfg(pa.KIND_INT8, 16, 32768) == _wide(3, 128, 3)  # 384 fit the wide wave
    assert cfg(pa.KIND_INT8, 1, 32768) == _narrow(64, pa.KIND_INT8)  # one narrow wave (4 an SM), split cap
    assert cfg(pa.KIND_INT8, 8, 32768) == _narrow(528 // 64, pa.KIND_INT8)
    assert cfg(pa.KIND_INT8, 1, 8192) == _wide(32, 128, 3)  # too little work
    assert cfg(pa.KIND_INT8, 1, 256)["num_splits"] * pa.NARROW_INT8["block_n"] <= 256
    assert cfg(pa.KIND_INT4, 1, 2048) == _narrow(16)
    assert cfg(pa.KIND_INT4, 1, 32768) == _narrow(64)
    assert cfg(pa.KIND_INT4, 256, 32768) == _narrow(2)
    assert cfg(pa.KIND_INT4, 4, 100) == _narrow(1)  # 100 tokens: one 64-token tile's split at most
    assert cfg(pa.KIND_INT4, 1, 300)["num_splits"] * pa.NARROW["block_n"] <= 300


@triton.jit
def _rows_kernel(C, S, Z, SLOT, OUT, H: tl.constexpr, D: tl.constexpr, DC: tl.constexpr, KIND: tl.constexpr,
                 GROUP: tl.constexpr, N: tl.constexpr):
    slot = tl.load(SLOT + tl.arange(0, N))
    x = _load_rows(C, S, Z, slot, 1, slot >= 0, tl.arange(0, D), H, D, DC, KIND, GROUP)
    tl.store(OUT + tl.arange(0, N)[:, None] * D + tl.arange(0, D)[None, :], x.to(tl.float32))


@pytest.mark.parametrize("name", ["int8", "int8-g", "int4", "int4-kv"])
def test_load_rows_is_the_reference_dequantization(name):
    """The kernels' row dequantization (keys of every quantized kind, int4 values, the extend kernel's
    int8 keys) against dequantize_ref, bit for bit, in a shuffled order with a masked row (zeros)."""
    pool = Pool(name, [8])
    pool.write_all(pa.cache_write_ref)
    written = pool.slots(0, 0, 8)
    slots = torch.tensor([written[i] if i >= 0 else -1 for i in (3, 0, 7, -1, 5, 1, 6, 2)], dtype=torch.int32)
    out = torch.full((8, D), float("nan"))
    g = pool.k_group
    _rows_kernel[(1,)](pool.k, pool.ks, pool.kz if pool.kz is not None else pool.ks, slots, out, H=H, D=D,
                       DC=pool.k.shape[-1], KIND=pool.kind, GROUP=g, N=8)
    rows = lambda t: None if t is None else t.flatten(0, 1)[slots.clamp(min=0).long(), 1]  # noqa: E731
    want = pa.dequantize_ref(rows(pool.k), rows(pool.ks), rows(pool.kz), pool.kind, g)
    want[3] = 0.0  # the masked row: codes and scales read as 0
    assert torch.equal(out, want)


@pytest.mark.parametrize("kind,storage,max_len", [
    (pa.KIND_FLOAT, torch.bfloat16, 2048), (pa.KIND_FLOAT, torch.bfloat16, 32768),
    (pa.KIND_FP8, torch.float8_e4m3fn, 2048), (pa.KIND_FP8, torch.float8_e4m3fn, 32768),
    (pa.KIND_INT8, torch.int8, 32768), (pa.KIND_INT4, torch.uint8, 8192)])
def test_decode_batch_classes_meet_every_compiled_variant(monkeypatch, kind, storage, max_len):
    """decode_batch_classes promises that decoding its batch sizes launches every compiled variant
    of the decode (and reduce) kernels that any batch up to the maximum launches. Observed at the
    launches themselves: the kernels are replaced by recorders of what Triton keys a compile on
    (constexprs, warps, stages, and the split count being 1 or a multiple of 16)."""
    launches: list[tuple] = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                splits = dict(zip(self.kernel.arg_names, args))["num_splits"]
                launches.append((self.kernel.fn.__name__, splits == 1, splits % 16 == 0, tuple(sorted(kw.items()))))
            return launch

    monkeypatch.setattr(pa, "_decode_kernel", Recorder(pa._decode_kernel))
    monkeypatch.setattr(pa, "_reduce_kernel", Recorder(pa._reduce_kernel))
    monkeypatch.setattr(pa, "num_sms", lambda index: 132)
    h, d, page, max_batch = 8, 32, 16, 300
    k_shape, v_shape = (pa.cache_shape(2, page, h, d, kind, values) for values in (False, True))
    k_cache, v_cache = torch.zeros(k_shape, dtype=storage), torch.zeros(v_shape, dtype=storage)
    group = (16, 32) if kind == pa.KIND_INT4 else d

    def variants(batch: int) -> set:
        launches.clear()
        q = torch.zeros(batch, h, d)
        pa.paged_attention(q, k_cache, v_cache, None, None, None, None, torch.zeros(batch, 1, dtype=torch.int32),
                           torch.arange(batch + 1, dtype=torch.int32), torch.ones(batch, dtype=torch.int32), 1.0,
                           kind, group, max_query_len=1, max_seq_len=max_len)
        return set(launches)

    classes = pa.decode_batch_classes(kind, k_cache.element_size(), h, max_len, max_batch, 132)
    assert classes == sorted(set(classes)) and classes[0] == 1 and classes[-1] <= max_batch
    assert len(classes) < 20  # a handful of variants, not one per batch size
    covered = set().union(*(variants(b) for b in classes))
    for b in range(1, max_batch + 1):
        assert variants(b) <= covered, b


def test_decode_launch_combines_past_16_splits_only_in_fp8_narrow_programs():
    """Past FUSED_COMBINE_MAX_SPLITS the reduce kernel combines the splits, except for fp8's narrow
    (2-warp) programs, which still combine in their last split, up to 64 splits; one split combines
    nothing."""
    launch = lambda kind, b, ctx, **kw: pa.decode_launch(kind, 1, b, 8, ctx, 132, **kw)  # noqa: E731
    narrow = launch(pa.KIND_FP8, 1, 32768)  # B = 1 at 32k: one wave of narrow programs
    assert narrow["num_warps"] == 2 and narrow["num_splits"] > pa.FUSED_COMBINE_MAX_SPLITS and narrow["fused"]
    wide = launch(pa.KIND_FP8, 1, 16384)
    assert wide["num_warps"] == 4 and wide["num_splits"] > pa.FUSED_COMBINE_MAX_SPLITS and not wide["fused"]
    for kind in (pa.KIND_INT8, pa.KIND_INT4):  # narrow programs too, but slower fused (RESULTS.md)
        other = launch(kind, 1, 32768)
        assert other["num_warps"] == 2 and other["num_splits"] > pa.FUSED_COMBINE_MAX_SPLITS and not other["fused"]
    assert launch(pa.KIND_FP8, 1, 16384, num_splits=pa.FUSED_COMBINE_MAX_SPLITS)["fused"]
    assert not launch(pa.KIND_FP8, 1, 32768, fused_reduce=False)["fused"]
    one = launch(pa.KIND_FLOAT, 256, 32768, num_splits=1)
    assert one["direct"] and not one["fused"] and one["sp"] == 1
    assert [launch(pa.KIND_FP8, 1, 32768, num_splits=s)["sp"] for s in (2, 3, 33, 64)] == [2, 4, 64, 64]


def test_fp8_narrow_splits_past_two_combine_chunks_are_whole_chunks():
    """The fused combine reads its splits one chunk per round trip: past two chunks a partial last
    chunk costs a full one, so fp8's narrow split count is rounded down to whole chunks there."""
    chunk = pa.FUSED_COMBINE_CHUNK
    assert [pa.whole_combine_chunks(s) for s in (1, 16, 27, 2 * chunk, 2 * chunk + 1, 41, 50, 64)] == \
        [1, 16, 27, 2 * chunk, 2 * chunk, 32, 48, 64]
    cfg = lambda kind, b: pa.decode_config(kind, 1, b, 8, 32768, 132)  # noqa: E731
    assert cfg(pa.KIND_FP8, 2)["num_splits"] == 32 and cfg(pa.KIND_FP8, 2)["num_warps"] == 2  # one wave: 41
    assert cfg(pa.KIND_FP8, 3)["num_splits"] == 27 and cfg(pa.KIND_FP8, 1)["num_splits"] == 64
    assert cfg(pa.KIND_INT8, 2)["num_splits"] == 4 * 132 // 16  # the reduce kernel combines int8: no rounding
