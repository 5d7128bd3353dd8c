"""Quantizing a tiny random Llama end to end: each method, each format, loading back,
transformers parity for compressed-tensors, and bad input."""
import json
import os
from pathlib import Path

import pytest
import torch

from fitllm.models.errors import ModelLoadError
from fitllm.models.generate import prompt_logits
from fitllm.models.loader import load_model
from fitllm.quant.layers import load_quantized_model
from fitllm.quant.pipeline import quantize_model
from fitllm.quant.scheme import QuantError

from quant_fixtures import (CALIB_TEXT, make_tiny_gemma3, make_tiny_mistral3, make_tiny_model, make_tiny_phi3,
                            make_tiny_smollm3)

IDS = list(range(200, 232))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    model = make_tiny_model(root / "base")
    (root / "calib.txt").write_text(CALIB_TEXT)
    return root, model, prompt_logits(load_model(model), IDS)


def convert(tiny, name, method, **kw):
    root, model, _ = tiny
    kw.setdefault("calib_samples", 8)
    kw.setdefault("calib_len", 64)
    return quantize_model(model, root / name, method, calib=str(root / "calib.txt"), progress=False,
                          log=lambda s: None, **kw)


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("method,fmt,kw", [
    ("rtn", "compressed-tensors", {}),
    ("gptq", "gptq", {"act_order": True}),  # dynamic groups: g_idx in the file
    ("gptq", "compressed-tensors", {"sym": True, "act_order": True}),
    ("awq", "autoawq", {}),
    ("fp8", "compressed-tensors", {}),
])
def test_methods_write_and_load(tiny, method, fmt, kw):
    r = convert(tiny, f"{method}-{fmt}", method, fmt=fmt, **kw)
    cfg = json.loads((r.output / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == {"compressed-tensors": "compressed-tensors", "gptq": "gptq", "autoawq": "awq"}[fmt]
    assert (r.output / "tokenizer.json").exists()
    assert len(r.layer_errors) == 2 and all(0 <= e < 0.5 for e in r.layer_errors)
    logits = prompt_logits(load_quantized_model(r.output), IDS)
    assert rel_err(logits, tiny[2]) < (0.1 if method == "fp8" else 0.5)


def test_gptq_beats_rtn_on_layer_error(tiny):
    rtn = convert(tiny, "cmp-rtn", "rtn", group_size=32)
    gptq = convert(tiny, "cmp-gptq", "gptq", group_size=32)
    assert sum(gptq.layer_errors) < sum(rtn.layer_errors)


def test_loaded_weights_equal_pipeline_dequant(tiny, monkeypatch):
    """What the pipeline measured is bit for bit what the runtime serves (AutoAWQ write -> read)."""
    from fitllm.quant.formats import autoawq

    written = []
    real_write = autoawq.write
    monkeypatch.setattr(autoawq, "write", lambda qw: written.append(qw) or real_write(qw))
    r = convert(tiny, "same-awq", "awq", fmt="autoawq", group_size=32)
    q_proj = written[0]  # layer 0 q_proj, the first matrix written
    served = load_quantized_model(r.output).model.layers[0].self_attn.qkv_proj.dequantized_weight()
    assert torch.equal(served[: q_proj.q.shape[0]], q_proj.dequantize())


def test_compressed_tensors_loads_in_transformers(tiny):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    r = convert(tiny, "hf-ct", "rtn", group_size=32)
    hf = AutoModelForCausalLM.from_pretrained(str(r.output), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].float()
    ours = prompt_logits(load_quantized_model(r.output), IDS)
    assert (ours - ref).abs().max() < 1e-3  # same integers and scales; fp32 summation order only


def test_bad_input(tiny):
    root, model, _ = tiny
    with pytest.raises(QuantError, match="unknown method"):
        convert(tiny, "bad1", "bogus")
    with pytest.raises(QuantError, match="does not divide"):
        convert(tiny, "bad2", "rtn", group_size=48)
    done = convert(tiny, "first", "rtn")
    with pytest.raises(QuantError, match="already quantized"):
        quantize_model(done.output, root / "again", "rtn", calib=str(root / "calib.txt"), progress=False, log=print)
    with pytest.raises(QuantError, match="already exists"):
        convert(tiny, "first", "rtn")
    with pytest.raises(QuantError, match="autoawq"):
        convert(tiny, "bad3", "rtn", fmt="autoawq", group_size=-1)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_interrupted_run_leaves_nothing(tiny, monkeypatch, how):
    """Ctrl-C, or SIGTERM (kill, timeout, docker stop), during the layer loop: the temp folder is removed
    and the caller's SIGTERM handler is back."""
    import signal

    import fitllm.quant.pipeline as pipeline

    root = tiny[0]
    calls = []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            if how == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)
        return pipeline.step_rtn(*a, **k)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setitem(pipeline.STEPS, "rtn", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny, f"interrupted-{how}", "rtn")
    assert not (root / f"interrupted-{how}").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(f".interrupted-{how}")]
    assert signal.getsignal(signal.SIGTERM) is before


