"""Fused RMSNorm(+residual), RoPE and SiLU·mul: Triton under TRITON_INTERPRET=1 (set by conftest.py)
against the torch references, and the decoder wired through them (Triton path == torch path ==
unfused layer math)."""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from fitllm.kernels import fused
from fitllm.models.config import ModelConfig
from fitllm.models.decoder import CausalLM
from fitllm.models.kv_cache import NoCacheContext

from kernel_checks import act_order_weight

GEN = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh inputs every run
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Every output buffer starts as NaN (integers: -7): an element the kernel does not write shows up."""
    monkeypatch.setattr(fused, "_empty", lambda shape, dtype, device: torch.full(
        shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device))


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=GEN) * scale).to(dtype)


def assert_close(got, ref, rounds_through=None):
    """fp32: reduction order and exp differ in the last bits. bf16: the kernels round where the
    reference rounds (RNE emulated in the interpreter), so at most a rare one-ulp flip.
    rounds_through=torch.bfloat16: an fp32 output computed from a bf16-rounded intermediate (RMSNorm's
    normalised row), where such a flip shows as one bf16 ulp (about 1 seed in 300 did)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.isfinite(got).all(), "output not fully written (NaN poison survived)"
    if got.dtype == torch.float32 and rounds_through is None:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -7, atol=1e-3)
        assert (got != ref).float().mean() < 0.01


# --------------------------------------------------------------------------- rms_norm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N", [(1, 576), (3, 576), (5, 64), (2, 4096), (7, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, T, N, with_residual):
    x, w = randn(T, N, dtype=dtype, scale=3.0), (1 + randn(N) * 0.1).to(dtype)
    residual = randn(T, N, dtype=dtype, scale=3.0) if with_residual else None
    got = fused.rms_norm_triton(x, w, 1e-6, residual)
    ref = fused.rms_norm_ref(x, w, 1e-6, residual)
    if with_residual:
        assert torch.equal(got[1], ref[1])  # the new residual is x + residual, rounded as torch rounds
        got, ref = got[0], ref[0]
    assert_close(got, ref)


def test_rms_norm_strided_heads_and_mixed_dtypes():
    """q_norm / k_norm (Qwen3) normalise [T, H, D] views into the qkv output, without a copy."""
    qkv = randn(3, 6 * 32, dtype=torch.bfloat16)
    q = qkv[:, :4 * 32].view(3, 4, 32)
    w = (1 + randn(32) * 0.1).to(torch.bfloat16)
    assert_close(fused.rms_norm_triton(q, w, 1e-6), fused.rms_norm_ref(q, w, 1e-6))
    # fp32 weight on bf16 activations: `weight * h` promotes to fp32, so does the kernel
    w32 = 1 + randn(32) * 0.1
    assert_close(fused.rms_norm_triton(q, w32, 1e-6), fused.rms_norm_ref(q, w32, 1e-6), torch.bfloat16)
    # more leading dims, and a residual that is not contiguous
    x, r = randn(2, 3, 4, 64, dtype=torch.bfloat16), randn(2, 4, 3, 64, dtype=torch.bfloat16).transpose(1, 2)
    w = w32[:1].expand(64)
    got, ref = fused.rms_norm_triton(x, w, 1e-6, r), fused.rms_norm_ref(x, w, 1e-6, r)
    assert torch.equal(got[1], ref[1])
    assert_close(got[0], ref[0], torch.bfloat16)
    # a residual of another dtype promotes in the reference; the kernel defers to it
    x, r = randn(2, 64, dtype=torch.bfloat16), randn(2, 64)
    out, h = fused.rms_norm_triton(x, w, 1e-6, r)
    assert h.dtype == torch.float32 and torch.equal(h, x + r)


