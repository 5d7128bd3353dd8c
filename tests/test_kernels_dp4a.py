"""The batch-1 W4A16 GEMV on dp4a (fitllm/kernels/w4a16_dp4a.py): x as 16-bit integers (X16) against
its documented layout and against x itself, the producers that write it (fused RMSNorm, SiLU·mul), and
the kernel under TRITON_INTERPRET=1 (set by conftest.py) against its exact integer math and against a
float64 oracle of the dequantized weights."""

import pytest
import torch

pytest.importorskip("triton")

from fitllm.kernels import fused
from fitllm.kernels import w4a16_dp4a as dp
from fitllm.kernels._utils import X16, PendingSum, X16Input, capability, splitk_workspace

from kernel_checks import GEN, rel_err  # noqa: E402
from test_kernels_tiled import rand_weight  # noqa: E402


def rand_x(K, outlier=True, rows=1):
    x = torch.randn(rows, K, generator=GEN).to(torch.bfloat16)
    if outlier:
        x[0, 3] = 40.0  # one tile's step is then ~100x another's
    return x


def same_x16(a: X16, b: X16) -> bool:
    return (torch.equal(a.codes, b.codes) and torch.equal(a.stats, b.stats) and a.K == b.K
            and a.dtype == b.dtype)


def clean_workspace() -> bool:
    return splitk_workspace(torch.device("cpu"), 1, 1)[0].abs().max() == 0