def test_cpu_keeps_each_weights_dequantized_copy_within_its_budget(tiny, monkeypatch):
    """On a CPU a quantized linear keeps its dequantized weight instead of making it at every call: the
    logits are bit-identical to the per-call reference's, the copies count against
    FITLLM_CPU_DEQUANT_CACHE_MB, and dropping the model gives the budget back."""
    import gc

    import fitllm.quant.layers as layers

    r = convert(tiny, "kept-awq", "awq", group_size=32)
    monkeypatch.setenv("FITLLM_CPU_DEQUANT_CACHE_MB", "0")
    per_call = prompt_logits(load_quantized_model(r.output), IDS)
    gc.collect()
    before = layers._KEPT["bytes"]
    monkeypatch.setenv("FITLLM_CPU_DEQUANT_CACHE_MB", "4096")
    model = load_quantized_model(r.output)
    kept = prompt_logits(model, IDS)
    assert torch.equal(kept, per_call)
    qkv = model.model.layers[0].self_attn.qkv_proj.parts[0]
    assert qkv.kept_dense is not None and prompt_logits(model, IDS).equal(kept)
    assert layers._KEPT["bytes"] > before
    del model, qkv
    gc.collect()
    assert layers._KEPT["bytes"] == before


def test_data_free_methods_ask_for_eight_calibration_rows(tiny, monkeypatch):
    """RTN and dynamic FP8 only measure the per-layer error: they ask for 8 rows (the built-in text
    generates what is asked, minutes on a CPU), AWQ for the default 32."""
    import fitllm.quant.calibration as calibration

    asked = []
    real = calibration.load_calibration

    def spy(folder, tok, samples, length, calib=None, model_loader=None, progress=False):
        asked.append(samples)
        return real(folder, tok, samples, length, calib, model_loader, progress)

    monkeypatch.setattr(calibration, "load_calibration", spy)
    for name, method in (("cal-rtn", "rtn"), ("cal-fp8", "fp8"), ("cal-awq", "awq")):
        convert(tiny, name, method, calib_samples=32)
    assert asked == [8, 8, 32]