def test_gemma_norm_multiplies_in_fp32_as_transformers_does():
    """Gemma's RMSNorm (weights stored less one): the module keeps 1 + w in float32 through the model's
    cast to bf16, and the row times it is taken in float32 and rounded once: the reference is
    transformers' Gemma3RMSNorm bit for bit, the kernel (residual add and a column order included)
    within a rare ulp of it. Llama's order (the row rounded first, 1 + w in bf16) is further off."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from fitllm.models.decoder import RMSNorm

    N = 96
    stored = randn(N, scale=0.3).to(torch.bfloat16)
    theirs = Gemma3RMSNorm(N, eps=1e-6)
    theirs.weight.data = stored.clone()
    ours = RMSNorm(N, 1e-6, offset=1.0)
    ours.load_weight(stored)
    ours = ours.to(torch.bfloat16)
    assert ours.weight.dtype == torch.float32 and torch.equal(ours.stored_weight(torch.bfloat16), stored)
    x, r = randn(5, N, dtype=torch.bfloat16, scale=4.0), randn(5, N, dtype=torch.bfloat16)
    want = theirs(x)
    assert torch.equal(ours(x), want)  # CPU: the torch reference
    llama_order = fused.rms_norm_ref(x, ours.weight.to(torch.bfloat16), 1e-6)
    assert (llama_order != want).any()
    assert_close(fused.rms_norm_triton(x, ours.weight, 1e-6, fp32_product=True), want)
    out, h = fused.rms_norm_triton(x, ours.weight, 1e-6, r, fp32_product=True)
    assert torch.equal(h, x + r)
    assert_close(out, theirs(x + r))
    perm = torch.randperm(N, generator=GEN)
    got = fused.rms_norm_triton(x, ours.weight, 1e-6, perm=perm, fp32_product=True)
    assert_close(got.x, want[:, perm])


# --------------------------------------------------------------------------- rope

def rope_tables(T, half, theta=10000.0):
    pos = torch.randint(0, 4096, (T,), generator=GEN).float()
    inv_freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float32) / half)
    freqs = pos[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,HQ,HK,D,R", [(1, 32, 8, 128, 128), (3, 4, 2, 64, 64), (7, 3, 1, 96, 96), (2, 14, 2, 64, 64),
                                        (3, 6, 2, 128, 96), (2, 4, 4, 64, 32)])  # R < D: partial RoPE
def test_rope_matches_reference_in_place_on_qkv_views(dtype, T, HQ, HK, D, R):
    qkv = randn(T, (HQ + 2 * HK) * D, dtype=dtype, scale=2.0)
    before = qkv.clone()
    q = qkv[:, :HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D:(HQ + HK) * D].view(T, HK, D)
    cos, sin = rope_tables(T, R // 2)
    q_ref, k_ref = fused.apply_rope_ref(q.clone(), k.clone(), cos, sin)
    q_out, k_out = fused.apply_rope_triton(q, k, cos, sin)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(qkv[:, (HQ + HK) * D:], before[:, (HQ + HK) * D:])  # v untouched
    heads = qkv[:, :(HQ + HK) * D].view(T, HQ + HK, D)
    assert torch.equal(heads[..., R:], before[:, :(HQ + HK) * D].view(T, HQ + HK, D)[..., R:])  # past R untouched


def test_rope_reference_is_rotate_half():
    """The reference itself against the textbook formula, in float64 (q = k, so both are checked)."""
    T, H, D = 5, 3, 16
    x = randn(T, H, D)
    cos, sin = rope_tables(T, D // 2)
    q, k = fused.apply_rope_ref(x.clone(), x.clone(), cos, sin)
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double()[:, None], sin.double()[:, None]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    torch.testing.assert_close(q.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(q, k)
    # partial RoPE: the first R dims rotate among themselves (pairs i, i + R/2), the rest pass
    R = 10
    cos, sin = rope_tables(T, R // 2)
    q, _ = fused.apply_rope_ref(x.clone(), x.clone(), cos, sin)
    x1, x2, rest = x.double().split([R // 2, R // 2, D - R], dim=-1)
    c, s = cos.double()[:, None], sin.double()[:, None]
    torch.testing.assert_close(q.double(), torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1),
                               rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- silu_mul

@pytest.mark.parametrize("act", fused.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 1536), (5, 100), (2, 14336), (3, 1)])
def test_silu_mul_matches_reference(dtype, T, I, act):
    gate_up = randn(T, 2 * I, dtype=dtype, scale=4.0)
    got = fused.silu_mul_triton(gate_up, act=act)
    if act == "silu":
        assert_close(got, fused.silu_mul_ref(gate_up, act))
        return
    # torch's fp32 GELU (tanh form) cancels to 0 for gates below about -5, the kernel's sigmoid form
    # does not: the oracle is float64, with the one rounding of the activation the kernel makes
    assert torch.isfinite(got).all() and got.dtype == dtype
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh").to(dtype).double() * up
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -8, atol=1e-5)
    torch.testing.assert_close(got.double(), want, **tol)


def test_silu_mul_reference_is_the_activation_times_up():
    gate_up = randn(4, 2 * 24, scale=4.0)
    g, u = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul_ref(gate_up).double(), g / (1 + torch.exp(-g)) * u,
                               rtol=1e-6, atol=1e-6)
    gelu_tanh = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)))  # Gemma's
    torch.testing.assert_close(fused.silu_mul_ref(gate_up, "gelu_tanh").double(), gelu_tanh * u,
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="activation 'relu'"):
        fused.silu_mul(gate_up, act="relu")


# --------------------------------------------------------------------------- head_affine

def _affine_params(P, D, which):
    gen = {"shift": lambda: randn(P, D), "pre": lambda: randn(P, D).abs() + 0.5,
           "post": lambda: randn(P, D).abs() + 0.5, "add": lambda: randn(P, D)}
    return {k: (gen[k]() if k in which else None) for k in gen}


@pytest.mark.parametrize("rot_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H,P", [(1, 8, 8), (3, 32, 8), (37, 4, 2), (300, 2, 1)])
@pytest.mark.parametrize("which", [("shift", "post"), ("pre", "add"), ("shift", "pre", "post", "add")])
def test_head_affine_matches_reference(rot_dtype, T, H, P, which):
    D = 64
    rot = None if rot_dtype is None else (torch.linalg.qr(randn(D, D))[0]).to(rot_dtype).mT  # a transposed view
    x = randn(T, H + 3, D, dtype=torch.bfloat16, scale=3.0)[:, 1:H + 1]  # a strided view, like a qkv slice
    params = _affine_params(P, D, which)
    out_dtype = torch.float16 if rot_dtype == torch.float16 else torch.float32
    got = fused.head_affine_triton(x, rot, **params, out_dtype=out_dtype)
    ref = fused.head_affine_ref(x, rot, **params, out_dtype=out_dtype)
    assert got.dtype == ref.dtype and torch.isfinite(got).all(), "output not fully written (NaN poison survived)"
    # same operand rounding, fp32 sums in another order
    torch.testing.assert_close(got.float(), ref.float(), rtol=1e-3 if out_dtype == torch.float16 else 1e-5,
                               atol=1e-3 if out_dtype == torch.float16 else 1e-5)


@pytest.mark.parametrize("T,h0", [(1, 6), (20, 4), (3, 7)])
def test_head_affine_split_outputs(T, h0):
    """split=(h0, dtype2): heads below h0 in out_dtype, the rest in dtype2, each exactly what the
    unsplit launch gives in that dtype (q, k and v of a layer in one launch: fp16 q, fp32 k/v)."""
    D, H = 64, 8
    rot = torch.linalg.qr(randn(D, D))[0].to(torch.bfloat16)
    x = randn(T, H + 2, D, dtype=torch.bfloat16, scale=3.0)[:, 2:]
    params = _affine_params(H, D, ("shift", "post"))
    a, b = fused.head_affine_triton(x, rot, **params, out_dtype=torch.float16, split=(h0, torch.float32))
    assert a.shape == (T, h0, D) and b.shape == (T, H - h0, D) and (a.dtype, b.dtype) == (torch.float16, torch.float32)
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), "output not fully written (NaN poison survived)"
    assert torch.equal(a, fused.head_affine_triton(x, rot, **params, out_dtype=torch.float16)[:, :h0])
    assert torch.equal(b, fused.head_affine_triton(x, rot, **params, out_dtype=torch.float32)[:, h0:])
    ra, rb = fused.head_affine_ref(x, rot, **params, out_dtype=torch.float16, split=(h0, torch.float32))
    torch.testing.assert_close(a.float(), ra.float(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(b, rb, rtol=1e-5, atol=1e-5)


# Runtime arguments that follow a step's token count. Triton specialises an integer argument on
# == 1 and on % 16 == 0, so each would compile another variant the first time a step size of the
# other kind comes by: mid-serving, after the warm-up (benchmarks/compile_watch.py caught
# head_affine's T with fp8 and int4 KV: a 1.2 s stall in the first batch, RESULTS.md twentieth session).
STEP_SIZED = {"M", "T"}
# The batch-1..4 GEMVs: their M is one table row of at most 4 rows of x, each size warmed or captured.
SMALL_M_GEMVS = {"_w4a16_gemv_kernel", "_w4a16_gemv_pairs_kernel", "_tiled_gemv_kernel"}


def test_no_kernel_specialises_on_the_step_size():
    import importlib
    import inspect

    from fitllm.kernels import TRITON_MODULES

    checked = []
    for mod in TRITON_MODULES:
        m = importlib.import_module(f"fitllm.kernels.{mod}")
        for name, k in vars(m).items():
            fn = getattr(k, "fn", None)
            if fn is None or fn.__module__ != m.__name__ or not name.endswith("_kernel") or name in SMALL_M_GEMVS:
                continue
            step = STEP_SIZED & {p for p, v in inspect.signature(fn).parameters.items()
                                 if "constexpr" not in str(v.annotation)}
            if step:
                frozen = set(getattr(k, "do_not_specialize", None) or k.kwargs.get("do_not_specialize") or ())
                assert step <= frozen, f"{mod}.{name} specialises on {sorted(step - frozen)}"
                checked.append(name)
    assert "head_affine_kernel" in checked and "_fp8_tma_kernel" in checked and len(checked) >= 6


def test_head_affine_reference_is_the_documented_map():
    """Against the formula in float64, head h using parameter row h // (H // P)."""
    T, H, P, D = 5, 6, 3, 16
    rot = torch.linalg.qr(randn(D, D))[0]
    x = randn(T, H, D)
    params = _affine_params(P, D, ("shift", "pre", "post", "add"))
    got = fused.head_affine_ref(x, rot, **params, out_dtype=torch.float32)
    for h in range(H):
        g = h // (H // P)
        want = ((x[:, h].double() - params["shift"][g].double()) * params["pre"][g].double()) @ rot.double()
        want = want * params["post"][g].double() + params["add"][g].double()
        torch.testing.assert_close(got[:, h].double(), want, rtol=1e-5, atol=1e-5)


