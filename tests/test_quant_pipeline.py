"""Quantizing a tiny random Llama end to end: each method, each format, loading back,
transformers parity for compressed-tensors, and bad input."""
import json
from pathlib import Path

import pytest
import torch

from fitllm.models.generate import prompt_logits
from fitllm.models.loader import load_model
from fitllm.quant.layers import load_quantized_model
from fitllm.quant.pipeline import quantize_model
from fitllm.quant.scheme import QuantError

from quant_fixtures import CALIB_TEXT, make_tiny_model

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


def test_interrupted_run_leaves_nothing(tiny, monkeypatch):
    import fitllm.quant.pipeline as pipeline

    root = tiny[0]
    calls = []

    def boom(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return pipeline.step_rtn(*a, **k)

    monkeypatch.setitem(pipeline.STEPS, "rtn", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny, "interrupted", "rtn")
    assert not (root / "interrupted").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".interrupted")]


def test_cli_errors_are_one_line(tiny):
    from typer.testing import CliRunner

    from fitllm.cli.main import app

    root, model, _ = tiny
    res = CliRunner().invoke(app, ["convert", str(model), "--method", "nope", "-o", str(root / "cli")])
    assert res.exit_code == 1
    assert "unknown method" in res.output and "Traceback" not in res.output
