"""The paged KV cache: dtypes, smoothing transforms, bytes per token, and full-model generation."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # the Triton-path test below runs the kernels on the CPU

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from fitllm.models.generate import generate, make_cache  # noqa: E402
from fitllm.models.kv_cache import (AttentionMetadata, ForwardContext, KVCalibration, NoCacheContext,  # noqa: E402
                                    PagedKVCache, calibrate_kv_scales, causal_attention, hadamard)

L, H, G, D, PAGE = 2, 2, 3, 32, 4


def random_calibration(seed=0):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(L, H, D, generator=g) * 2
    spread = torch.rand(L, H, D, generator=g) * 3 + 0.5
    return KVCalibration(mean, mean - spread, mean + spread, mean * 0.1, mean * 0.1 - 2, mean * 0.1 + 2)


def with_rotated_stats(cal):
    """The calibration plus min/max in the Hadamard basis, bounded from the per-channel ranges
    (|sum_i x_i r_ij| <= sum_i |x_i| |r_ij|): wide, but a valid calibration for the tests."""
    rot = hadamard(D)
    centre, half = (cal.k_max + cal.k_min) / 2, (cal.k_max - cal.k_min) / 2
    vc, vh = (cal.v_max + cal.v_min) / 2, (cal.v_max - cal.v_min) / 2
    return KVCalibration(cal.k_mean, cal.k_min, cal.k_max, cal.v_mean, cal.v_min, cal.v_max,
                         centre @ rot - half @ rot.abs(), centre @ rot + half @ rot.abs(),
                         vc @ rot - vh @ rot.abs(), vc @ rot + vh @ rot.abs())


def make(kv_dtype, num_blocks=24, rotated_stats=False, **kw):
    cal = random_calibration() if kv_dtype in ("fp8", "int8", "int4") else None
    if rotated_stats:
        cal = with_rotated_stats(cal)
    return PagedKVCache(L, num_blocks, PAGE, H, D, dtype=torch.float32, device="cpu", kv_dtype=kv_dtype,
                        calibration=cal, **kw)


def qkv_views(qkv):
    """q [T, H*G, D], k and v [T, H, D] as views of one [T, (H*G + 2H) D] buffer (the qkv projection's output)."""
    t = qkv.shape[0]
    return (qkv[:, :H * G * D].view(t, H * G, D), qkv[:, H * G * D:(H * G + H) * D].view(t, H, D),
            qkv[:, (H * G + H) * D:].view(t, H, D))


def run_steps(cache, seed=0, joined=False):
    """Two sequences: a prefill chunk, an extend chunk, then decode steps; returns outputs and
    the K/V written (in model space) per sequence. joined: q, k and v are views of one qkv buffer,
    as the decoder's projection gives them."""
    g = torch.Generator().manual_seed(seed)
    cal = random_calibration()
    tables = [[5, 2, 9, 11, 0], [7, 1, 3, 20, 13]]
    lens, outs, ks, vs = [0, 0], [], [[], []], [[], []]
    for chunk in ([6, 3], [4, 1], [1, 1], [1, 1]):
        new_lens = [a + b for a, b in zip(lens, chunk)]
        meta = AttentionMetadata.build(chunk, new_lens, tables, PAGE, "cpu")
        t = sum(chunk)
        k = cal.k_mean[0] + torch.randn(t, H, D, generator=g) * 1.5
        v = cal.v_mean[0] + torch.randn(t, H, D, generator=g)
        q = torch.randn(t, H * G, D, generator=g)
        if joined:
            q, k, v = qkv_views(torch.cat([x.flatten(1) for x in (q, k, v)], 1))
        out = ForwardContext(cache, meta).attend(0, q, k, v, 0.25)
        lo = 0
        for i, n in enumerate(chunk):
            ks[i].append(k[lo:lo + n])
            vs[i].append(v[lo:lo + n])
            outs.append((i, new_lens[i], q[lo:lo + n], out[lo:lo + n]))
            lo += n
        lens = new_lens
    return outs, tables, [torch.cat(x) for x in ks], [torch.cat(x) for x in vs]


ROTATED = {"fp8": dict(rotated_stats=True), "int8": dict(rotate=True), "int4": dict(rotate=True)}


@pytest.mark.parametrize("kv_dtype,rotate", [("fp32", False), ("bf16", False), ("fp8", False), ("int8", False),
                                             ("int4", False), ("fp8", True), ("int8", True), ("int4", True)])
def test_attention_equals_plain_attention_over_dequantized_cache(kv_dtype, rotate):
    """Smoothing and rotation are folded into q and the output: attention over the cache must equal
    plain attention over the dequantized K/V in model space (and be close to the unquantized one)."""
    cache = make(kv_dtype, **(ROTATED[kv_dtype] if rotate else dict(rotate=False)))
    assert (cache.rotation is not None) == rotate
    outs, tables, ks, vs = run_steps(cache)
    for i, length, q, out in outs:
        k, v = cache.gather(0, torch.tensor(tables[i]), length)
        ref = causal_attention(q, k.float(), v.float(), 0.25)
        assert torch.isfinite(out).all()
        assert ((out - ref).norm() / ref.norm()) < (1e-2 if kv_dtype == "bf16" else 1e-4)
        exact = causal_attention(q, ks[i][:length], vs[i][:length], 0.25)
        bound = {"fp32": 1e-6, "bf16": 1e-2, "fp8": 0.06, "int8": 0.01, "int4": 0.15}[kv_dtype]
        assert ((out - exact).norm() / exact.norm()) < bound


@pytest.mark.parametrize("kv_dtype,rotate", [("fp8", False), ("int4", True), ("int8", True)])
def test_qkv_maps_in_one_launch_compute_the_separate_maps(kv_dtype, rotate, monkeypatch):
    """q, k, v as consecutive heads of one buffer take one head_affine launch (split outputs), and
    the step's results are exactly those of the three separate maps."""
    from fitllm.models import kv_cache

    kw = ROTATED[kv_dtype] if rotate else dict(rotate=False)
    separate = run_steps(make(kv_dtype, **kw))[0]
    calls = []
    real = kv_cache.head_affine
    monkeypatch.setattr(kv_cache, "head_affine", lambda *a, **k: calls.append(k.get("split")) or real(*a, **k))
    joined = run_steps(make(kv_dtype, **kw), joined=True)[0]
    assert calls and all(c is not None for c in calls[::2]) and len(calls) == 2 * 4  # joined map + output map, 4 steps
    for (_, _, _, a), (_, _, _, b) in zip(separate, joined):
        assert torch.equal(a, b)


# fp8 is left out here: triton 3.6's interpreter rounds fp32 -> e4m3 wrongly for a few values
# (test_paged_attention covers it loosely; the GPU run in bench_attention.py exactly).
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_triton_path_matches_torch_path(kv_dtype, monkeypatch):
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "torch")
    ref_outs = run_steps(make(kv_dtype))[0]
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "triton")
    tri_cache = make(kv_dtype)
    assert (tri_cache.rotation is not None) == (kv_dtype == "int4")  # the rotated path, through the kernels
    tri_outs = run_steps(tri_cache, joined=True)[0]  # quantized: the one-launch q/k/v maps' kernel
    for (_, _, _, a), (_, _, _, b) in zip(ref_outs, tri_outs):
        tol = 2e-2 if kv_dtype != "int4" else 5e-2  # interpreter rounds to bf16/fp8 by truncation
        assert ((a - b).norm() / a.norm()) < tol