def test_head_affine_rejects_bad_parameters():
    x = randn(2, 8, 64)
    with pytest.raises(ValueError, match="head_affine"):
        fused.head_affine_triton(x, None, randn(3, 64), None, None, None, torch.float32)  # 3 does not divide 8
    with pytest.raises(ValueError, match="head_affine"):
        fused.head_affine_triton(x, randn(32, 32), None, None, None, None, torch.float32)
    with pytest.raises(ValueError, match="head_affine"):  # a split past the last head
        fused.head_affine_triton(x, None, None, None, None, None, torch.float32, split=(9, torch.float32))


# --------------------------------------------------------------------------- dispatch and the decoder

def test_dispatch(monkeypatch):
    x, w = randn(3, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "auto")
    assert torch.equal(fused.rms_norm(x, w, 1e-6), fused.rms_norm_ref(x, w, 1e-6))  # CPU -> reference
    monkeypatch.setattr(fused, "rms_norm_triton", None)  # auto must not touch the Triton path on CPU
    assert torch.equal(fused.silu_mul(x), fused.silu_mul_ref(x))
    fused.rms_norm(x, w, 1e-6)
    monkeypatch.undo()
    monkeypatch.setattr(fused, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype))
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "triton")
    assert_close(fused.rms_norm(x, w, 1e-6), fused.rms_norm_ref(x, w, 1e-6))
    with pytest.raises(ValueError):
        fused.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError):
        fused.silu_mul(x[:, :63])