def test_a_killed_runs_leftovers_are_removed_by_the_next_run(tiny):
    """SIGKILL runs no cleanup: the next convert to the same output removes the dead run's temp folder
    (its pid is gone) and leaves a live process's alone."""
    import subprocess
    import sys

    root = tiny[0]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = root / f".again.tmp-{dead}"
    (stale / "part-00000.safetensors").parent.mkdir()
    (stale / "part-00000.safetensors").write_bytes(b"half a shard")
    live = root / f".again.tmp-{os.getppid()}"  # the test runner's parent: alive
    live.mkdir()
    convert(tiny, "again", "rtn")
    assert (root / "again" / "config.json").exists()
    assert not stale.exists() and live.exists()
    live.rmdir()
    mask = os.umask(0)
    os.umask(mask)  # safetensors writes 0600; the checkpoint gets the modes the umask gives other files
    assert (root / "again" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask


def test_cli_errors_are_one_line(tiny):
    from typer.testing import CliRunner

    from fitllm.cli.main import app

    root, model, _ = tiny
    res = CliRunner().invoke(app, ["convert", str(model), "--method", "nope", "-o", str(root / "cli")])
    assert res.exit_code == 1
    assert "unknown method" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("head_bits", [4, 8])
def test_quantized_lm_head_round_trip(tiny, monkeypatch, head_bits):
    """--quantize-lm-head (GPTQ format): the tied table becomes a GPTQ-quantized lm_head next to the
    dense embeddings, recorded as `lm_head: true` (8 bits under 4-bit layers: a `dynamic` rule);
    loading serves exactly the weight the pipeline measured, and the logits stay close to the
    dense model's."""
    from safetensors import safe_open

    from fitllm.quant.formats import gptq as gptq_format
    from fitllm.quant.layers import QuantLinear

    from fitllm.quant import pipeline

    written, hessians = [], []
    real_write = gptq_format.write
    monkeypatch.setattr(gptq_format, "write", lambda qw: written.append(qw) or real_write(qw))

    class Seen(pipeline.HessianAccumulator):
        def __init__(self, *args):
            super().__init__(*args)
            hessians.append(self)

    monkeypatch.setattr(pipeline, "HessianAccumulator", Seen)
    r = convert(tiny, f"gptq-head{head_bits}", "gptq", fmt="gptq", group_size=32, lm_head_bits=head_bits)
    # the head's Hessian (the last made) holds every calibration token, 8 rows of 64, not one (a bug
    # until 2026-12-07)
    assert hessians[-1].n == 8 * 64
    raw = json.loads((r.output / "config.json").read_text())
    assert raw["quantization_config"]["lm_head"] is True and raw["tie_word_embeddings"] is False
    assert raw["quantization_config"].get("dynamic") == ({"+:lm_head": {"bits": 8}} if head_bits == 8 else None)
    # asymmetric v1: GPTQModel's loader wants its v1 convention named in the producers (test_quant_formats)
    qc = raw["quantization_config"]
    assert qc["sym"] is False and "gptqmodel:0.9.0" in qc["meta"]["quantizer"]
    with safe_open(str(r.output / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"lm_head.qweight", "lm_head.scales", "lm_head.qzeros", "model.embed_tokens.weight"} <= names
    assert "lm_head.weight" not in names
    loaded = load_quantized_model(r.output)
    assert isinstance(loaded.lm_head, QuantLinear) and loaded.lm_head.parts[0].bits == head_bits
    assert all(p.bits == 4 for p in loaded.model.layers[0].mlp.gate_up_proj.parts)
    assert torch.equal(loaded.lm_head.dequantized_weight(), written[-1].dequantize())  # the last matrix written
    assert 0 < r.lm_head_error < (0.2 if head_bits == 4 else 0.02)
    dense_head = convert(tiny, f"gptq-dense-head{head_bits}", "gptq", fmt="gptq", group_size=32)
    assert json.loads((dense_head.output / "config.json").read_text())["quantization_config"]["lm_head"] is False
    ref = tiny[2]
    assert rel_err(prompt_logits(loaded, IDS), ref) < rel_err(prompt_logits(load_quantized_model(dense_head.output), IDS), ref) + 0.2


def test_quantized_lm_head_needs_the_gptq_format(tiny):
    for fmt in ("compressed-tensors", "autoawq"):
        with pytest.raises(QuantError, match="--quantize-lm-head"):
            convert(tiny, f"head-{fmt}", "rtn", fmt=fmt, lm_head_bits=4)


def test_on_the_fly_int4_can_take_the_lm_head(tiny):
    """quantize_in_memory(lm_head_bits=...) (the GPU benchmarks' int4+head[8]): a tied model gets a quantized
    copy of its table as lm_head, the table itself stays as it was (it still embeds the input)."""
    from fitllm.quant.inplace import quantize_in_memory
    from fitllm.quant.layers import QuantLinear

    for bits, tol in ((4, 0.2), (8, 0.02)):
        model = load_model(tiny[1])
        table = model.model.embed_tokens.weight.clone()
        quantize_in_memory(model, "int4", lm_head_bits=bits)
        assert isinstance(model.lm_head, QuantLinear) and torch.equal(model.model.embed_tokens.weight, table)
        assert model.lm_head.parts[0].bits == bits and model.model.layers[0].mlp.gate_up_proj.parts[0].bits == 4
        w = model.lm_head.dequantized_weight()
        assert w.shape == table.shape and 0 < rel_err(w, table) < tol
        assert rel_err(prompt_logits(model, IDS), tiny[2]) < 0.5


def test_gptq_checkpoint_with_a_dynamic_exclusion_loads(tiny):
    """A GPTQModel-style checkpoint whose `dynamic` rule keeps layer 1's MLP dense (its dense
    `weight` tensors in the file): fitllm builds dense layers there, quantized ones elsewhere."""
    from safetensors.torch import load_file, save_file

    from fitllm.models.linear import DenseLinear
    from fitllm.quant.layers import QuantLinear

    r = convert(tiny, "gptq-dynamic", "gptq", fmt="gptq", group_size=32)
    base = load_file(str(tiny[1] / "model.safetensors"))
    tensors = load_file(str(r.output / "model.safetensors"))
    mlp = "model.layers.1.mlp."
    tensors = {k: v for k, v in tensors.items() if not k.startswith(mlp)}
    tensors.update({k: v for k, v in base.items() if k.startswith(mlp)})
    save_file(tensors, str(r.output / "model.safetensors"))
    raw = json.loads((r.output / "config.json").read_text())
    raw["quantization_config"]["dynamic"] = {r"-:model\.layers\.1\.mlp\.": {}}
    (r.output / "config.json").write_text(json.dumps(raw))
    model = load_quantized_model(r.output)
    assert isinstance(model.model.layers[1].mlp.gate_up_proj, DenseLinear)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, QuantLinear)
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, QuantLinear)
    assert rel_err(prompt_logits(model, IDS), tiny[2]) < 0.5