@pytest.mark.parametrize("K", [128, 384, 200])
def test_x16_layout_and_rounding(K):
    x = rand_x(K, rows=2)
    x16 = dp.quantize_x16_ref(x)
    T = -(-K // 128)
    assert x16.codes.shape == (2, T, 4, 16) and x16.stats.shape == (2, T, 2) and x16.shape == (2, K)
    step, total = x16.stats[..., 0], x16.stats[..., 1]
    v = dp.unpack_x16(x16).view(2, T, 128)
    assert v.abs().max() <= dp.TOP
    assert torch.equal(v.sum(-1).float(), total)
    xp = torch.nn.functional.pad(x.float(), (0, T * 128 - K)).view(2, T, 128)
    # half a step
    assert ((xp - v * step[..., None]).abs() <= step[..., None] * 0.5).all()
    # the step is a power of two (x / step exact: the same codes with and without FMA contraction)
    assert torch.equal(torch.frexp(step).mantissa, torch.full_like(step, 0.5))
    assert (v.abs().amax(-1) > dp.TOP // 2).all()  # each tile's largest |x| spans at least half the range
    # the documented bytes: position p = 4c + t holds word r = c + 4t; byte j of entry 0 (hi, low
    # nibbles) is k = 2r, 64 + 2r, 2r + 1, 65 + 2r; entry 1 the same k + 32; entries 2, 3 lo
    hi = torch.floor((v.double() + 128) / dp.HALF).int()
    lo = v - dp.HALF * hi
    assert hi.abs().max() <= 127 and lo.min() >= -128 and lo.max() <= 127
    w = x16.codes[0, 0].to(torch.int64) & 0xFFFFFFFF
    for p in (0, 5, 15):
        r = p // 4 + 4 * (p % 4)
        for e, half in ((0, hi), (1, hi), (2, lo), (3, lo)):
            for j, k in enumerate((2 * r, 64 + 2 * r, 2 * r + 1, 65 + 2 * r)):
                byte = int(w[e, p] >> (8 * j)) & 255
                assert byte - 256 * (byte > 127) == int(half[0, 0, k + 32 * (e % 2)])


@pytest.mark.parametrize("K", [256, 200])
def test_triton_quantizer_is_the_reference_bit_for_bit(K):
    x = rand_x(K, rows=2)
    x[1] = 0  # an all-zero row: the smallest step, codes 0
    assert same_x16(dp.quantize_x16(x), dp.quantize_x16_ref(x))


@pytest.mark.parametrize("K,N,gs,BN,waves", [(256, 128, 128, 64, 0), (384, 200, 128, 64, 4.0),
                                             (256, 64, 256, 32, 2.0), (200, 96, 128, 32, 4.0),
                                             (256, 96, 1 << 20, 32, 4.0)])
def test_gemv_matches_its_integer_math_and_float64(K, N, gs, BN, waves):
    qt, s, z, w64, _ = rand_weight(K, N, min(gs, K))
    x = rand_x(K)
    x16 = dp.quantize_x16_ref(x)
    y = torch.full((1, N), float("nan"), dtype=torch.bfloat16)
    dp.dp4a_gemv(x16, qt, s, z, gs, out=y, config=dict(BN=BN, num_warps=2, waves=waves, wide=None))
    assert rel_err(y, dp.w4a16_dp4a_ref(x16, qt, s, z, gs)) < 4e-3  # the output's bf16 rounding
    assert rel_err(y, x.double() @ w64) < 1e-2
    assert clean_workspace()


def test_bias_a_deferred_sum_and_one_row_only():
    K, N = 256, 128
    qt, s, z, w64, _ = rand_weight(K, N, 128)
    x, bias = rand_x(K, outlier=False), torch.randn(N, generator=GEN).to(torch.bfloat16)
    cfg = dict(BN=32, num_warps=2, waves=4.0)
    x16 = dp.quantize_x16_ref(x)
    y = dp.dp4a_gemv(x16, qt, s, z, 128, bias=bias, config=cfg)
    assert y.dtype == torch.bfloat16 and rel_err(y, x.double() @ w64 + bias.double()) < 1e-2
    pending = dp.dp4a_gemv(x16, qt, s, z, 128, defer=True, config=cfg)
    assert isinstance(pending, PendingSum)
    assert rel_err(pending.materialize(), x.double() @ w64) < 1e-2
    assert clean_workspace()
    with pytest.raises(ValueError, match="one row"):
        dp.dp4a_gemv(dp.quantize_x16_ref(x.repeat(2, 1)), qt, s, z, 128)


@pytest.mark.parametrize("N", [256, 576])
def test_rms_norm_hands_over_x16_of_its_rounded_row(N):
    """With quant=X16Input, one row comes as X16, bit for bit the reference quantizer's of the row the
    norm would have returned; several rows come as they are."""
    x, r = rand_x(N), rand_x(N, outlier=False)
    w = (torch.rand(N, generator=GEN) + 0.5).to(torch.bfloat16)
    out, h = fused.rms_norm_triton(x, w, 1e-6, r, quant=X16Input())
    plain, h_plain = fused.rms_norm_triton(x, w, 1e-6, r)
    assert isinstance(out, X16) and torch.equal(h, h_plain)
    assert same_x16(out, dp.quantize_x16_ref(plain))
    assert same_x16(fused.rms_norm_triton(x, w, 1e-6, quant=X16Input()),
                    dp.quantize_x16_ref(fused.rms_norm_triton(x, w, 1e-6)))
    two = fused.rms_norm_triton(x.repeat(2, 1), w, 1e-6, quant=X16Input())
    assert torch.is_tensor(two) and torch.equal(two, fused.rms_norm_triton(x.repeat(2, 1), w, 1e-6))


@pytest.mark.parametrize("I", [384, 1536])  # one program; two (blocks of 1024: X16 needs a tile's max only)
def test_silu_mul_hands_over_x16_and_takes_a_pending_sum(I):
    gate_up = rand_x(2 * I, outlier=False) * 2
    out = fused.silu_mul_triton(gate_up, quant=X16Input())
    assert isinstance(out, X16) and same_x16(out, dp.quantize_x16_ref(fused.silu_mul_triton(gate_up)))
    pending = fused.silu_mul_triton(PendingSum.holding(gate_up.float()), quant=X16Input())
    assert same_x16(pending, out) and clean_workspace()


def test_a_tiled_layer_asks_for_x16_where_dp4a_runs(monkeypatch):
    """FusedLinear.input_quant: X16Input for a 4-bit tiled weight on a dp4a card, by default and with
    FITLLM_W4_DP4A=1 (not for 8 bits, an act-order gather, groups of 64, or with FITLLM_W4_DP4A=0),
    and the layer serves an X16."""
    from fitllm.quant.formats.packing import TiledWeight
    from fitllm.quant.layers import QuantLinear

    K, N = 256, 128
    qt, s, z, w64, _ = rand_weight(K, N, 128)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    capability.cache_clear()  # (asked once a card: cleared wherever the fake card changes, and at the end)
    monkeypatch.delenv("FITLLM_W4_DP4A", raising=False)
    assert dp.dp4a_wanted(4, 128, K, None, cuda)  # on by default
    monkeypatch.setenv("FITLLM_W4_DP4A", "1")
    assert dp.dp4a_wanted(4, 128, K, None, cuda)
    assert not dp.dp4a_wanted(8, 128, K, None, cuda) and not dp.dp4a_wanted(4, 64, K, None, cuda)
    assert not dp.dp4a_wanted(4, 128, K, torch.arange(K), cuda) and not dp.dp4a_wanted(4, 128, K, None, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (6, 0))
    capability.cache_clear()
    assert not dp.dp4a_wanted(4, 128, K, None, cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    capability.cache_clear()
    monkeypatch.setenv("FITLLM_W4_DP4A", "0")
    assert not dp.dp4a_wanted(4, 128, K, None, cuda)
    capability.cache_clear()
    layer = QuantLinear.__new__(QuantLinear)
    torch.nn.Module.__init__(layer)
    layer.parts, layer.bias, layer.fp8_mode, layer.prefix = [TiledWeight(qt, s, z, 128, K)], None, "w8a8", "t"
    monkeypatch.setattr(dp, "dp4a_wanted", lambda bits, gs, k, perm, device: bits == 4 and gs == 128)
    assert layer.input_quant() == X16Input()
    x = rand_x(K)
    y = layer(dp.quantize_x16_ref(x))
    assert y.shape == (1, N) and rel_err(y, x.double() @ w64) < 1e-2
    assert isinstance(layer(dp.quantize_x16_ref(x), defer=True), PendingSum)
    splitk_workspace(torch.device("cpu"), 1, 1)[0].zero_()


def test_pow2_step_is_the_smallest_power_of_two_at_or_above_amax_over_top():
    k = torch.tensor([-20.0, 0.0, 3.0])
    at = dp.TOP * torch.exp2(k)  # amax / TOP exactly a power of two: that power
    above = torch.nextafter(at, torch.full_like(at, float("inf")))  # one ulp more: the next power
    amax = torch.cat([at, above, torch.tensor([0.0, 1e-40])])
    assert torch.equal(dp._pow2_step(amax), torch.cat([torch.exp2(k), torch.exp2(k + 1),
                                                       torch.full((2,), dp.TINY)]))


def test_the_decoder_hands_x16_to_three_gemvs_a_layer(monkeypatch):
    """A batch-1 step of a 4-bit tiled model (the interpreter's Triton kernels): with dp4a wanted, the
    input RMSNorm, the post-attention RMSNorm and SiLU·mul hand X16 to qkv_proj, gate_up_proj and down_proj
    (three dp4a GEMVs a layer; o_proj takes the attention's output as it is), and the step's output is the
    16-bit GEMVs' within their roundings."""
    from fitllm.models.config import ModelConfig
    from fitllm.models.kv_cache import NoCacheContext
    from fitllm.quant.formats.packing import KernelWeight, TiledWeight, pack_dim0
    from test_kernels_fused import quantized_model

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=256, intermediate_size=384,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6)
    model = quantized_model(cfg, lambda K, N: TiledWeight.from_kernel(KernelWeight(
        pack_dim0(torch.randint(0, 16, (K, N), generator=GEN), 4),
        (torch.rand(K // 128, N, generator=GEN) * 0.02 + 0.01).bfloat16(),
        torch.randint(0, 16, (K // 128, N), generator=GEN).bfloat16(), 4, 128)))
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "triton")
    ids, positions = torch.randint(0, 96, (1,), generator=GEN), torch.arange(1)
    calls = []  # (QuantLinear imports both functions from the module at each call)
    gemv = dp.dp4a_gemv
    monkeypatch.setattr(dp, "dp4a_gemv", lambda x16, *a, **k: calls.append(x16.K) or gemv(x16, *a, **k))
    outputs = {}
    for wanted in (False, True):
        monkeypatch.setattr(dp, "dp4a_wanted", lambda bits, gs, K, perm, device, w=wanted: w and bits == 4
                            and perm is None)
        with torch.no_grad():
            outputs[wanted] = model(ids, positions, NoCacheContext([1]))
    assert sorted(calls) == sorted([256, 256, 384] * cfg.num_layers)  # qkv, gate_up (K 256), down (K 384)
    assert torch.isfinite(outputs[True]).all() and rel_err(outputs[True], outputs[False]) < 2e-2
    assert clean_workspace()