def tiny_config(family):
    extra = dict(qk_norm=True, architecture="Qwen3ForCausalLM") if family == "qwen3" else {}
    cfg = dict(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=64, intermediate_size=160,
               num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6)
    return ModelConfig(**{**cfg, **extra})


def tiny_model(family, dtype):
    torch.manual_seed(0)
    model = CausalLM(tiny_config(family), dtype=dtype)
    with torch.no_grad():  # the model is built to be loaded: give every parameter a value
        for name, p in model.named_parameters():
            if "norm" in name:  # around 1, perturbed so that a wrong norm path cannot hide
                p.copy_(1 + torch.randn_like(p, dtype=torch.float32) * 0.1)
            else:
                p.copy_(torch.randn_like(p, dtype=torch.float32) * (1.0 if "embed" in name else 0.1))
    return model


@torch.no_grad()
def unfused_forward(model, ids, positions, ctx):
    """What the decoder computed before the fused kernels, each residual add on its own; also checks
    DecoderLayer.forward (the layer-by-layer entry point calibration uses) against it."""
    freqs = positions.float()[:, None] * model.inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    x = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        whole = layer(x, cos, sin, ctx)
        x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, ctx)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        assert torch.equal(whole, x)
    return model.model.norm(x)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decoder_fused_paths_agree(family, dtype, monkeypatch):
    model = tiny_model(family, dtype)
    ids = torch.randint(0, 96, (11,), generator=GEN)
    positions = torch.cat([torch.arange(7), torch.arange(4)])
    ctx = NoCacheContext([7, 4])
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "torch")
    with torch.no_grad():
        ref = model(ids, positions, ctx)
    # carrying the residual changes where the adds happen, not what they compute: bit for bit
    assert torch.equal(unfused_forward(model, ids, positions, ctx), ref)
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "triton")
    with torch.no_grad():
        got = model(ids, positions, ctx)
    assert torch.isfinite(got).all()
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def quantized_model(cfg, weight):
    """A bf16 CausalLM of `cfg` with random parameters whose every fused linear is a QuantLinear
    holding weight(K, N) (a TiledWeight, an FP8Weight, ...)."""
    from fitllm.quant.layers import QuantLinear

    torch.manual_seed(0)
    model = CausalLM(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + randn(*p.shape, scale=0.1) if "norm" in name else randn(*p.shape))
    for name, lin in list(model.fused_linears().items()):
        q = QuantLinear(lin.prefix, lin.in_features, lin.out_sizes, False, reader=None, dtype=torch.bfloat16,
                        device="cpu")
        q.parts = [weight(lin.in_features, lin.out_features)]
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, q)
    return model


@pytest.mark.parametrize("tokens", [1, 5])  # the batch-1 GEMV, the tensor-core kernel
@pytest.mark.parametrize("paged", [False, True], ids=["no-cache", "paged-bf16"])
def test_decoder_hands_split_k_sums_to_the_fused_kernels(tokens, paged, monkeypatch):
    """With int4 tiled layers on the Triton path, o_proj, gate_up_proj and down_proj leave their
    split-K sums pending (kernels._utils.PendingSum) and the fused RMSNorm / SiLU·mul take them, and
    over a paged bf16 cache (RoPE in the cache write's launch) so does qkv_proj's: the hidden states
    equal, bit for bit, those of the run where every GEMM finishes its own y (FITLLM_SPLITK_DEFER=0;
    the interpreter adds the splits in the same order both ways), and the shared workspace is zero
    afterwards, so nothing leaks into the next GEMM."""
    from fitllm.kernels import _utils
    from fitllm.kernels import paged_attention as pa
    from fitllm.models.kv_cache import AttentionMetadata, ForwardContext, PagedKVCache
    from fitllm.quant.formats.packing import KernelWeight, TiledWeight, pack_dim0

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=256, intermediate_size=384,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6)
    model = quantized_model(cfg, lambda K, N: TiledWeight.from_kernel(KernelWeight(  # K > 128: split-K GEMMs
        pack_dim0(torch.randint(0, 16, (K, N), generator=GEN), 4),
        (torch.rand(1, N, generator=GEN) * 0.02 + 0.01).bfloat16(), torch.randint(0, 16, (1, N), generator=GEN).bfloat16(),
        4, K)))
    ids = torch.randint(0, 96, (tokens,), generator=GEN)
    positions = torch.arange(tokens)
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "triton")

    def context():  # a fresh cache per run: both runs write the same slots
        if not paged:
            return NoCacheContext([tokens])
        cache = PagedKVCache(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16,
                             device="cpu", kv_dtype="bf16")
        return ForwardContext(cache, AttentionMetadata.build([tokens], [tokens], [[2]], 16, "cpu"))

    taken = []
    for mod, fn in ((fused, "rms_norm"), (fused, "silu_mul"), (pa, "rope_cache_write")):
        orig = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda x, *a, orig=orig, **k: taken.append(isinstance(x, _utils.PendingSum))
                            or orig(x, *a, **k))
    monkeypatch.delenv("FITLLM_SPLITK_DEFER", raising=False)  # the default
    with torch.no_grad():
        got = model(ids, positions, context())
        # after o_proj, gate_up_proj, down_proj of every layer (and qkv_proj over the paged cache)
        assert sum(taken) == (4 if paged else 3) * cfg.num_layers
        ws, cnt = _utils.splitk_workspace(torch.device("cpu"), 0, 0)
        assert (ws == 0).all() and (cnt == 0).all()
        monkeypatch.setenv("FITLLM_SPLITK_DEFER", "0")
        taken.clear()
        ref = model(ids, positions, context())
        assert not any(taken)
    assert torch.isfinite(got).all() and torch.equal(got, ref)