@pytest.mark.parametrize("method,fmt", [("rtn", "compressed-tensors"), ("gptq", "gptq"), ("awq", "autoawq"),
                                        ("fp8", "compressed-tensors")])
def test_fused_checkpoint_phi3_keeps_its_names(tiny, method, fmt):
    """Phi-3 stores qkv_proj and gate_up_proj whole: every method quantizes them as one matrix and
    writes them under those names (what transformers and vLLM look for), and they load back."""
    from safetensors import safe_open

    root = tiny[0]
    base = make_tiny_phi3(root / "phi3-base") if not (root / "phi3-base").exists() else root / "phi3-base"
    ref = prompt_logits(load_model(base), IDS)
    r = quantize_model(base, root / f"phi3-{method}", method, fmt=fmt, calib=str(root / "calib.txt"), calib_samples=8,
                       calib_len=64, progress=False, log=lambda s: None)
    with safe_open(str(r.output / "model.safetensors"), framework="pt") as f:
        layer0 = {k.split(".")[4] for k in f.keys() if k.startswith("model.layers.0.")}
    assert {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} <= layer0 and not layer0 & {"q_proj", "gate_proj"}
    # loads back near the float model (this random model's fp8 error is ~0.1, int4's ~0.3); the exact check
    # of the format is the transformers parity below
    assert rel_err(prompt_logits(load_quantized_model(r.output), IDS), ref) < (0.2 if method == "fp8" else 0.5)


def test_phi3_compressed_tensors_loads_in_transformers(tiny):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    root = tiny[0]
    base = make_tiny_phi3(root / "phi3-hf-base")
    r = quantize_model(base, root / "phi3-hf-ct", "rtn", group_size=32, calib=str(root / "calib.txt"), calib_samples=8,
                       calib_len=64, progress=False, log=lambda s: None)
    hf = AutoModelForCausalLM.from_pretrained(str(r.output), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].float()
    assert (prompt_logits(load_quantized_model(r.output), IDS) - ref).abs().max() < 1e-3


@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_checkpoint_served_sorted_gets_its_input_orders_at_load(tiny, monkeypatch, bits):
    """fitllm's own act-order GPTQ checkpoint, loaded as on a GPU (layers.gpu_form: rows sorted by
    group; 4-bit tiled, 8-bit in the standard layout without g_idx; here forced on the CPU with the
    torch references): the loader moves each down_proj's input order into its gate_up
    (CausalLM.fold_input_orders), the norms hand qkv and gate_up their input in order, the paged
    attention o_proj's, so nothing is gathered, and the logits equal those of the g_idx weights
    served as stored."""
    from fitllm.kernels import fused
    from fitllm.models import decoder
    from fitllm.quant import layers
    from fitllm.quant.formats.packing import TiledWeight

    r = convert(tiny, f"gptq-act-{bits}", "gptq", fmt="gptq", bits=bits, group_size=32, act_order=True)
    want = prompt_logits(load_quantized_model(r.output), IDS)
    monkeypatch.setattr(layers, "_to_runtime", lambda p, device, dtype: layers.gpu_form(p, torch.bfloat16))
    model = load_quantized_model(r.output)
    assert all(isinstance(p, TiledWeight) and p.bits == bits and p.g_idx is None for lin in model.fused_linears().values() for p in lin.parts)
    for layer in model.model.layers:
        assert layer.mlp.down_proj.input_perm() is None  # folded into gate_up at load
        assert layer.self_attn.qkv_proj.input_perm() is not None and layer.mlp.gate_up_proj.input_perm() is not None
        assert layer.self_attn.o_proj.input_perm() is not None
    # (the attention writes o_proj's order in steps of any length here, the prompt's too)
    monkeypatch.setattr(decoder, "ATTENTION_WRITES_ORDER_UP_TO", len(IDS))
    monkeypatch.setattr(fused, "gather_columns", lambda *a: pytest.fail("an act-order layer gathered its input"))
    assert rel_err(prompt_logits(model, IDS), want) < 1e-5


