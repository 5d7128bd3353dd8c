"""bitsandbytes checkpoints: fitllm's reader, NF4 quantizer and writer against the library itself and against
transformers' bitsandbytes models; the 4-bit codebook kernel under the Triton interpreter against its reference."""
import json

import pytest
import torch

bnb_f = pytest.importorskip("bitsandbytes.functional")

from fitllm.kernels.codebook4 import (DEQUANT_FROM_M, codebook4_gemm, codebook4_gemm_ref,  # noqa: E402
                                      codebook4_gemm_triton, dequantize_codebook4, dequantize_codebook4_triton)
from fitllm.models.errors import ModelLoadError  # noqa: E402
from fitllm.models.generate import prompt_logits  # noqa: E402
from fitllm.quant.formats import bitsandbytes as fmt  # noqa: E402
from fitllm.quant.layers import load_quantized_model  # noqa: E402
from fitllm.quant.nf4 import nf4_quantize  # noqa: E402
from fitllm.quant.pipeline import quantize_model  # noqa: E402
from fitllm.quant.scheme import CodebookWeight, QuantError  # noqa: E402

from quant_fixtures import CALIB_TEXT, make_tiny_model  # noqa: E402

IDS = list(range(200, 232))
FOUR_BIT = {"quant_method": "bitsandbytes", "load_in_4bit": True}


def packed_tensors(w, quant_type="nf4", blocksize=64, nested=False):
    """The checkpoint tensors bitsandbytes itself writes for one linear (QuantState.as_dict(packed=True))."""
    q, state = bnb_f.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)
    return {"weight": q, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}, q, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocksize", [64, 128])
def test_nf4_quantizer_is_bitsandbytes_bit_for_bit(dtype, blocksize):
    w = (torch.randn(48, 256, generator=torch.Generator().manual_seed(blocksize)) * 0.05).to(dtype)
    w[3, :blocksize] = 0  # an all-zero block
    q, state = bnb_f.quantize_4bit(w, blocksize=blocksize, quant_type="nf4")
    ours = nf4_quantize(w, blocksize)
    assert torch.equal(ours.codes.reshape(-1), q.reshape(-1))
    assert torch.equal(ours.absmax.reshape(-1), state.absmax)
    assert torch.equal(ours.codebook, state.code)


@pytest.mark.parametrize("quant_type,nested", [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)])
def test_reader_matches_bitsandbytes_dequantize(quant_type, nested):
    w = torch.randn(96, 320, generator=torch.Generator().manual_seed(1)) * 0.02
    tensors, q, state = packed_tensors(w, quant_type, 64, nested)
    ours = fmt.read(tensors, FOUR_BIT, torch.float32, "m.q_proj")
    ref = bnb_f.dequantize_4bit(q, state)
    assert ours.codes.shape == (96, 160) and ours.absmax.shape == (96, 5)
    assert (ours.dequantize() - ref).abs().max() <= 1e-6 * ref.abs().max()
    served = ours.to("cpu")  # fp16 absmax
    assert served.absmax.dtype == torch.float16
    assert (served.dequantize() - ref).abs().max() <= 2 ** -10 * ref.abs().max()


def test_reader_takes_other_quant_storage():
    """bnb_4bit_quant_storage bfloat16 (FSDP QLoRA checkpoints): the same bytes viewed as bf16."""
    w = torch.randn(64, 128) * 0.02
    tensors, q, state = packed_tensors(w)
    stored = bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4", quant_storage=torch.bfloat16)[0]
    assert stored.dtype == torch.bfloat16
    ours = fmt.read({**tensors, "weight": stored}, FOUR_BIT, torch.float32, "m")
    assert torch.equal(ours.dequantize(), fmt.read(tensors, FOUR_BIT, torch.float32, "m").dequantize())


@pytest.mark.parametrize("m,n,k,blocksize", [(1, 64, 128, 64), (1, 96, 192, 64), (3, 80, 256, 128), (5, 64, 128, 32),
                                             (17, 64, 256, 64), (40, 130, 128, 64), (1, 64, 512, 256),
                                             (3, 64, 512, 256), (1, 64, 128, 32)])