# --------------------------------------------------------------------------- fp8 activations from the producer

def _codes(a):
    """e4m3 codes as bytes (torch.equal on float8 compares values: -0 == 0)."""
    return a.view(torch.uint8)


def _pending(values):
    """values (fp32 [T, N]) as a GEMM's unfinished sum, and the whole split-K workspace it sits in."""
    from fitllm.kernels import _utils

    return _utils.PendingSum.holding(values), _utils.splitk_workspace(values.device, values.numel(), 0)[0]


@pytest.mark.parametrize("producer", ["rms_norm", "rms_norm+residual", "rms_norm+pending", "silu_mul",
                                      "silu_mul+pending", "gelu_tanh"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("T,N", [(1, 576), (3, 100)])
def test_producers_quantize_activations_for_an_fp8_gemm(producer, static, T, N):
    """quant=Fp8Input(...): RMSNorm (+ residual, + a pending split-K sum) and SiLU·mul hand over
    Fp8Activations whose codes and scales equal, bit for bit, what the fp8 GEMM's own quantizer makes
    of their unfused output (dynamic per-token or static scale); the residual stream is unchanged
    and a pending sum's workspace is zero afterwards."""
    from fitllm.kernels._utils import Fp8Activations, Fp8Input
    from fitllm.kernels.fp8 import _quantize_triton

    scale = torch.tensor([0.03]) if static else None
    kind, _, extra = producer.partition("+")
    vals = randn(T, N if kind == "rms_norm" else 2 * N, scale=3.0)
    x = vals.to(torch.bfloat16)
    ws = None
    if kind == "rms_norm":
        w, r = (1 + randn(N) * 0.1).to(torch.bfloat16), randn(T, N, dtype=torch.bfloat16, scale=3.0)
        residual = r if extra else None
        want = fused.rms_norm_triton(x, w, 1e-6, residual)
        if extra == "pending":
            x, ws = _pending(vals)
        got = fused.rms_norm_triton(x, w, 1e-6, residual, Fp8Input(scale))
        if residual is not None:
            assert torch.equal(got[1], want[1])
            got, want = got[0], want[0]
    else:
        act = "gelu_tanh" if kind == "gelu_tanh" else "silu"  # Gemma's activation, or SiLU
        want = fused.silu_mul_triton(x, act=act)
        if extra == "pending":
            x, ws = _pending(vals)
        got = fused.silu_mul_triton(x, Fp8Input(scale), act)
    q, s = _quantize_triton(want, scale)
    assert isinstance(got, Fp8Activations) and got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(_codes(got.q), _codes(q)) and torch.equal(got.scale, s)
    if ws is not None:
        assert (ws == 0).all()


def test_producers_keep_16_bit_outputs_where_they_cannot_quantize(monkeypatch):
    """No Fp8Activations for [T, H, N] rows (q/k norms), a weight whose dtype promotes the output, or
    a SiLU·mul row longer than one program holds: the plain output, as without the request."""
    from fitllm.kernels._utils import Fp8Input

    q = randn(3, 4, 32, dtype=torch.bfloat16)
    w = (1 + randn(32) * 0.1).to(torch.bfloat16)
    assert torch.equal(fused.rms_norm_triton(q, w, 1e-6, quant=Fp8Input()), fused.rms_norm_triton(q, w, 1e-6))
    x, w32 = randn(2, 32, dtype=torch.bfloat16), 1 + randn(32) * 0.1
    assert torch.equal(fused.rms_norm_triton(x, w32, 1e-6, quant=Fp8Input()), fused.rms_norm_triton(x, w32, 1e-6))
    monkeypatch.setattr(fused, "FP8_SILU_MAX_BLOCK", 64)
    g = randn(2, 200, dtype=torch.bfloat16)
    assert torch.equal(fused.silu_mul_triton(g, Fp8Input()), fused.silu_mul_triton(g))
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "torch")  # the references ignore the request
    assert torch.equal(fused.silu_mul(g, Fp8Input()), fused.silu_mul_ref(g))


@pytest.mark.parametrize("tokens", [1, 5])  # the batch-1 GEMV, the tensor-core kernel
def test_decoder_hands_fp8_gemms_their_activations_quantized(tokens, monkeypatch):
    """W8A8 fp8 layers on the Triton path: the input RMSNorm quantizes for qkv_proj, the post-attention
    RMSNorm for gate_up_proj and SiLU·mul for down_proj (3 per layer), and the hidden states equal bit
    for bit those of the run where each GEMM quantizes its own input (FITLLM_FP8_FUSED_QUANT=0)."""
    from fitllm.kernels._utils import Fp8Activations
    from fitllm.quant.layers import QuantLinear
    from fitllm.quant.scheme import FP8Weight

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=128, intermediate_size=192,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6)
    model = quantized_model(cfg, lambda K, N: FP8Weight((randn(N, K) * 2).to(torch.float8_e4m3fn),
                                                        torch.rand(N, generator=GEN) * 0.02 + 0.005))
    ids = torch.randint(0, 96, (tokens,), generator=GEN)
    positions, ctx = torch.arange(tokens), NoCacheContext([tokens])
    quantized = []
    orig = QuantLinear.forward
    monkeypatch.setattr(QuantLinear, "forward", lambda self, x, defer=False: quantized.append(
        isinstance(x, Fp8Activations)) or orig(self, x, defer))
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "triton")
    monkeypatch.delenv("FITLLM_FP8_FUSED_QUANT", raising=False)  # the default
    with torch.no_grad():
        got = model(ids, positions, ctx)
        assert sum(quantized) == 3 * cfg.num_layers
        monkeypatch.setenv("FITLLM_FP8_FUSED_QUANT", "0")
        quantized.clear()
        ref = model(ids, positions, ctx)
        assert not any(quantized)
    assert torch.isfinite(got).all() and torch.equal(got, ref)


