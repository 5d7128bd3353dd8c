"""The tiled 4/8-bit layout and its kernels (fitllm/kernels/w4a16_tiled.py): the layout against its
documented bit positions, round trips, and every kernel path under TRITON_INTERPRET=1 (set by
conftest.py) against a float64 oracle of the dequantized weights."""

import os

import pytest
import torch

pytest.importorskip("triton")

from fitllm.kernels.w4a16_tiled import (
    _gemv,
    _tiled,
    _ws,
    dequantize_tiled,
    permute_tile_rows,
    tile_pack,
    tile_unpack,
    tiled_supported,
    w4a16_tiled_gemm,
    w4a16_tiled_ref,
    w4a16_tiled_triton,
    words_per_tile,
)
from fitllm.quant.formats.packing import KernelWeight, TiledWeight, pack_dim0

from kernel_checks import GEN, act_order_weight, offline_script_rows, rel_err, split_k_both_ways  # noqa: E402


def rand_weight(K, N, group_size, dtype=torch.bfloat16, bits=4):
    q = torch.randint(0, 1 << bits, (K, N), generator=GEN)
    G = -(-K // group_size)
    scales = (torch.rand(G, N, generator=GEN) * 0.05 + 0.01).to(dtype)
    zeros = torch.randint(0, 1 << bits, (G, N), generator=GEN).to(dtype)
    g = torch.arange(K) // min(group_size, K)
    w64 = (q.double() - zeros.double()[g]) * scales.double()[g]  # [K, N]
    return tile_pack(pack_dim0(q, bits), bits), scales, zeros, w64, q


# --------------------------------------------------------------------------- layout

def test_layout_matches_the_documented_bit_positions():
    K, N = 256, 131  # one full block of 128 rows, then a block of 3
    q = torch.randint(0, 16, (K, N), generator=GEN)
    qt = tile_pack(pack_dim0(q, 4))
    assert qt.shape == (N, K // 8) and qt.dtype == torch.int32
    flat, W = qt.reshape(-1).to(torch.int64) & 0xFFFFFFFF, K // 8
    for n in (0, 1, 77, 127, 128, 130):
        b = n // 128
        rows = min(128, N - 128 * b)
        for tile in range(K // 128):
            for c in range(4):
                for t in range(4):
                    # tile-major blocks of 128 rows; word r = c + 4t lives at p = 4c + t
                    word = int(flat[128 * b * W + (tile * rows + n - 128 * b) * 16 + 4 * c + t])
                    for f in range(4):
                        for h in range(2):
                            k = 128 * tile + 32 * f + 8 * t + 2 * c + h  # = 32 f + 2 r + h
                            assert (word >> (4 * (f + 4 * h))) & 0xF == int(q[k, n])


def test_8bit_layout_matches_the_documented_bit_positions():
    K, N = 256, 131
    q = torch.randint(0, 256, (K, N), generator=GEN)
    qt = tile_pack(pack_dim0(q, 8), 8)
    assert qt.shape == (N, K // 4) and qt.dtype == torch.int32
    flat, W = qt.reshape(-1).to(torch.int64) & 0xFFFFFFFF, K // 4
    for n in (0, 77, 128, 130):
        b = n // 128
        rows = min(128, N - 128 * b)
        for tile in range(K // 128):
            for u in range(2):
                for c in range(4):
                    for t in range(4):
                        # 32 words a tile: section u at p = 16 u + 4 c + t, word r = c + 4 t
                        word = int(flat[128 * b * W + (tile * rows + n - 128 * b) * 32 + 16 * u + 4 * c + t])
                        for f in range(2):
                            for h in range(2):
                                k = 128 * tile + 64 * u + 32 * f + 8 * t + 2 * c + h
                                assert (word >> (8 * (f + 2 * h))) & 0xFF == int(q[k, n])


def test_layout_pairs_are_neighbouring_k():
    # the LOP3 (w >> 4f) & 0x000F000F puts fields f and f+4 in the two halves: they must be k, k+1
    q = torch.arange(128).remainder(16).view(128, 1).repeat(1, 2)  # q[k] = k % 16
    word = int(tile_pack(pack_dim0(q, 4))[0, 0]) & 0xFFFFFFFF  # p = 0: c = 0, t = 0
    for f in range(4):
        pair = (word >> (4 * f)) & 0x000F000F
        assert pair & 0xF == (32 * f) % 16 and pair >> 16 == (32 * f + 1) % 16


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K,N", [(128, 5), (576, 5), (4096 + 64, 5), (256, 256), (384, 300)])
def test_round_trip_and_padding(K, N, bits):
    q = torch.randint(0, 1 << bits, (K, N), generator=GEN)
    qt = tile_pack(pack_dim0(q, bits), bits)
    kp = qt.shape[1] * 32 // bits
    assert kp == -(-K // 128) * 128
    assert torch.equal(tile_unpack(qt, K, bits), q.to(torch.int32))
    assert (tile_unpack(qt, kp, bits)[K:] == 0).all()  # padding words are zero
    idx = torch.randperm(N, generator=GEN)
    assert torch.equal(tile_unpack(permute_tile_rows(qt, idx, bits), K, bits), q.to(torch.int32)[:, idx])


def test_supported_weights():
    assert tiled_supported(4, 128, 4096, None, torch.bfloat16)
    assert tiled_supported(4, 64, 576, None, torch.float16)
    assert tiled_supported(4, 4096, 4096, None, torch.bfloat16)  # per channel
    assert tiled_supported(8, 128, 4096, None, torch.bfloat16)
    assert not tiled_supported(2, 128, 4096, None, torch.bfloat16)
    assert not tiled_supported(4, 128, 4096, torch.zeros(4096, dtype=torch.int32), torch.bfloat16)
    assert not tiled_supported(4, 128, 4096, None, torch.float32)
    assert not tiled_supported(4, 96, 4608, None, torch.bfloat16)


@pytest.mark.parametrize("bits", [4, 8])
def test_tiled_weight_dequantizes_like_the_standard_layout(bits):
    K, N = 320, 24
    q = torch.randint(0, 1 << bits, (K, N), generator=GEN)
    kw = KernelWeight(pack_dim0(q, bits), torch.rand(K // 64, N, generator=GEN),
                      torch.randint(0, 1 << bits, (K // 64, N)).float(), bits, 64)
    tw = TiledWeight.from_kernel(kw)
    assert tw.bits == bits and tw.qtile.shape == (N, 384 * bits // 32)
    assert torch.equal(tw.dequantize(torch.float32), kw.dequantize(torch.float32))
    idx = torch.randperm(N, generator=GEN)
    assert torch.equal(tw.permute_outputs(idx).dequantize(), kw.dequantize()[idx])


# --------------------------------------------------------------------------- kernels

TC_CASES = [  # (M, K, N, group, dtype, config)
    (3, 256, 64, 128, torch.bfloat16, _tiled(16, 64, 4, 2, waves=4)),  # split-K, one chunk per tile
    (17, 384, 96, 64, torch.float16, _tiled(16, 64, 4, 2, waves=0)),  # two M blocks, N tail, chunks of 64
    (5, 256, 64, 32, torch.bfloat16, _tiled(32, 128, 4, 2, waves=2)),  # chunks of 32, BN 128 (2 row reps)
    (2, 576, 64, 64, torch.bfloat16, _tiled(16, 64, 4, 2, waves=2)),  # K padded to 640 (SmolLM2)
    (9, 256, 64, 256, torch.bfloat16, _tiled(16, 64, 4, 2, waves=2)),  # per channel
    (20, 256, 64, 128, torch.bfloat16, _tiled(32, 64, 4, 2, waves=0, scale_in_w=True)),  # scale in the weights
    (4, 192, 64, 64, torch.float16, _tiled(16, 64, 4, 2, waves=2, scale_in_w=True)),
    (70, 256, 64, 128, torch.bfloat16, _tiled(0, 0, 4, 1, backend="dequant")),  # large-M path
    (1, 512, 64, 128, torch.bfloat16, _gemv(64, 1, 4, waves=4)),  # GEMV, one row, split-K
    (2, 384, 96, 128, torch.bfloat16, _gemv(64, 2, 4, waves=2)),  # two rows, N tail, unroll 2 (odd tiles)
    (3, 256, 64, 256, torch.float16, _gemv(64, 1, 4, waves=0)),  # four-row block, per channel
    (6, 576, 64, 576, torch.bfloat16, _gemv(64, 1, 4, waves=2)),  # two row blocks, K padded
    (1, 256, 64, 64, torch.bfloat16, _gemv(64, 1, 4, waves=2)),  # groups of 64: falls back to the tc tile
    # N across stored blocks of 128 rows (full blocks, then a shorter one)
    (1, 256, 320, 128, torch.bfloat16, _gemv(128, 2, 4, waves=2)),
    (1, 256, 320, 128, torch.bfloat16, _gemv(64, 1, 4, waves=2)),  # BN divides N: unmasked loads
    (2, 256, 320, 128, torch.bfloat16, _gemv(256, 1, 4, waves=1)),  # a program spans two blocks
    (5, 256, 448, 64, torch.bfloat16, _tiled(16, 64, 4, 2, waves=2)),
    (3, 256, 320, 128, torch.float16, _tiled(16, 128, 4, 2, waves=2)),
    (80, 256, 320, 128, torch.bfloat16, _tiled(0, 0, 4, 1, backend="dequant")),
    # the sm90 table's wide-weight tiles (gate_up): BN 128 at 4 warps (2 row reps), BN 256 at 8 warps
    (33, 256, 384, 128, torch.bfloat16, _tiled(64, 128, 4, 3, waves=2)),
    (65, 256, 320, 128, torch.bfloat16, _tiled(128, 256, 8, 3, waves=1, scale_in_w=True)),
    # the warp-specialised Hopper rows: Gluon has no interpreter, so off sm90 they take the dequant path
    (300, 256, 256, 128, torch.bfloat16, _ws(128, 3)),
    (100, 256, 256, 128, torch.bfloat16, _ws(64, 4, _tiled(128, 128, 8, 3, waves=1, scale_in_w=True))),
]


W8_CASES = [  # 8-bit weights: bf16 through fp32, fp16 through 16-bit pairs; every chunk; the table's tiles
    (3, 256, 64, 128, torch.bfloat16, _tiled(16, 64, 4, 2, waves=4)),
    (17, 384, 96, 64, torch.float16, _tiled(16, 64, 4, 2, waves=0)),
    (5, 256, 64, 32, torch.bfloat16, _tiled(32, 128, 4, 2, waves=2)),
    (2, 576, 64, 64, torch.bfloat16, _tiled(16, 64, 4, 2, waves=2)),  # K padded
    (9, 256, 64, 256, torch.float16, _tiled(16, 64, 4, 2, waves=2)),  # per channel
    (20, 256, 64, 128, torch.bfloat16, _tiled(32, 64, 4, 2, waves=0, scale_in_w=True)),
    (4, 192, 64, 64, torch.float16, _tiled(16, 64, 4, 2, waves=2, scale_in_w=True)),
    (65, 256, 320, 128, torch.bfloat16, _tiled(128, 128, 8, 3, waves=1, scale_in_w=True)),
    (70, 256, 320, 128, torch.bfloat16, _tiled(0, 0, 4, 1, backend="dequant")),
    (1, 512, 320, 128, torch.bfloat16, _gemv(128, 1, 8, waves=4)),  # the GEMV: one row, split-K, N across blocks
    (2, 384, 96, 128, torch.bfloat16, _gemv(64, 2, 4, waves=2)),  # two rows, N tail, unroll 2 (odd tiles)
    (3, 256, 64, 256, torch.float16, _gemv(64, 1, 4, waves=0)),  # four-row block, per channel, fp16
    (6, 576, 64, 576, torch.bfloat16, _gemv(64, 1, 4, waves=2)),  # two row blocks, K padded
    (1, 256, 64, 64, torch.bfloat16, _gemv(64, 1, 4, waves=2)),  # groups of 64: the tc tile
    # the warp-specialised rows (no interpreter for Gluon: off sm90 they run their fallback)
    (100, 256, 256, 128, torch.bfloat16, _ws(64, 4, _tiled(64, 64, 4, 2, waves=1))),
    (300, 256, 256, 128, torch.float16, _ws(128, 3)),
]
KERNEL_CASES = [(4, *c) for c in TC_CASES] + [(8, *c) for c in W8_CASES]


@pytest.mark.parametrize("bits,M,K,N,gs,dtype,cfg", KERNEL_CASES,
                         ids=[f"w{c[0]}-{c[6]['backend']}-M{c[1]}-K{c[2]}-g{c[4]}-{str(c[5])[6:]}" for c in KERNEL_CASES])
def test_kernel_matches_float64(bits, M, K, N, gs, dtype, cfg):
    qt, s, z, w64, _ = rand_weight(K, N, gs, dtype, bits)
    x = torch.randn(M, K, generator=GEN).to(dtype)
    bias = torch.randn(N, generator=GEN).to(dtype)
    y = torch.full((M, N), float("nan"), dtype=dtype)
    w4a16_tiled_triton(x, qt, s, z, gs, K, bias=bias, config=cfg, out=y, bits=bits)
    ref = x.double() @ w64 + bias.double()
    assert rel_err(y, ref) < 1e-2
    # the torch reference computes the same function
    assert rel_err(w4a16_tiled_ref(x, qt, s, z, gs, K, bias=bias, bits=bits), ref) < 1e-2


@pytest.mark.parametrize("M", [1, 17, 33, 65, 130, 257])
def test_8bit_table_rows_as_an_sm90_card_picks_them(M, monkeypatch):
    """8-bit tiled weights take TILED8_CONFIGS: the GEMV at M = 1, tensor-core tiles up to M = 64 (the
    widest weights: a ws row from M = 1, its fallback the tile), then
    warp-specialised rows whose fallbacks a card without them (here: the interpreter) runs, tensor-core
    tiles to M = 256 and dequantize + cuBLAS beyond; picked by the launcher itself; N crosses a stored
    block."""
    import fitllm.kernels.w4a16_tiled as tiled

    monkeypatch.setattr(tiled, "gpu_arch", lambda _: "sm90")
    K, N = 256, 6144 if M == 65 else 192  # N = 6144: the M <= 128 row's width range
    qt, s, z, w64, _ = rand_weight(K, N, 128, torch.bfloat16, 8)
    x = torch.randn(M, K, generator=GEN).to(torch.bfloat16)
    y = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    ran, gemv = [], tiled._launch_gemv
    monkeypatch.setattr(tiled, "dequantize_tiled", lambda *a, **k: ran.append("dequant") or dequantize_tiled(*a, **k))
    monkeypatch.setattr(tiled, "_launch_gemv", lambda *a: ran.append("gemv") or gemv(*a))
    tiled.w4a16_tiled_triton(x, qt, s, z, 128, K, out=y, bits=8)
    assert rel_err(y, x.double() @ w64) < 1e-2
    assert ran == (["gemv"] if M == 1 else ["dequant"] if M > 256 else [])


def test_split_k_workspace_is_left_clean():
    from fitllm.kernels import _utils

    qt, s, z, w64, _ = rand_weight(512, 64, 128)
    x = torch.randn(2, 512, generator=GEN).bfloat16()
    for cfg in (_tiled(16, 64, 4, 2, waves=8), _gemv(64, 1, 4, waves=8)):
        for _ in range(2):  # a second launch reads the workspace the first one left
            assert rel_err(w4a16_tiled_triton(x, qt, s, z, 128, 512, config=cfg), x.double() @ w64) < 1e-2
    ws, cnt = _utils.splitk_workspace(torch.device("cpu"), 0, 0)
    assert (ws == 0).all() and (cnt == 0).all()


@pytest.mark.parametrize("cfg", [_tiled(16, 64, 4, 2, waves=8), _gemv(64, 1, 4, waves=8), _gemv(64, 1, 4, waves=0)],
                         ids=["tc", "gemv", "gemv-one-split"])
@pytest.mark.parametrize("consumer", ["rms_norm", "silu_mul", "rms_norm-torch", "silu_mul-torch", "materialize"])
def test_deferred_split_k_sum_is_taken_by_its_consumer(cfg, consumer, monkeypatch):
    """defer=True: a split-K launch leaves its sum in the workspace (a PendingSum, no counter, no
    y) and the consumer rounds it as the GEMM rounds y, then zeroes the workspace: the consumer's
    output equals the one from the GEMM's own y bit for bit, and the next split-K GEMM starts
    clean. One split: y itself comes back."""
    from fitllm.kernels import _utils, fused

    monkeypatch.delenv("FITLLM_SPLITK_DEFER", raising=False)  # the default
    K, N = 512, 128
    qt, s, z, w64, _ = rand_weight(K, N, 128)
    x = torch.randn(1 if cfg["backend"] == "gemv" else 3, K, generator=GEN).bfloat16()
    y = w4a16_tiled_triton(x, qt, s, z, 128, K, config=cfg)
    out = w4a16_tiled_triton(x, qt, s, z, 128, K, config=cfg, defer=True)
    assert isinstance(out, _utils.PendingSum) == (cfg["waves"] > 0)
    ws, cnt = _utils.splitk_workspace(torch.device("cpu"), 0, 0)
    if isinstance(out, _utils.PendingSum):
        assert out.shape == y.shape and out.dtype == y.dtype and (cnt == 0).all()
        assert torch.equal(out.acc.to(y.dtype), y)  # the same sum, not yet rounded
    residual = torch.randn(y.shape, generator=GEN).bfloat16()
    weight = torch.rand(N, generator=GEN).bfloat16()
    consumer, _, backend = consumer.partition("-")
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", backend or "triton")  # the fused kernels, or the references
    if consumer == "rms_norm":
        got, want = fused.rms_norm(out, weight, 1e-6, residual), fused.rms_norm(y, weight, 1e-6, residual)
    elif consumer == "silu_mul":
        got, want = fused.silu_mul(out), fused.silu_mul(y)
    else:
        got, want = out.materialize() if isinstance(out, _utils.PendingSum) else out, y
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)
    assert (ws == 0).all() and (cnt == 0).all()


def test_no_deferred_sum_where_it_cannot_be_taken(monkeypatch):
    """A bias, an `out`, deterministic mode or FITLLM_SPLITK_DEFER=0 finish y in the GEMM; deferral is
    the default otherwise."""
    monkeypatch.delenv("FITLLM_SPLITK_DEFER", raising=False)
    qt, s, z, w64, _ = rand_weight(512, 64, 128)
    x = torch.randn(1, 512, generator=GEN).bfloat16()
    cfg = _gemv(64, 1, 4, waves=8)
    bias = torch.randn(64, generator=GEN).bfloat16()
    assert isinstance(w4a16_tiled_triton(x, qt, s, z, 128, 512, bias=bias, config=cfg, defer=True), torch.Tensor)
    assert isinstance(w4a16_tiled_triton(x, qt, s, z, 128, 512, config=cfg, out=torch.empty(1, 64).bfloat16(),
                                         defer=True), torch.Tensor)
    from fitllm.kernels import _utils

    pending = w4a16_tiled_triton(x, qt, s, z, 128, 512, config=cfg, defer=True)
    assert isinstance(pending, _utils.PendingSum)
    pending.materialize()  # nobody else takes it: clean the workspace
    for var in ("FITLLM_DETERMINISTIC=1", "FITLLM_SPLITK_DEFER=0"):
        with monkeypatch.context() as m:
            m.setenv(*var.split("="))
            y = w4a16_tiled_triton(x, qt, s, z, 128, 512, config=cfg, defer=True)
            assert isinstance(y, torch.Tensor) and rel_err(y, x.double() @ w64) < 1e-2


@pytest.mark.parametrize("cfg", [_tiled(16, 64, 4, 2, waves=16), _gemv(64, 1, 4, waves=16)], ids=["tc", "gemv"])
def test_deterministic_split_k_sums_the_same_partials(cfg, monkeypatch):
    """FITLLM_DETERMINISTIC=1 (see tests/test_kernels_gemm.py's twin): ten splits, the ordered sum
    equals the interpreter's in-order atomic sum bit for bit, and both are right."""
    qt, s, z, w64, _ = rand_weight(1280, 64, 128)
    x = torch.randn(1 if cfg["backend"] == "gemv" else 3, 1280, generator=GEN).bfloat16()
    bias = torch.randn(64, generator=GEN).bfloat16()
    atomic, ordered = split_k_both_ways(lambda: w4a16_tiled_triton(x, qt, s, z, 128, 1280, bias=bias, config=cfg),
                                        monkeypatch)
    assert rel_err(ordered, x.double() @ w64 + bias.double()) < 1e-2
    assert torch.equal(ordered, atomic)


@pytest.mark.parametrize("bits,dtype", [(4, torch.bfloat16), (8, torch.bfloat16), (8, torch.float16)])
def test_dequant_kernel_is_exactly_the_reference_rounding(bits, dtype):
    K, N = 320, 64
    qt, s, z, w64, q = rand_weight(K, N, 64, dtype, bits)
    w = dequantize_tiled(qt, s, z, 64, K, dtype, bits=bits)
    g = torch.arange(K) // 64
    expect = ((q.float() - z.float()[g]) * s.float()[g]).to(dtype).t()
    assert torch.equal(w, expect)


def test_cpu_tensors_take_the_reference_and_bad_shapes_fail_clearly():
    qt, s, z, w64, _ = rand_weight(256, 32, 128)
    x = torch.randn(3, 256, generator=GEN).bfloat16()
    assert torch.equal(w4a16_tiled_gemm(x, qt, s, z, 128, 256), w4a16_tiled_ref(x, qt, s, z, 128, 256))
    with pytest.raises(ValueError, match="bf16/fp16"):
        w4a16_tiled_triton(x.float(), qt, s, z, 128, 256)
    with pytest.raises(ValueError, match="qtile"):
        w4a16_tiled_triton(x, qt[:, :16], s, z, 128, 256)
    with pytest.raises(ValueError, match="qtile"):  # 4-bit words read as 8-bit
        w4a16_tiled_triton(x, qt, s, z, 128, 256, bits=8)
    with pytest.raises(ValueError, match="scales"):
        w4a16_tiled_triton(x, qt, s[:1], z, 128, 256)


def test_quant_linear_serves_a_tiled_weight():
    """The layer's tiled GEMM path gives what its standard path gives (CPU: both references)."""
    from fitllm.quant.layers import QuantLinear

    K, N = 256, 48
    q = torch.randint(0, 16, (K, N), generator=GEN)
    kw = KernelWeight(pack_dim0(q, 4), (torch.rand(2, N, generator=GEN) * 0.02).bfloat16(),
                      torch.randint(0, 16, (2, N)).bfloat16(), 4, 128)
    x = torch.randn(2, 3, K, generator=GEN).bfloat16()
    std = QuantLinear("model.layers.0.mlp.down_proj", K, [N], False, reader=None, dtype=torch.bfloat16, device="cpu")
    std.set_parts([kw])
    assert isinstance(std.parts[0], KernelWeight)  # CPU keeps the standard layout
    tiled = QuantLinear("model.layers.0.mlp.down_proj", K, [N], False, reader=None, dtype=torch.bfloat16, device="cpu")
    tiled.parts = [TiledWeight.from_kernel(kw)]
    assert torch.equal(tiled(x), std(x))


def test_act_order_weight_is_served_tiled_through_sorted_rows():
    """An act-order (g_idx) weight with its input rows sorted by group needs no g_idx: stored tiled
    with that order, the layer gathers x to match and computes what the g_idx weight computes."""
    from fitllm.quant.layers import QuantLinear

    K, N, gs = 384, 40, 128
    kw = act_order_weight(K, N, gs)
    g_idx = kw.g_idx
    grouped = kw.grouped_by_permutation()
    perm = grouped.perm
    assert grouped.g_idx is None and sorted(perm.tolist()) == list(range(K))
    stored = KernelWeight(grouped.qweight, grouped.scales, grouped.zeros, 4, gs)  # the same rows, perm dropped
    assert torch.equal(stored.dequantize(), kw.dequantize()[:, perm.long()])
    assert torch.equal(grouped.dequantize(), kw.dequantize())  # with its perm: in the input's order
    tw = TiledWeight.from_kernel(grouped)
    assert tw.perm is perm and torch.equal(tw.dequantize(), kw.dequantize())
    layer = QuantLinear("model.layers.0.mlp.down_proj", K, [N], False, reader=None, dtype=torch.bfloat16, device="cpu")
    layer.parts = [tw]
    x = torch.randn(2, 3, K, generator=GEN).bfloat16()
    assert rel_err(layer(x), x.double() @ kw.dequantize(torch.float64).t()) < 1e-2
    # groups in any order sort; groups that are not group_size rows each stay on g_idx
    descending = KernelWeight(kw.qweight, kw.scales, kw.zeros, 4, gs, torch.sort(g_idx).values.flip(0).contiguous())
    assert descending.grouped_by_permutation() is not None
    ragged = g_idx.clone()
    ragged[ragged == 0] = 1
    assert KernelWeight(kw.qweight, kw.scales, kw.zeros, 4, gs, ragged).grouped_by_permutation() is None
    assert KernelWeight(kw.qweight, kw.scales, kw.zeros, 4, gs).grouped_by_permutation() is None


def test_act_order_8bit_weight_is_served_through_sorted_rows():
    """8-bit act-order weights on the GPU form (layers.gpu_form): tiled without g_idx, rows sorted
    by group, perm kept; dequantized in the input's order, through an output permutation too (the
    MLP fold); the layer computes what the g_idx weight computes, from x as it is or from x its
    producer wrote in the rows' order (Gathered)."""
    from fitllm.kernels._utils import Gathered
    from fitllm.quant.layers import QuantLinear, gpu_form

    K, N, gs = 256, 24, 64
    kw = act_order_weight(K, N, gs, bits=8)
    sw = gpu_form(kw, torch.bfloat16)
    assert isinstance(sw, TiledWeight) and sw.bits == 8 and sw.g_idx is None and sw.perm is not None
    assert torch.equal(sw.dequantize(), kw.dequantize())
    idx = torch.randperm(N, generator=GEN)
    assert torch.equal(sw.permute_outputs(idx).dequantize(), kw.dequantize()[idx])
    layer = QuantLinear("model.layers.0.mlp.down_proj", K, [N], False, reader=None, dtype=torch.bfloat16, device="cpu")
    layer.parts = [sw]
    assert layer.input_perm() is sw.perm
    x = torch.randn(3, K, generator=GEN).bfloat16()
    want = x.double() @ kw.dequantize(torch.float64).t()
    assert rel_err(layer(x), want) < 1e-2
    assert torch.equal(layer(Gathered(x[:, sw.perm.long()], sw.perm)), layer(x))
    with pytest.raises(ValueError, match="gathered for another weight"):
        layer(Gathered(x, sw.perm.clone()))


# --------------------------------------------------------------------------- codegen

def _sass_loop(kernel, consts, warps, stages, x_type="*bf16", types=None, dump=None):
    """Report (registers, spills, main-loop instruction histogram) of a kernel compiled offline for
    sm_90 (benchmarks/sass_offline.py); `types` defaults to the GEMMs' pointers, `dump` a folder that
    gets the SASS (kernel.sass)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "sass_offline.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    types = types or (f"x_ptr={x_type},q_ptr=*i32,s_ptr=*bf16,z_ptr=*bf16,bias_ptr=*bf16,y_ptr=*bf16,"
                      "ws_ptr=*fp32,cnt_ptr=*i32")
    p = subprocess.run([sys.executable, str(script), kernel, types, consts, "--warps", str(warps), "--stages",
                        str(stages), "--json"] + (["--dump", str(dump)] if dump else []),
                       capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0 and "ptxas" in p.stderr and "not found" in p.stderr:
        pytest.skip("triton's ptxas is not available here")
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_tensor_core_path_keeps_weights_out_of_shared_memory():
    """The layout's point, checked where it is decided: compiled offline for sm_90 (triton's own
    ptxas, no GPU needed), the main loop of the table's tensor-core configs has no ldmatrix and
    no shared-memory store of weights: the unpacked registers are the wgmma operand. A layout
    change that lets Triton insert a shared-memory round trip fails this (it did before the load
    trick; a weight tile through shared memory is 100+ stores a tile). Where a warp holds two row
    blocks (BN 128 at 4 warps) Triton moves the group's zero and scale rows between layouts
    through shared memory: one store each a tile, allowed."""
    for consts, warps in (("BM=16,BN=64,ROW_WARPS=4,CHUNK=128,GROUP_SIZE=128,SCALE_IN_W=False", 4),
                          ("BM=64,BN=128,ROW_WARPS=8,CHUNK=64,GROUP_SIZE=64,SCALE_IN_W=False", 8),
                          ("BM=64,BN=128,ROW_WARPS=4,CHUNK=128,GROUP_SIZE=128,SCALE_IN_W=False", 4),  # gate_up, M <= 64
                          ("BM=128,BN=256,ROW_WARPS=8,CHUNK=128,GROUP_SIZE=128,SCALE_IN_W=True", 8)):  # M <= 256
        consts += ",HAS_BIAS=False,USE_WS=True,F16=False,ASM=True,UPCAST=False"
        loop = _sass_loop("fitllm.kernels.w4a16_tiled:_w4a16_tiled_kernel", consts, warps, 3)["loop_hist"]
        assert loop.get("HGMMA", 0) >= 8, loop  # the main loop is the wgmma loop
        assert loop.get("STS", 0) <= (2 if "BN=128,ROW_WARPS=4" in consts else 0), loop
        assert not any(loop.get(op, 0) for op in ("STSM", "LDSM")), loop
    # 8-bit weights (bf16 through fp32): the same operand layout, the M <= 16 and M <= 256 tiles
    for consts, warps in (("BM=16,BN=64,ROW_WARPS=4,CHUNK=128,GROUP_SIZE=128,SCALE_IN_W=False", 4),
                          ("BM=128,BN=128,ROW_WARPS=8,CHUNK=128,GROUP_SIZE=128,SCALE_IN_W=True", 8)):
        consts += ",HAS_BIAS=False,USE_WS=True,F16=False,ASM=True,UPCAST=False,BITS=8"
        loop = _sass_loop("fitllm.kernels.w4a16_tiled:_w4a16_tiled_kernel", consts, warps, 3)["loop_hist"]
        assert loop.get("HGMMA", 0) >= 8 and loop.get("F2FP", 0) >= 32, loop  # one packing convert a pair
        assert not any(loop.get(op, 0) for op in ("STS", "STSM", "LDSM")), loop


def test_batch1_gemv_keeps_four_programs_of_256_threads_per_sm_and_its_loads_up_front():
    """The M = 1 table row (BN 128, 1 tile a step, 8 warps, ~4 waves) was tuned at 4 resident
    programs per SM, i.e. at most 64 registers a thread. A change that crosses 64 halves the programs
    per SM without an error anywhere (a 100-register variant lost 29 %, RESULTS.md sixth session), so
    it fails here first. The loop must also issue every load of its tile before the tile's math: with
    the scale loads unmasked, ptxas moved some loads behind the math and the GEMV lost 2-5 % (twelfth
    session)."""
    consts = ("GROUP_SIZE=128,HAS_BIAS=False,USE_WS=True,BM=1,BN=128,UNROLL=1,F16=False,ASM=True,EVEN_K=True,"
              "EVEN_N=True,PDL=True")
    r = _sass_loop("fitllm.kernels.w4a16_tiled:_tiled_gemv_kernel", consts, 8, 1, x_type="*i32")
    assert r["spills"] == 0 and r["regs"] <= 64, r
    ops = r["loop_ops"]
    assert ops.count("LDG") >= 20, r  # the loop found is the weight-streaming one (words, scales, x)
    last_load = max(i for i, op in enumerate(ops) if op == "LDG")
    assert last_load < ops.index("HFMA2"), ops


def test_gemv_read_floor_reads_every_word_once():
    """benchmarks/gemv_tiled_explore.read_floor is what the batch-1 GEMV is measured against (README: the
    GEMVs at 85 % of it on an H100). Its programs each XOR the words they read, 4 loads a thread a step;
    together they must cover every word, scale and zero exactly once, tails included, or the floor
    times less (or more) than the linear's bytes. The same for read_words (one buffer, layer_floor)."""
    from functools import reduce
    from operator import xor

    from benchmarks.gemv_tiled_explore import read_floor, read_words

    g = torch.Generator().manual_seed(3)
    w = dict(qtile=torch.randint(-2**31, 2**31 - 1, (640, 40), dtype=torch.int32, generator=g),  # 3+ steps
             scales=torch.randn(5, 320, generator=g).to(torch.bfloat16),
             zeros=torch.randn(5, 322, generator=g).to(torch.bfloat16))  # an odd count: a partial last step
    out = torch.zeros(2, dtype=torch.int32)  # two programs of 4 x 1024 words a step
    read_floor(w, out)
    every = torch.cat([w["qtile"].view(-1), w["scales"].view(torch.int32).view(-1),
                       w["zeros"].view(torch.int32).view(-1)])
    assert reduce(xor, out.tolist()) == reduce(xor, every.tolist())
    one = torch.zeros(3, dtype=torch.int32)  # the layer floor's one-buffer launch (layer_floor), 3 programs
    read_words(every, one)
    assert reduce(xor, one.tolist()) == reduce(xor, every.tolist())


@pytest.mark.parametrize("kernel,types,consts,warps", [
    ("_fused_triton:rms_norm_kernel", "x_ptr=*fp32,r_ptr=*bf16,w_ptr=*bf16,out_ptr=*bf16,h_ptr=*bf16,s_ptr=*fp32,eps=fp32",
     "HAS_RES=True,X_SUM=True,RNE=False,RNE_OUT=False,BLOCK_N=4096,PDL=True", 8),
    ("_fused_triton:silu_mul_kernel", "x_ptr=*fp32,out_ptr=*bf16,s_ptr=*fp32", "X_SUM=True,RNE=False,BLOCK=1024,PDL=True",
     4),
    ("paged_attention:_rope_write_kernel", "Q=*fp32,K=*fp32,V=*fp32,QO=*bf16,COS=*fp32,SIN=*fp32,KC=*bf16,VC=*bf16,"
     "SLOTS=*i64", "H=8,G=4,GP=4,D=128,BH=64,RNE=False,RNE_C=False,X_SUM=True,PDL=True", 1),
], ids=["rms_norm", "silu_mul", "rope_cache_write"])
def test_pending_sum_consumers_zero_only_words_every_thread_has_read(kernel, types, consts, warps, tmp_path):
    """A consumer of a PendingSum loads the sum, then zeroes it; the compiler stores the zeros in
    another register layout than the load's, so unless a CTA barrier separates the two, a thread can
    zero words that another thread has not read (H200: consumers wrong at random by up to 47 %,
    benchmarks/defer_check.py, thirteenth session). Compiled offline for sm_90: every zero store
    (STG of RZ) comes after a BAR.SYNC that comes after every load."""
    _sass_loop(f"fitllm.kernels.{kernel}", consts, warps, 1, types=types, dump=tmp_path)
    sass = [line for line in (tmp_path / "kernel.sass").read_text().splitlines() if "/*" in line]
    zero_stores = [i for i, line in enumerate(sass) if "STG" in line and line.rstrip(" ;").endswith("RZ")]
    assert zero_stores, "no zero store found: the check no longer matches the code"
    first_zero = zero_stores[0]
    loads = [i for i, line in enumerate(sass[:first_zero]) if "LDG" in line]
    assert loads, "the sum's loads must come before its zero stores"
    assert any("BAR.SYNC" in line for line in sass[loads[-1]:first_zero]), "\n".join(sass[loads[0]:first_zero + 1])


def test_warp_specialised_kernel_compiles_to_pipelined_wgmma():
    """fitllm.kernels.w4a16_ws, which no interpreter can run, compiled for sm_90 as every ws row of the
    sm90 4- and 8-bit tables launches it (tests/ws_codegen.py): it fits the H100 / H200's 232448 bytes of shared
    memory, does not spill, has its wgmma (2 consumers x 2 copies of the tile step x 8, twice over for 256-row
    programs), and ptxas does not serialise them. A zero-filled accumulator on a zero-trip path made ptxas wait
    for every wgmma (advisory C7515, one full wait per wgmma) until tile 0 was peeled off the loop."""
    pytest.importorskip("triton.experimental.gluon")
    rows = offline_script_rows("ws_codegen.py")
    assert {(r["bits"], r["BM"], r["stages"], r["rows"]) for r in rows} >= {
        (4, 128, 3, 128), (4, 256, 3, 128), (8, 64, 4, 128), (8, 256, 2, 128), (4, 16, 4, 256), (4, 64, 4, 256)}, rows
    for r in rows:
        assert r["shared"] <= 232448 and r["spills"] == 0, r
        assert r["hgmma"] == 32 * r["rows"] // 128 and r["full_waits"] <= 4 and not r["advisories"], r
        # 8-bit codes under bf16 take the fp32 route (the byte under 2**23 by a PRMT, 2 a pair and tile
        # step), the others one LOP3 a pair
        assert (r["prmt"] >= 256) == (r["bits"] == 8 and not r["f16"]), r


def test_warp_specialised_kernel_takes_only_the_shapes_it_was_built_for():
    """Whole programs of weight rows (128, or 256), one group per K tile, 16-bit x with 16-byte-aligned rows
    (TMA); everything else stays on the Triton kernels. Off sm90 (here: CPU) nothing is taken."""
    from fitllm.kernels.w4a16_ws import ws_shape_ok, ws_supported

    ok = dict(N=4096, group_size=128, K=4096, dtype=torch.bfloat16, row_pitch_bytes=8192, address=0)
    assert ws_shape_ok(**ok)
    assert ws_shape_ok(**dict(ok, group_size=4096)) and ws_shape_ok(**dict(ok, group_size=256, dtype=torch.float16))
    assert ws_shape_ok(**dict(ok, K=576, group_size=576, row_pitch_bytes=1152))  # per-channel, K padded to 640
    assert ws_shape_ok(**dict(ok, rows=256)) and ws_shape_ok(**dict(ok, N=4224))  # 256-row programs: N % 256
    assert not ws_shape_ok(**dict(ok, N=4224, rows=256))
    for bad in (dict(N=1000), dict(group_size=64), dict(dtype=torch.float32), dict(row_pitch_bytes=8200),
                dict(address=8)):
        assert not ws_shape_ok(**dict(ok, **bad)), bad
    assert not ws_supported(torch.zeros(512, 4096, dtype=torch.bfloat16), 4096, 128, 4096)


def first_step_taker(monkeypatch, arch):
    """The tiled launcher as an `arch` card runs it, stopped at its first step: taken(M, K, weight, gs,
    bits) says which path a GEMM of M tokens takes (gemv, tiled, ws or dequant) without running it."""
    from fitllm.kernels import w4a16_tiled as wt
    from fitllm.kernels import w4a16_ws

    class Took(Exception):
        pass

    def stop(path):
        def raiser(*a, **k):
            raise Took(path)
        return raiser

    class Grid:
        def __getitem__(self, grid):
            return stop("tiled")

    monkeypatch.setattr(wt, "gpu_arch", lambda dev: arch)
    monkeypatch.setattr(w4a16_ws, "ws_supported", lambda x, N, gs, K, rows=128: arch == "sm90" and w4a16_ws.ws_shape_ok(
        N, gs, K, x.dtype, x.stride(0) * x.element_size(), 0, rows))
    monkeypatch.setattr(w4a16_ws, "w4a16_ws_triton", stop("ws"))
    monkeypatch.setattr(wt, "dequantize_tiled", stop("dequant"))
    monkeypatch.setattr(wt, "_launch_gemv", stop("gemv"))
    monkeypatch.setattr(wt, "_w4a16_tiled_kernel", Grid())

    def taken(M, K, weight, gs, bits):
        with pytest.raises(Took) as took:
            w4a16_tiled_triton(torch.zeros(M, K, dtype=torch.bfloat16), *weight[:3], gs, K, bits=bits)
        return took.value.args[0]
    return taken


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("arch,N,K,gs", [("sm90", 256, 256, 128), ("sm90", 200, 256, 128), ("sm90", 256, 256, 64),
                                         ("sm89", 256, 256, 128), ("cpu", 256, 256, 128)])
def test_dequant_from_tokens_is_where_the_launcher_dequantizes(arch, N, K, gs, bits, monkeypatch):
    """fitllm.budget reserves the bf16 copy from dequant_from_tokens(...) tokens on; the launcher must
    take the dequant path exactly from there (checked by stopping each path at its first step), and
    below it on Hopper the warp-specialised kernel where the shapes allow, for 4- and 8-bit weights."""
    from fitllm.kernels.w4a16_tiled import dequant_from_tokens

    taken = first_step_taker(monkeypatch, arch)
    weight = rand_weight(K, N, gs, bits=bits)
    first = dequant_from_tokens(arch, N, K, gs, bits)

    def path(M):
        return taken(M, K, weight, gs, bits)

    assert first < 1 << 20
    assert path(first) == "dequant" and path(first + 1) == "dequant" and path(first - 1) != "dequant"
    ws_takes_it = arch == "sm90" and N % 128 == 0 and gs % 128 == 0
    assert (path(300) == "ws") == ws_takes_it
    assert first == ({4: 3073, 8: 2049}[bits] if ws_takes_it else 257 if arch == "sm90" else 65)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_widest_weights_take_the_ws_kernel_where_the_table_says(bits, monkeypatch):
    """On Hopper a weight wider than 16384 (Llama's gate|up) runs the warp-specialised kernel from M = 2 in
    256-row programs where N is a multiple of 256 (thirty-fifth session; 8-bit from M = 1, thirty-sixth, where
    4-bit keeps the GEMV); else 8-bit weights take 128-row programs from M = 33 (the tensor-core tile is 19 µs
    slower there, thirty-third session) and 4-bit ones the tile. Narrower weights keep the tile up to M = 64
    (8-bit: 128)."""
    taken = first_step_taker(monkeypatch, "sm90")
    K = 128
    cases = {8: ((16640, {1: "ws", 2: "ws", 16: "ws", 32: "ws", 33: "ws", 64: "ws", 65: "ws"}),
                 (16512, {1: "tiled", 2: "tiled", 32: "tiled", 33: "ws", 64: "ws", 65: "ws"}),  # 128-row from 33
                 (4096, {32: "tiled", 33: "tiled", 64: "tiled", 129: "ws"})),
             4: ((16640, {1: "gemv", 2: "ws", 8: "ws", 16: "ws", 32: "ws", 64: "ws", 65: "ws"}),
                 (16512, {2: "tiled", 33: "tiled", 64: "tiled", 65: "ws"}),
                 (4096, {2: "tiled", 64: "tiled", 65: "tiled", 129: "ws"}))}
    for N, expect in cases[bits]:
        qtile = torch.zeros(N, K // 128 * words_per_tile(bits), dtype=torch.int32)  # what is in it never runs
        weight = (qtile, torch.ones(1, N, dtype=torch.bfloat16), torch.zeros(1, N, dtype=torch.bfloat16))
        assert {M: taken(M, K, weight, 128, bits) for M in expect} == expect, N
    # a refused ws config falls through its chain: 256-row programs, then 128-row ones, then the tile
    from fitllm.kernels.w4a16_tiled import _tiled, _unless_ws_refuses, _ws

    tile = _tiled(64, 64, 4, 3, waves=2)
    chain = _ws(64, 3, _ws(64, 4, tile), rows=256)
    assert _unless_ws_refuses(chain, lambda rows: True) is chain
    assert _unless_ws_refuses(chain, lambda rows: rows == 128) is chain["fallback"]
    assert _unless_ws_refuses(chain, lambda rows: False) is tile