def test_act_order_checkpoint_sorted_decodes_the_same_in_the_engine(tiny, monkeypatch):
    """The sorted, folded act-order model (gpu_form forced on the CPU) in the engine, decode steps
    through the CUDA-graph path emulated on the CPU (GraphContext, padded attention scattering o_proj's
    input order) and eager prefill: greedy tokens equal those of the g_idx weights served as stored."""
    from fitllm.models import decoder
    from fitllm.models.generate import generate
    from fitllm.quant import layers
    from fitllm.serve.engine import EngineConfig, LLMEngine
    from fitllm.serve.sampling import SamplingParams

    monkeypatch.setattr(decoder, "ATTENTION_WRITES_ORDER_UP_TO", 4)  # the graphs' padded steps of 3 rows too
    r = convert(tiny, "gptq-act-engine", "gptq", fmt="gptq", group_size=32, act_order=True)
    prompts = [IDS, IDS[:3], IDS[2:] + IDS[:2]]
    want = generate(load_quantized_model(r.output), prompts, 6)
    monkeypatch.setattr(layers, "_to_runtime", lambda p, device, dtype: layers.gpu_form(p, torch.bfloat16))
    model = load_quantized_model(r.output)
    assert all(lin.input_perm() is not None for name, lin in model.fused_linears().items() if "o_proj" in name)
    eng = LLMEngine(EngineConfig(max_num_batched_tokens=32, block_size=8, num_kv_blocks=64, max_model_len=128,
                                 max_num_seqs=4), model=model)
    assert eng.runner.capture_graphs(4, emulate_on_cpu=True)
    outs = eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.new_token_ids for o in outs] == want


@pytest.mark.parametrize("method,fmt", [("rtn", "compressed-tensors"), ("gptq", "gptq"), ("awq", "autoawq"),
                                        ("fp8", "compressed-tensors")])
def test_gemma3_converts_and_loads_back(tiny, method, fmt):
    """Gemma 3 through every method: its norms (stored less one) are written as they were read, and
    AWQ folds the MLP's scales into the norm before the MLP (pre_feedforward_layernorm, not the
    sandwich norm on the attention's output): the result loads back near the float model."""
    from safetensors import safe_open

    root = tiny[0]
    base = root / "gemma3-base"
    if not base.exists():
        make_tiny_gemma3(base)
    ref = prompt_logits(load_model(base), IDS)
    r = quantize_model(base, root / f"gemma3-{method}", method, fmt=fmt, calib=str(root / "calib.txt"),
                       calib_samples=8, calib_len=64, progress=False, log=lambda s: None)
    names = ("model.layers.1.post_attention_layernorm.weight", "model.layers.1.post_feedforward_layernorm.weight",
             "model.norm.weight")
    with safe_open(str(base / "model.safetensors"), framework="pt") as a, \
            safe_open(str(r.output / "model.safetensors"), framework="pt") as b:
        for name in names:  # norms no method scales
            assert torch.allclose(a.get_tensor(name), b.get_tensor(name), atol=1e-6)
        if method != "awq":
            name = "model.layers.1.pre_feedforward_layernorm.weight"
            assert torch.allclose(a.get_tensor(name), b.get_tensor(name), atol=1e-6)
    assert rel_err(prompt_logits(load_quantized_model(r.output), IDS), ref) < (0.2 if method == "fp8" else 0.5)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq"])