# --------------------------------------------------------------------------- greedy_tokens

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [5, 2048, 4099, 9000])
def test_greedy_tokens_matches_torch_argmax(dtype, V):
    """First maximal column (ties across lanes, loop steps and 4096-column chunks), -1 for NaN/inf
    rows; the per-row counters are back at zero afterwards."""
    from fitllm.kernels import _utils

    x = randn(7, V).to(dtype)
    x[1, :] = 3.0  # all tied: column 0
    if V > 4:
        x[2, [V - 1, V // 2, 3]] = 50.0  # tied max in different lanes/steps: the first wins
        x[3, V // 3] = float("nan")
        x[4, V - 1] = float("inf")
        x[5, 0] = float("-inf")
    got = fused.greedy_tokens_triton(x)
    ref = fused.greedy_tokens_ref(x)
    assert got.dtype == torch.int64 and torch.equal(got, ref)
    assert got[1] == 0 and (V <= 4 or (got[2] == min(3, V // 2) and (got[3:6] == -1).all()))
    assert torch.equal(ref[[0, 6]], x[[0, 6]].float().argmax(-1))  # the reference is torch's argmax
    assert (_utils.splitk_workspace(x.device, 0, 0)[1] == 0).all()


@pytest.mark.parametrize("T,K,idx_dtype", [(1, 4096, torch.int32), (3, 1100, torch.int64), (2, 300, torch.int32)])
@pytest.mark.parametrize("rows_from", [fused.GATHER_ROWS_FROM, 0], ids=["scattered-loads", "whole-rows"])
def test_gather_columns_matches_index_select(T, K, idx_dtype, rows_from, monkeypatch):
    """The act-order GEMMs' input gather, by either kernel (whole rows permuted in the SM from
    GATHER_ROWS_FROM elements on): bit-exact x[:, idx] from a strided x, every column written."""
    monkeypatch.setattr(fused, "GATHER_ROWS_FROM", rows_from)
    x = randn(T, K + 5, dtype=torch.bfloat16)[:, 2:K + 2]  # a strided view
    idx = torch.randperm(K).to(idx_dtype)
    got = fused.gather_columns_triton(x, idx)
    assert torch.equal(got, x[:, idx.long()]) and torch.equal(fused.gather_columns_ref(x, idx), got)
    assert torch.equal(fused.gather_columns_triton(x, idx[: K // 2]), x[:, idx[: K // 2].long()])  # fewer columns
    with pytest.raises(ValueError, match="gather_columns"):
        fused.gather_columns_triton(x[0], idx)


# --------------------------------------------------------------------------- act-order input order from the producer

@pytest.mark.parametrize("T,N,mode", [(1, 4096, "plain"), (3, 100, "residual"), (2, 256, "pending"),
                                      (2, 64, "mixed-dtype")])
def test_rms_norm_writes_its_output_in_a_given_column_order(T, N, mode):
    """perm (an act-order GEMM's input_perm): out[:, j] is the normalised column perm[j], bit for bit
    the unpermuted output gathered, whether the kernel gathers the weight or is handed it permuted;
    the new residual keeps the model's order; a pending sum's workspace ends zero. The reference
    path gathers the same way."""
    from fitllm.kernels._utils import Fp8Input, Gathered

    vals = randn(T, N, scale=3.0)
    x, w = vals.to(torch.bfloat16), (1 + randn(N) * 0.1).to(torch.bfloat16)
    r = None if mode == "plain" else randn(T, N, dtype=torch.float32 if mode == "mixed-dtype" else torch.bfloat16)
    perm = torch.randperm(N, generator=GEN).to(torch.int32)
    want = fused.rms_norm_triton(x, w, 1e-6, r)
    ws = None
    for permuted_weight in (None, w[perm.long()]):
        if mode == "pending":
            x, ws = _pending(vals)
        got = fused.rms_norm_triton(x, w, 1e-6, r, perm=perm, permuted_weight=permuted_weight)
        got_out, want_out = (got[0], want[0]) if r is not None else (got, want)
        if r is not None:
            assert torch.equal(got[1], want[1])
        assert isinstance(got_out, Gathered) and got_out.perm is perm and got_out.shape == want_out.shape
        assert torch.equal(got_out.x, want_out[:, perm.long()])
        if ws is not None:
            assert (ws == 0).all()
    ref = fused.rms_norm(vals.to(torch.bfloat16), w, 1e-6, r, perm=perm)
    ref = ref[0] if r is not None else ref
    assert isinstance(ref, Gathered)
    with pytest.raises(ValueError, match="perm"):
        fused.rms_norm_triton(vals.to(torch.bfloat16), w, 1e-6, perm=perm[:-1])
    with pytest.raises(ValueError, match="perm"):
        fused.rms_norm_triton(vals.to(torch.bfloat16), w, 1e-6, quant=Fp8Input(), perm=perm)
    with pytest.raises(ValueError, match="permuted_weight"):
        fused.rms_norm(vals.to(torch.bfloat16), w, 1e-6, permuted_weight=w)
    with pytest.raises(ValueError, match="permuted_weight"):
        fused.rms_norm_triton(vals.to(torch.bfloat16), w, 1e-6, perm=perm, permuted_weight=w.float())


def _act_order_tiled(K, N):
    """A random act-order 4-bit weight as the GPU loader stores it: rows sorted by group, tiled, perm."""
    from fitllm.quant.formats.packing import TiledWeight

    return TiledWeight.from_kernel(act_order_weight(K, N).grouped_by_permutation())


def _act_order_decoder(tokens, monkeypatch):
    """A 2-layer bf16 decoder of act-order int4 layers on the Triton path (interpreter), `tokens`
    random inputs, and the list of the column counts fused.gather_columns is called with."""
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=256, intermediate_size=384,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6)
    model = quantized_model(cfg, _act_order_tiled)
    ids, positions = torch.randint(0, 96, (tokens,), generator=GEN), torch.arange(tokens)
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "triton")
    gathers = []
    orig = fused.gather_columns
    monkeypatch.setattr(fused, "gather_columns", lambda x, idx: gathers.append(x.shape[1]) or orig(x, idx))
    return cfg, model, ids, positions, gathers


@pytest.mark.parametrize("tokens", [1, 5])
def test_act_order_layers_get_their_input_order_from_the_producers(tokens, monkeypatch):
    """Act-order int4 layers: the norms write qkv's and gate_up's input in their weights' order
    (Gathered), and each down_proj's order moves into its gate_up's outputs at load
    (CausalLM.fold_input_orders), so without a paged cache (NoCacheContext: no writes_columns) only
    o_proj still gathers. The hidden states equal, bit for bit, those of the model where every layer
    gathers its own input (FITLLM_ACT_ORDER_FOLD=0)."""
    from fitllm.quant.formats.packing import TiledWeight

    cfg, model, ids, positions, gathers = _act_order_decoder(tokens, monkeypatch)
    monkeypatch.setenv("FITLLM_ACT_ORDER_FOLD", "0")
    with torch.no_grad():
        assert model.fold_input_orders() == 0
        ref = model(ids, positions, NoCacheContext([tokens]))
    assert len(gathers) == 4 * cfg.num_layers
    monkeypatch.delenv("FITLLM_ACT_ORDER_FOLD")
    mlp = model.model.layers[0].mlp
    down, gate_up, p = mlp.down_proj.dequantized_weight(), mlp.gate_up_proj.dequantized_weight(), mlp.down_proj.input_perm().long()
    assert model.fold_input_orders() == cfg.num_layers
    assert mlp.down_proj.input_perm() is None and isinstance(mlp.down_proj.parts[0], TiledWeight)
    # down_proj's columns and gate|up's rows now both run in down_proj's stored order
    assert torch.equal(mlp.down_proj.dequantized_weight(), down[:, p])
    assert torch.equal(mlp.gate_up_proj.dequantized_weight(), gate_up[torch.cat([p, p + cfg.intermediate_size])])
    # each norm's weight in its GEMM's input order, made at load (never first inside a graph capture)
    layer = model.model.layers[0]
    qkv_perm = layer.self_attn.qkv_proj.input_perm()
    made = layer.input_layernorm._in_order
    assert made[0] is qkv_perm and torch.equal(made[2], layer.input_layernorm.weight[qkv_perm.long()])
    gathers.clear()
    with torch.no_grad():
        got = model(ids, positions, NoCacheContext([tokens]))
    assert gathers == [cfg.num_heads * cfg.head_dim] * cfg.num_layers  # o_proj's only
    assert torch.isfinite(got).all() and torch.equal(got, ref)


@pytest.mark.parametrize("tokens,kv", [(1, "bf16"), (5, "bf16"), (1, "fp8")])
def test_paged_attention_writes_o_proj_input_in_its_order(tokens, kv, monkeypatch):
    """Over the paged cache (ForwardContext.writes_columns) the attention kernels store each act-order
    o_proj's input in its weight's order (out_cols; a Gathered x), so with the folds at load no layer
    of a short step gathers at all (a longer one leaves o_proj its gather; decoder.ATTENTION_WRITES_ORDER_UP_TO,
    raised here to test the kernels' out_cols on a 5-token step too). Hidden states: bit for bit
    those of every layer gathering its own input (FITLLM_ACT_ORDER_FOLD=0, same cache kind). bf16 KV
    fuses RoPE into the cache write; a scaled fp8 cache maps the output back to the model's space
    first and scatters it after."""
    from fitllm.models import decoder
    from fitllm.models.kv_cache import AttentionMetadata, ForwardContext, KVCalibration, PagedKVCache

    cfg, model, ids, positions, gathers = _act_order_decoder(tokens, monkeypatch)
    cal = KVCalibration.from_scales([0.05] * cfg.num_layers, [0.05] * cfg.num_layers, cfg.num_kv_heads,
                                    cfg.head_dim) if kv == "fp8" else None

    def run():  # a fresh cache per run: both runs write the same slots
        cache = PagedKVCache(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16,
                             device="cpu", kv_dtype=kv, calibration=cal)
        assert cache.transformed == (kv == "fp8")  # the kernels store the order / the map back scatters
        with torch.no_grad():
            return model(ids, positions, ForwardContext(cache, AttentionMetadata.build([tokens], [tokens], [[2]], 16,
                                                                                        "cpu")))

    monkeypatch.setenv("FITLLM_ACT_ORDER_FOLD", "0")
    ref = run()
    assert len(gathers) == 4 * cfg.num_layers
    monkeypatch.delenv("FITLLM_ACT_ORDER_FOLD")
    assert model.fold_input_orders() == cfg.num_layers
    gathers.clear()
    monkeypatch.setattr(decoder, "ATTENTION_WRITES_ORDER_UP_TO", tokens)  # (5: the prefill kernel's out_cols)
    got = run()
    assert gathers == []
    assert torch.isfinite(got).all() and torch.equal(got, ref)
    # a step longer than ATTENTION_WRITES_ORDER_UP_TO: o_proj gathers its input itself, same output
    monkeypatch.setattr(decoder, "ATTENTION_WRITES_ORDER_UP_TO", tokens - 1)
    assert torch.equal(run(), ref) and gathers == [cfg.num_heads * cfg.head_dim] * cfg.num_layers


def test_rms_norm_weight_in_order_is_made_once_and_follows_the_weight():
    from fitllm.models.decoder import RMSNorm

    norm, perm = RMSNorm(8, 1e-6), torch.randperm(8, generator=GEN).to(torch.int32)
    assert norm.weight_in_order(None) is None
    first = norm.weight_in_order(perm)
    assert norm.weight_in_order(perm) is first  # cached
    with torch.no_grad():
        norm.weight.copy_(torch.arange(8.0))
    assert torch.equal(norm.weight_in_order(perm), torch.arange(8.0)[perm.long()])  # remade after a change


def test_permute_outputs_keeps_each_part_whole():
    """A fused layer of several GEMMs permutes outputs only within each part; a permutation that
    mixes parts is refused and leaves the layer as it was. Dense layers permute their rows."""
    from fitllm.models.linear import DenseLinear
    from fitllm.quant.layers import QuantLinear

    parts = [_act_order_tiled(256, 24), _act_order_tiled(256, 24)]
    layer = QuantLinear("model.layers.0.mlp.gate_up_proj", 256, [24, 24], False, reader=None,
                        dtype=torch.bfloat16, device="cpu")
    layer.parts = list(parts)
    w = layer.dequantized_weight()
    assert not layer.permute_outputs(torch.arange(48).flip(0)) and layer.parts == parts
    p = torch.randperm(24, generator=GEN)
    assert layer.permute_outputs(torch.cat([p, p + 24]))
    assert torch.equal(layer.dequantized_weight(), w[torch.cat([p, p + 24])])
    dense = DenseLinear("x", 8, [6], True)
    dense.weight.data, dense.bias.data = torch.randn(6, 8), torch.randn(6)
    x, p = torch.randn(2, 8), torch.randperm(6)
    y = dense(x)
    assert dense.permute_outputs(p) and torch.equal(dense(x), y[:, p])


def test_without_tl_gather_the_permuted_outputs_come_from_gather_columns(monkeypatch):
    """Triton before 3.2 has no tl.gather: RMSNorm's perm and the row gather fall back to the
    scattered-load gather kernel, with the same bits."""
    from fitllm.kernels._utils import Gathered

    kernels = fused._kernels()
    x, w = randn(3, 256, dtype=torch.bfloat16), (1 + randn(256) * 0.1).to(torch.bfloat16)
    r, perm = randn(3, 256, dtype=torch.bfloat16), torch.randperm(256, generator=GEN).to(torch.int32)
    want_out, want_h = fused.rms_norm_triton(x, w, 1e-6, r, perm=perm)
    monkeypatch.setattr(kernels, "HAS_GATHER", False)
    monkeypatch.setattr(fused, "GATHER_ROWS_FROM", 0)
    monkeypatch.setattr(kernels, "gather_row_kernel", None)  # must not be launched
    got_out, got_h = fused.rms_norm_triton(x, w, 1e-6, r, perm=perm)
    assert isinstance(got_out, Gathered) and torch.equal(got_out.x, want_out.x) and torch.equal(got_h, want_h)
    assert torch.equal(fused.gather_columns_triton(x, perm), x[:, perm.long()])