def test_codebook_kernel_matches_reference(m, n, k, blocksize):
    g = torch.Generator().manual_seed(m * n + k)
    w = nf4_quantize(torch.randn(n, k, generator=g), blocksize).to("cpu")
    x = torch.randn(m, k, generator=g)
    args = (w.codes, w.absmax, w.codebook, blocksize)
    ref = codebook4_gemm_ref(x, *args)
    for path in ("auto", "kernel", "dequant"):
        assert torch.allclose(codebook4_gemm_triton(x, *args, path=path), ref, atol=1e-4, rtol=1e-4), path
    exact = x.double() @ w.dequantize(torch.float64).t()  # the reference itself, against float64
    assert torch.allclose(ref.double(), exact, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_codebook_kernel_in_16_bit(dtype):
    """bf16 / fp16 activations (the GPU's): every path (GEMV at M = 1, dots above) within 16-bit rounding of
    the float64 product. (bf16 dots run upcast under the interpreter, which multiplies bf16 bits as integers.)"""
    w = nf4_quantize(torch.randn(192, 256, generator=torch.Generator().manual_seed(5)) * 0.02, 64).to("cpu")
    exact = w.dequantize(torch.float64)
    for m in (1, 3, 20):
        x = torch.randn(m, 256).to(dtype)
        y = codebook4_gemm_triton(x, w.codes, w.absmax, w.codebook, 64)
        ref = x.double() @ exact.t()
        assert y.dtype == dtype and float((y.double() - ref).norm() / ref.norm()) < 1e-2, m


@pytest.mark.parametrize("n,k,blocksize", [(40, 256, 64), (33, 128, 32), (17, 512, 256), (64, 384, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codebook_dequantize_kernel_is_the_reference(n, k, blocksize, dtype):
    """The dequantization kernel behind the large-M path: the reference's values (both scale in float32 and
    round once), odd row counts and blocks larger and smaller than a K tile included. Bit for bit but in bf16,
    which the interpreter rounds toward zero (a GPU to nearest): there within one bf16 step."""
    g = torch.Generator().manual_seed(n + k)
    w = nf4_quantize(torch.randn(n, k, generator=g), blocksize).to("cpu")
    args = (w.codes, w.absmax, w.codebook, blocksize, dtype)
    got, ref = dequantize_codebook4_triton(*args), dequantize_codebook4(*args)
    assert got.dtype == dtype
    if dtype == torch.bfloat16:
        assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7).all()
    else:
        assert torch.equal(got, ref)


def test_codebook_gemm_takes_the_dequantize_path_from_its_threshold(monkeypatch):
    from fitllm.kernels import codebook4

    w = nf4_quantize(torch.randn(64, 128), 64).to("cpu")
    seen = []
    real = codebook4.dequantize_codebook4_triton
    monkeypatch.setattr(codebook4, "dequantize_codebook4_triton", lambda *a: seen.append(1) or real(*a))
    for m in (1, DEQUANT_FROM_M - 1, DEQUANT_FROM_M, 2 * DEQUANT_FROM_M):
        codebook4_gemm_triton(torch.randn(m, 128), w.codes, w.absmax, w.codebook, 64)
    assert len(seen) == 2


def test_codebook_kernel_split_k_both_ways(monkeypatch):
    """One program per tile (plain store) and K split across programs (fp32 atomic sums) agree."""
    from fitllm.kernels import codebook4

    w = nf4_quantize(torch.randn(64, 512), 64).to("cpu")
    x = torch.randn(2, 512)
    args = (w.codes, w.absmax, w.codebook, 64)
    monkeypatch.setattr(codebook4, "num_sms", lambda idx: 1)  # 1 tile, 2 SMs' worth of programs: split 2
    split = codebook4_gemm_triton(x, *args)
    monkeypatch.setattr(codebook4, "num_sms", lambda idx: 0)  # no split
    whole = codebook4_gemm_triton(x, *args)
    monkeypatch.setattr(codebook4, "num_sms", lambda idx: 1)
    monkeypatch.setenv("FITLLM_DETERMINISTIC", "1")  # no atomics: the unsplit program's exact sums
    assert torch.equal(codebook4_gemm_triton(x, *args), whole)
    assert torch.allclose(split, whole, atol=1e-5) and torch.allclose(whole, codebook4_gemm_ref(x, *args), atol=1e-4)


def test_codebook_gemm_dispatch(monkeypatch):
    w = nf4_quantize(torch.randn(64, 128), 64).to("cpu")
    x = torch.randn(2, 128)
    args = (w.codes, w.absmax, w.codebook, 64)
    calls = []
    from fitllm.kernels import codebook4

    monkeypatch.setattr(codebook4, "codebook4_gemm_triton", lambda *a: calls.append(1) or codebook4_gemm_ref(*a))
    codebook4_gemm(x, *args)
    assert not calls  # CPU tensors: the reference
    monkeypatch.setenv("FITLLM_KERNEL_BACKEND", "triton")
    codebook4_gemm(x, *args)
    assert calls == [1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bnb")
    return root, make_tiny_model(root / "base")


def saved_by_transformers(tiny, name, **bnb_kw):
    """A bitsandbytes checkpoint as transformers writes one: the tiny model loaded with a BitsAndBytesConfig and
    saved."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    root, base = tiny
    out = root / name
    if not out.exists():
        model = AutoModelForCausalLM.from_pretrained(str(base), quantization_config=BitsAndBytesConfig(**bnb_kw),
                                                     device_map="cpu", dtype=torch.float32)
        model.save_pretrained(str(out))
    return out


PATHS = ("self_attn.o_proj", "mlp.down_proj")  # fitllm keeps their rows in checkpoint order (not q/k's)


def transformers_view(folder):
    """transformers' model of a bitsandbytes checkpoint: each layer's PATHS weights as the library dequantizes
    them, and the logits of IDS. The weights are read first: on a CPU the library repacks a 4-bit weight in
    place at its first forward."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), device_map="cpu", dtype=torch.float32)
    weights = {(i, path): library_weight(layer.get_submodule(path))
               for i, layer in enumerate(hf.model.layers) for path in PATHS}
    with torch.no_grad():
        logits = hf(torch.tensor([IDS])).logits[0].float()
    return weights, logits


def library_weight(module) -> torch.Tensor:
    if hasattr(module.weight, "quant_state"):
        return bnb_f.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
    return module.weight.data.float() * module.weight.SCB.float()[:, None] / 127


@pytest.mark.parametrize("name,bnb_kw", [
    ("nf4-double", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}),
    ("fp4", {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}),
    ("int8", {"load_in_8bit": True}),
])
def test_transformers_checkpoints_load(tiny, name, bnb_kw):
    folder = saved_by_transformers(tiny, name, **bnb_kw)
    ours = load_quantized_model(folder)
    weights, hf_logits = transformers_view(folder)
    for (i, path), ref in weights.items():
        got = ours.model.layers[i].get_submodule(path).dequantized_weight()
        # 4-bit: fp16 absmax once served; 8-bit: exactly q * SCB / 127 in fp32
        tol = 1e-6 if name == "int8" else 2 ** -10
        assert (got - ref).abs().max() <= tol * ref.abs().max(), (name, i, path)
    logits = prompt_logits(ours, IDS)
    # the library computes in bf16 (4-bit) or with int8 activations (LLM.int8()); fitllm in fp32
    assert float((logits - hf_logits).norm() / hf_logits.norm()) < 0.02
    assert (logits.argmax(-1) == hf_logits.argmax(-1)).float().mean() > 0.9


def test_served_bnb_model_kept_and_unkept_agree(tiny, monkeypatch):
    """The CPU path's kept dequantized copy and the per-call reference give the same logits."""
    folder = saved_by_transformers(tiny, "nf4-double", load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   bnb_4bit_use_double_quant=True)
    kept = prompt_logits(load_quantized_model(folder), IDS)
    monkeypatch.setenv("FITLLM_CPU_DEQUANT_CACHE_MB", "0")
    per_call = prompt_logits(load_quantized_model(folder), IDS)
    assert torch.allclose(kept, per_call, atol=1e-5)


def test_convert_nf4_loads_in_transformers_and_fitllm(tiny):
    from fitllm.models.loader import load_model

    root, base = tiny
    (root / "calib.txt").write_text(CALIB_TEXT)
    r = quantize_model(base, root / "ours-nf4", "nf4", calib=str(root / "calib.txt"), calib_samples=4, calib_len=32,
                       progress=False, log=lambda s: None)
    qc = json.loads((r.output / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "bitsandbytes" and qc["load_in_4bit"] and qc["bnb_4bit_quant_type"] == "nf4"
    assert r.scheme.group_size == 64 and all(0 < e < 0.5 for e in r.layer_errors)
    ours = load_quantized_model(r.output)
    weights, hf_logits = transformers_view(r.output)
    from safetensors.torch import load_file

    dense = load_file(str(base / "model.safetensors"))
    for path in PATHS:
        ref = weights[1, path]
        got = ours.model.layers[1].get_submodule(path).dequantized_weight()
        assert (got - ref).abs().max() <= 2 ** -10 * ref.abs().max()  # the same codes; fp16 absmax served
        # the codes are bitsandbytes' own for the original weight
        original = dense[f"model.layers.1.{path}.weight"]
        q, state = bnb_f.quantize_4bit(original, blocksize=64, quant_type="nf4")
        assert (got - bnb_f.dequantize_4bit(q, state)).abs().max() <= 2 ** -10 * ref.abs().max()
    logits = prompt_logits(ours, IDS)
    assert float((logits - hf_logits).norm() / hf_logits.norm()) < 0.02
    base_logits = prompt_logits(load_model(base), IDS)
    assert float((logits - base_logits).norm() / base_logits.norm()) < 0.5


def test_convert_nf4_bad_options(tiny):
    root, base = tiny
    (root / "calib.txt").write_text(CALIB_TEXT)
    kw = dict(calib=str(root / "calib.txt"), calib_samples=2, calib_len=16, progress=False, log=lambda s: None)
    with pytest.raises(QuantError, match="bitsandbytes"):
        quantize_model(base, root / "bad1", "nf4", fmt="gptq", **kw)
    with pytest.raises(QuantError, match="--method nf4"):
        quantize_model(base, root / "bad2", "rtn", fmt="bitsandbytes", **kw)
    with pytest.raises(QuantError, match="4-bit"):
        quantize_model(base, root / "bad3", "nf4", bits=8, **kw)
    with pytest.raises(QuantError, match="NF4 blocks of 32"):
        quantize_model(base, root / "bad4", "nf4", group_size=32, **kw)
    assert not any(p.name.startswith("bad") for p in root.iterdir())


def test_broken_bnb_tensors_name_the_module():
    w = torch.randn(64, 128) * 0.02
    good, _, _ = packed_tensors(w)
    state_key = next(k for k in good if "quant_state" in k)
    cases = [
        ({k: v for k, v in good.items() if k != state_key}, "quant_state"),
        ({**good, state_key: torch.tensor(list(b'{"quant_type": "int3"}'), dtype=torch.uint8)}, "int3"),
        ({**good, state_key: torch.tensor([0xFF, 0xFE], dtype=torch.uint8)}, "unreadable"),
        ({**good, "weight": good["weight"][:-1]}, "do not hold"),
        ({**good, "weight.absmax": good["weight.absmax"][:-1]}, "absmax values"),
        ({k: v for k, v in good.items() if k != "weight.quant_map"}, "quant_map"),
    ]
    for tensors, why in cases:
        with pytest.raises(ModelLoadError, match=why) as err:
            fmt.read(tensors, FOUR_BIT, torch.float32, "model.layers.0.mlp.down_proj")
        assert "model.layers.0.mlp.down_proj" in str(err.value)
    odd, _, _ = packed_tensors(torch.randn(64, 96), blocksize=64)  # blocks would straddle rows
    with pytest.raises(ModelLoadError, match="blocksize 64 must be even and divide the input size 96"):
        fmt.read(odd, FOUR_BIT, torch.float32, "m")
    eight = {"weight": torch.zeros(4, 8, dtype=torch.int8), "SCB": torch.ones(4), "weight_format": torch.tensor(1)}
    with pytest.raises(ModelLoadError, match="weight_format 1"):
        fmt.read(eight, {"load_in_8bit": True}, torch.float32, "m")
    with pytest.raises(ModelLoadError, match="SCB"):
        fmt.read({"weight": eight["weight"]}, {"load_in_8bit": True}, torch.float32, "m")


@pytest.mark.parametrize("qc,why", [
    ({"quant_method": "bitsandbytes"}, "exactly one of load_in_4bit"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": True}, "exactly one of load_in_4bit"),
])
def test_unsupported_bnb_configs_name_the_file(tiny, tmp_path, qc, why):
    _, base = tiny
    folder = tmp_path
    raw = json.loads((base / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "quantization_config": qc}))
    (folder / "model.safetensors").symlink_to(base / "model.safetensors")
    with pytest.raises(ModelLoadError, match=why) as err:
        load_quantized_model(folder)
    assert "config.json" in str(err.value)


def test_codebook_weight_rows_and_merge():
    from fitllm.quant.layers import _merge

    a, b = nf4_quantize(torch.randn(8, 128), 64), nf4_quantize(torch.randn(4, 128), 64)
    merged = _merge([a, b])
    assert len(merged) == 1 and isinstance(merged[0], CodebookWeight)
    assert torch.equal(merged[0].dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    idx = torch.tensor([2, 0, 1, 3])
    assert torch.equal(b.rows(idx).dequantize(), b.dequantize()[idx])
    assert len(_merge([a, nf4_quantize(torch.randn(4, 128), 128)])) == 2  # other blocks: two GEMMs


def test_engine_serves_nf4_embedded_model(embedded_folder, embedded_model, embedded_tokenizer):
    """The embedded model (real weights) in NF4 on the fly: the engine's batched greedy output equals plain
    generation on the same model, and NF4 stays close to the dense model."""
    from fitllm.models.generate import generate
    from fitllm.models.loader import load_model
    from fitllm.quant.inplace import quantize_in_memory
    from fitllm.serve.engine import EngineConfig, LLMEngine
    from fitllm.serve.sampling import SamplingParams

    model = quantize_in_memory(load_model(embedded_folder, dtype=torch.float32), "nf4")
    assert isinstance(model.model.layers[3].mlp.gate_up_proj.parts[0], CodebookWeight)
    prompts = [embedded_tokenizer.encode(t, add_special_tokens=False)
               for t in ("The capital of France is", "def fibonacci(n):", "Once upon a time, there")]
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=32, block_size=8, num_kv_blocks=64, max_model_len=128),
                       model=model, tokenizer=embedded_tokenizer)
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.new_token_ids for o in outs] == generate(model, prompts, 6)
    ids = embedded_tokenizer.encode("The quick brown fox jumps over the lazy dog and runs into the forest.")
    nf4, dense = prompt_logits(model, ids), prompt_logits(embedded_model, ids)
    assert float((nf4 - dense).norm() / dense.norm()) < 0.45  # 0.356 (RTN int4 g64: 0.658)
    assert (nf4.argmax(-1) == dense.argmax(-1)).float().mean() > 0.6


@pytest.mark.parametrize("method", ["nf4", "int4", "fp8"])
def test_serve_quantizes_a_dense_checkpoint_as_it_loads(embedded_folder, embedded_tokenizer, method):
    """EngineConfig(quantization=...) (`quant serve --quantization`): the same weights as quantizing the loaded
    model, the same greedy tokens, and the memory plan told the scheme."""
    from fitllm import budget
    from fitllm.models.generate import generate
    from fitllm.models.loader import load_model
    from fitllm.quant.inplace import quantize_in_memory
    from fitllm.serve.engine import EngineConfig, LLMEngine
    from fitllm.serve.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(quantization=method, max_num_batched_tokens=32, block_size=8, num_kv_blocks=64,
                                    max_model_len=128))
    loaded = engine.model
    ref = quantize_in_memory(load_model(embedded_folder, dtype=torch.float32), method)
    for path in ("self_attn.qkv_proj", "mlp.down_proj"):
        assert torch.equal(loaded.model.layers[2].get_submodule(path).dequantized_weight(),
                           ref.model.layers[2].get_submodule(path).dequantized_weight())
    assert budget.detect_scheme(loaded.config) == {"int4": "awq"}.get(method, method)
    prompt = embedded_tokenizer.encode("The capital of France is", add_special_tokens=False)
    out = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert out.new_token_ids == generate(ref, [prompt], 5)[0]


def test_quantization_at_load_errors(tiny):
    from fitllm.serve.engine import EngineConfig

    with pytest.raises(QuantError, match="'int3' on the fly is not supported"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="self-int4"):
        EngineConfig(quantization="nf4", speculative="self-int4")
    folder = saved_by_transformers(tiny, "int8", load_in_8bit=True)
    with pytest.raises(ModelLoadError, match="needs a dense checkpoint"):
        load_quantized_model(folder, quantize="nf4")


def test_serve_banner_names_the_weights():
    from types import SimpleNamespace

    from fitllm.cli.common import weights_label as _weights

    config = lambda qc=None, at=None: SimpleNamespace(quantization_config=qc, quantized_at_load=at)  # noqa: E731
    assert _weights(config()) == "dense"
    assert _weights(config(at="nf4")) == "nf4 (quantized at load)"
    assert _weights(config({**FOUR_BIT, "bnb_4bit_quant_type": "nf4"})) == "bitsandbytes nf4"
    assert _weights(config({"quant_method": "bitsandbytes", "load_in_8bit": True})) == "bitsandbytes int8"
    assert _weights(config({"quant_method": "gptq", "bits": 4})) == "gptq"