def test_multimodal_rules_in_the_checkpoints_own_names(tiny, fmt):
    """A multimodal checkpoint quantized as llm-compressor / GPTQModel write one keeps its own names
    (language_model.model.layers... or model.language_model.layers...), and so do its rules: a text layer left dense by an ignore entry (or a
    `-:` dynamic rule) in that spelling loads dense, exactly as with the text model's spelling."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    from fitllm.models.linear import DenseLinear
    from fitllm.models.loader import text_model_name
    from fitllm.quant.formats import compressed_tensors, gptq
    from fitllm.quant.layers import QuantLinear
    from fitllm.quant.rtn import rtn_quantize
    from fitllm.quant.scheme import QuantScheme

    root = tiny[0]
    base = root / "gemma3-mm-rules"
    if not base.exists():
        make_tiny_gemma3(base, multimodal=True)
    writer = compressed_tensors if fmt == "compressed-tensors" else gptq
    scheme = QuantScheme("rtn", bits=4, group_size=32, sym=True)
    dense_one = "language_model.model.layers.0.mlp.down_proj"  # (transformers saves the older spelling)
    tensors = {}
    for name, w in load_file(str(base / "model.safetensors")).items():
        module, text = name.removesuffix(".weight"), text_model_name(name)
        if text and ".layers." in text and name.endswith("_proj.weight") and module != dense_one:
            tensors.update({f"{module}.{k}": v for k, v in writer.write(rtn_quantize(w.float(), scheme)).items()})
        else:
            tensors[name] = w
    config = json.loads((base / "config.json").read_text())

    def checkpoint(rule_name: str) -> Path:
        qc = writer.quantization_config(scheme)
        if fmt == "compressed-tensors":
            qc["ignore"] = ["lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*", rule_name]
        else:
            qc["dynamic"] = {"-:" + re.escape(rule_name): {}}
        folder = root / f"gemma3-mm-rules-{fmt}-{re.sub(r'[^a-z0-9]', '_', rule_name)}"
        folder.mkdir(exist_ok=True)
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(base / f, folder / f)
        return folder

    own = load_quantized_model(checkpoint(dense_one))
    text = load_quantized_model(checkpoint("model.layers.0.mlp.down_proj"))
    for model in (own, text):
        mlp = model.model.layers[0].mlp
        assert isinstance(mlp.down_proj, DenseLinear) and isinstance(mlp.gate_up_proj, QuantLinear)
    logits = prompt_logits(own, IDS)
    assert torch.equal(logits, prompt_logits(text, IDS))
    assert rel_err(logits, prompt_logits(load_model(base), IDS)) < 0.5
    with pytest.raises(ModelLoadError, match="layers.0.mlp.down_proj: stored dense"):  # a rule naming no module
        load_quantized_model(checkpoint("language_model.model.layers.0.mlp.down_proj_x"))


@pytest.mark.parametrize("model", ["gemma3", "gemma3-mm", "mistral3-mm", "smollm3"])
def test_newer_families_compressed_tensors_load_in_transformers(tiny, model):
    """The converted Gemma 3 and SmolLM3 (a layer without RoPE) in transformers: the same logits as
    fitllm's. A multimodal checkpoint (Gemma 3 4B-27B, Mistral Small 3.x) comes out as its language
    model alone, near the float model's text logits."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    root = tiny[0]
    base = root / f"{model}-hf"
    if model == "mistral3-mm":
        make_tiny_mistral3(base)
    elif model == "smollm3":
        make_tiny_smollm3(base)
    else:
        make_tiny_gemma3(base, multimodal=model == "gemma3-mm")
    r = quantize_model(base, root / f"{model}-hf-ct", "rtn", group_size=32, calib=str(root / "calib.txt"),
                       calib_samples=8, calib_len=64, progress=False, log=lambda s: None)
    config = json.loads((r.output / "config.json").read_text())
    text_arch = {"mistral3-mm": "MistralForCausalLM", "smollm3": "SmolLM3ForCausalLM"}.get(model, "Gemma3ForCausalLM")
    assert config["architectures"] == [text_arch] and "vision_config" not in config
    hf = AutoModelForCausalLM.from_pretrained(str(r.output), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].float()
    ours = prompt_logits(load_quantized_model(r.output), IDS)
    assert (ours - ref).abs().max() < 1e-3
    assert rel_err(ours, prompt_logits(load_model(base), IDS)) < 0.5