@pytest.mark.parametrize("kv_dtype,k_row,v_row", [
    ("fp32", 4 * D, 4 * D), ("bf16", 2 * D, 2 * D), ("fp8", D, D), ("int8", D + 2, D + 2),
    ("int4", D // 2 + 4 * (D // 4), D // 2 + 4 * (D // 8))])
def test_bytes_per_token_is_the_storage(kv_dtype, k_row, v_row):
    cache = make(kv_dtype, int4_group=8, int4_key_group=4)
    assert cache.bytes_per_token == L * H * (k_row + v_row)
    per_token = [t for t in (cache.k, cache.v, cache.k_scales, cache.v_scales, cache.k_zeros, cache.v_zeros)
                 if t is not None]
    assert sum(t.numel() * t.element_size() for t in per_token) == cache.bytes_per_token * cache.num_blocks * PAGE


@pytest.mark.parametrize("n", [64, 32, 96, 24])
def test_hadamard_is_orthonormal_and_spreads(n):
    h = hadamard(n)
    assert torch.allclose(h @ h.mT, torch.eye(n), atol=1e-6)
    block = n & -n
    assert torch.allclose(h.abs()[:block, :block], torch.full((block, block), block ** -0.5))
    # an outlier channel is spread evenly over a block: what makes per-token int4/fp8 scales fit
    x = torch.zeros(n)
    x[0] = 10.0
    assert (x @ h).abs().max() == pytest.approx(10 * block ** -0.5)


def test_rotation_default_and_its_requirements():
    assert make("int4").rotation is not None and make("int8").rotation is None
    assert make("fp8").rotation is None  # checkpoint-style calibration: no rotated statistics
    assert make("fp8", rotated_stats=True).rotation is not None
    with pytest.raises(ValueError, match="rotated basis"):
        make("fp8", rotate=True)


@pytest.mark.parametrize("groups", [dict(int4_group=24), dict(int4_key_group=3), dict(int4_key_group=12)])
def test_int4_groups_must_divide_head_dim(groups):
    with pytest.raises(ValueError, match="power of two"):
        make("int4", **groups)


def test_fp8_and_int4_need_calibration():
    for kv in ("fp8", "int4"):
        with pytest.raises(ValueError, match="calibrat"):
            PagedKVCache(L, 4, PAGE, H, D, dtype=torch.float32, device="cpu", kv_dtype=kv)
    with pytest.raises(ValueError, match="kv_dtype"):
        PagedKVCache(L, 4, PAGE, H, D, dtype=torch.float32, device="cpu", kv_dtype="int3")


def test_fp8_scales_from_checkpoint_and_per_head():
    cal = KVCalibration.from_scales([0.01, 0.02], [0.03, 0.04], H, D)
    assert cal.k_max.shape == (L, H, D) and float(cal.k_max[1, 0, 0]) == pytest.approx(0.02 * 448)
    for mode in ("tensor", "head"):
        cache = PagedKVCache(L, 4, PAGE, H, D, dtype=torch.float32, device="cpu", kv_dtype="fp8",
                             calibration=random_calibration(), fp8_scales=mode)
        assert cache.k_scale.shape == (L, H) and (cache.k_scale > 0).all()
        assert (cache.k_scale[:, 0] == cache.k_scale[:, 1]).all() == (mode == "tensor")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.tiny_models import write_tiny_model
    from fitllm.models.loader import load_model

    folder = tmp_path_factory.mktemp("tiny_llama")
    write_tiny_model("llama", folder)
    return load_model(folder, dtype=torch.float32)


def greedy_without_cache(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        t = torch.tensor(ids)
        with torch.inference_mode():
            h = model(t, torch.arange(len(ids)), NoCacheContext([len(ids)]))
        ids.append(int(model.compute_logits(h[-1:]).argmax(-1)))
    return ids[len(prompt):]


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_generation_matches_no_cache(tiny_model, kv_dtype):
    prompts = [[1, 17, 42, 99, 5], [3, 8]]
    cache = make_cache(tiny_model, 32, num_seqs=2, block_size=PAGE, kv_dtype=kv_dtype)
    got = generate(tiny_model, prompts, 8, cache=cache)
    for p, g in zip(prompts, got):
        want = greedy_without_cache(tiny_model, p, 8)
        if kv_dtype == "fp32":
            assert g == want
        else:  # bf16 K/V may flip a near-tie late in a random model's output; the start must agree
            assert g[:4] == want[:4]


def test_calibration_and_quantized_logits(tiny_model):
    torch.manual_seed(0)
    batches = [torch.randint(0, 256, (48,)).tolist() for _ in range(3)]
    cal = calibrate_kv_scales(tiny_model, batches)
    c = tiny_model.config
    assert cal.k_mean.shape == (c.num_layers, c.num_kv_heads, c.head_dim)
    assert (cal.k_max >= cal.k_min).all() and torch.isfinite(cal.v_mean).all()
    # the rotated statistics describe the same keys: their mean lies inside the rotated range
    k_mean_rot = cal.k_mean @ hadamard(c.head_dim)
    assert cal.has_rotated and ((cal.k_rot_min <= k_mean_rot + 1e-5) & (k_mean_rot <= cal.k_rot_max + 1e-5)).all()
    back = KVCalibration.from_state_dict(cal.state_dict())
    assert back.k_max.equal(cal.k_max) and back.v_rot_max.equal(cal.v_rot_max)
    from fitllm.models.generate import prompt_logits

    ids = torch.randint(0, 256, (40,)).tolist()
    base = prompt_logits(tiny_model, ids).log_softmax(-1)
    for kv, bound in (("fp8", 0.02), ("int8", 0.01), ("int4", 0.1)):
        cache = make_cache(tiny_model, 40, block_size=PAGE, kv_dtype=kv, calibration=cal)
        lp = prompt_logits(tiny_model, ids, cache).log_softmax(-1)
        kl = (base.exp() * (base - lp)).sum(-1).mean().item()
        assert kl < bound, (kv, kl)


def test_graph_context_attends_through_the_cache(monkeypatch):
    """Under CUDA graphs the step's attention goes through PagedKVCache.attend when the graph uses
    the cache's own kernels (so q, k, v share one map launch there too); the padded torch stand-in
    gets the write, then its attention."""
    from fitllm.serve import model_runner
    from fitllm.serve.model_runner import GraphContext, graph_safe_attention

    cache = make("fp8")
    meta = AttentionMetadata.build([1], [1], [[0]], PAGE, "cpu")
    q, k, v = torch.randn(1, H * G, D), torch.randn(1, H, D), torch.randn(1, H, D)
    seen = []
    monkeypatch.setattr(cache, "supports_cuda_graphs", True)
    monkeypatch.setattr(cache, "attend", lambda *a: seen.append("attend") or "out")
    assert GraphContext(cache, meta, graph_safe_attention(cache)).attend(0, q, k, v, 0.25) == "out"
    assert seen == ["attend"]
    plain = make("fp32")
    monkeypatch.setattr(plain, "write", lambda *a: seen.append("write"))
    monkeypatch.setattr(model_runner, "padded_attention", lambda *a: seen.append("other") or "other out")
    assert GraphContext(plain, meta, graph_safe_attention(plain)).attend(0, q, k, v, 0.25) == "other out"
    assert seen == ["attend", "write", "other"]


def rope_tables(t, seed, half=D // 2):
    g = torch.Generator().manual_seed(seed)
    angle = torch.randint(0, 500, (t, 1), generator=g).float() * (1e4 ** -(torch.arange(half) / half))
    return angle.cos(), angle.sin()


@pytest.mark.parametrize("kv_dtype,dtype,half", [("fp32", torch.float32, D // 2), ("bf16", torch.float32, D // 2),
                                                 ("bf16", torch.bfloat16, D // 2), ("bf16", torch.bfloat16, D // 4)])
def test_rope_fused_into_the_cache_write_equals_rope_then_attend(kv_dtype, dtype, half, monkeypatch):
    """The Triton path of an unquantized cache takes RoPE into its write's launch (rope_cache_write):
    the same outputs and the same cache bytes as RoPE, then the reference write and attention.
    q, k, v are views of one qkv buffer, padding slots (-1) are skipped, GQA groups rotate once.
    Partial RoPE (half < D / 2) takes the separate RoPE kernel, with the same result."""
    from fitllm.kernels.fused import apply_rope_ref

    def run(fused):
        monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "triton" if fused else "torch")
        cache = PagedKVCache(L, 24, PAGE, H, D, dtype=dtype, device="cpu", kv_dtype=kv_dtype)
        assert cache.fuses_rope == fused
        g = torch.Generator().manual_seed(1)
        outs, lens = [], [0, 0]
        for step, chunk in enumerate(([5, 3], [1, 1], [1, 1])):
            new = [a + b for a, b in zip(lens, chunk)]
            meta = AttentionMetadata.build(chunk, new, [[5, 2, 9], [7, 1, 3]], PAGE, "cpu")
            t = sum(chunk)
            if step == 2:
                meta.slot_mapping[-1] = -1  # a padding token: its K/V must not land anywhere
            q, k, v = qkv_views(torch.randn(t, (H * G + 2 * H) * D, generator=g).to(dtype))
            cos, sin = rope_tables(t, step, half)
            ctx = ForwardContext(cache, meta)
            if fused:
                outs.append(ctx.attend(0, q, k, v, 0.25, rope=(cos, sin)))
            else:
                q, k = apply_rope_ref(q, k, cos, sin)
                outs.append(ctx.attend(0, q, k, v, 0.25))
            outs.append(q.clone())  # rotated in place on both paths
            lens = new
        return outs, cache.k[0].clone(), cache.v[0].clone()

    ref, tri = run(False), run(True)
    for out_r, out_t, q_r, q_t in zip(ref[0][::2], tri[0][::2], ref[0][1::2], tri[0][1::2]):
        assert q_t.equal(q_r)
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # the interpreter's 16-bit attention vs torch's
        assert ((out_t.float() - out_r.float()).norm() / out_r.float().norm()) < tol
    assert tri[1].equal(ref[1]) and tri[2].equal(ref[2])  # bit for bit, the padding slot untouched


def test_rope_cache_write_takes_the_qkv_gemms_pending_sum(monkeypatch):
    """q, k, v as views of the qkv GEMM's unfinished split-K sum (kernels._utils.PendingSum): the RoPE +
    cache-write launch reads them, rounded as the GEMM would have stored y, and zeroes the workspace;
    the attention output and the cache bytes equal, bit for bit, those from the finished y (bf16)."""
    from fitllm.kernels import _utils

    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "triton")
    runs = []
    for pending in (False, True):
        cache = PagedKVCache(L, 24, PAGE, H, D, dtype=torch.bfloat16, device="cpu", kv_dtype="bf16")
        lens, outs = [0, 0], []
        for step, chunk in enumerate(([5, 3], [1, 1])):
            new = [a + b for a, b in zip(lens, chunk)]
            meta = AttentionMetadata.build(chunk, new, [[5, 2, 9], [7, 1, 3]], PAGE, "cpu")
            t = sum(chunk)
            vals = torch.randn(t, (H * G + 2 * H) * D, generator=torch.Generator().manual_seed(10 + step))
            qkv = _utils.PendingSum.holding(vals)
            parts = qkv.split([H * G * D, H * D, H * D]) if pending else qkv_views(qkv.materialize())
            q, k, v = (p.reshape(t, -1, D) for p in parts)
            cos, sin = rope_tables(t, step)
            outs.append(ForwardContext(cache, meta).attend(0, q, k, v, 0.25, rope=(cos, sin)))
            ws = _utils.splitk_workspace(vals.device, vals.numel(), 0)[0]
            assert not ws.any()  # taken (or finished) either way: the next GEMM starts clean
            lens = new
        runs.append((outs, cache.k[0].clone(), cache.v[0].clone()))
    (want, kw, vw), (got, kg, vg) = runs
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and kg.equal(kw) and vg.equal(vw)


def test_decoder_hands_rope_to_a_context_that_fuses_it(tiny_model):
    """A context saying fuses_rope gets q and k unrotated plus (cos, sin); the model's output is the
    one of rotating first."""
    from fitllm.kernels.fused import apply_rope_ref

    class Fusing(NoCacheContext):
        fuses_rope, calls = True, 0

        def attend(self, layer, q, k, v, scale, rope=None):
            Fusing.calls += 1
            q, k = apply_rope_ref(q, k, *rope)
            return super().attend(layer, q, k, v, scale)

    ids = torch.tensor([1, 17, 42, 99, 5, 3])
    with torch.inference_mode():
        want = tiny_model(ids, torch.arange(6), NoCacheContext([6]))
        got = tiny_model(ids, torch.arange(6), Fusing([6]))
    assert Fusing.calls == tiny_model.config.num_layers and torch.equal(got, want)
