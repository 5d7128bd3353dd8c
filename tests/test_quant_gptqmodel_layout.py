"""A checkpoint laid out the way GPTQModel 7.7 writes one (tensors built by hand, no GPTQModel):
per-module `dynamic` rules of each kind (`-:` dense, `+:` and bare regex overrides of bits /
group_size / sym / desc_act, its default `lm_head` rule), an untied quantized lm_head next to the
dense bf16 embedding, act-order g_idx, and asymmetric zero points of 0 in v1's word-wise offset.
fitllm must build every module with the layout the rules give and dequantize it exactly."""
import json

import torch
from safetensors.torch import load_file, save_file

from fitllm.models.linear import DenseLinear
from fitllm.quant.formats import gptq
from fitllm.quant.formats.packing import pack_dim0
from fitllm.quant.layers import QuantLinear, load_quantized_model, shard_names

from quant_fixtures import gptqmodel_v1_qzeros, make_tiny_model

# as GPTQModel writes it (quantize_config.json / config.json), negative rules first
QC = {"bits": 4, "group_size": 64, "desc_act": False, "sym": True, "lm_head": True, "method": "gptq",
      "quant_method": "gptq", "format": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32",
      "dynamic": {r"-:^model\.layers\.0\.self_attn\.": {},
                  r"+:^model\.layers\.1\.mlp\.down_proj$": {"bits": 8},
                  r"+:^model\.layers\.[01]\.mlp\.": {"group_size": 32},
                  r"^model\.layers\.1\.self_attn\.[qkv]_proj$": {"sym": False, "desc_act": True},
                  "lm_head": {"bits": 8, "group_size": 32, "sym": True, "desc_act": False, "mse": 2.4}},
      "meta": {"quantizer": ["gptqmodel:7.7.0"], "act_group_aware": True}}


def gptqmodel_v1_tensors(n, k, cfg, gen):
    """Random codes in GPTQModel's v1 export (gptqmodel_v1_qzeros)."""
    bits, group = int(cfg["bits"]), int(cfg["group_size"])
    g = k // group
    q = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int32)
    if cfg["sym"]:
        zero = torch.full((g, n), 1 << (bits - 1), dtype=torch.int32)
    else:
        zero = torch.randint(0, 1 << bits, (g, n), generator=gen, dtype=torch.int32)
        zero[:, :: 3] = 0
    g_idx = (torch.randperm(k, generator=gen) if cfg["desc_act"] else torch.arange(k)) // group
    scales = (torch.rand(g, n, generator=gen) * 0.01 + 0.001).half()
    qzeros = gptqmodel_v1_qzeros(zero, bits)
    expect = ((q - zero[g_idx]).float() * scales.float()[g_idx]).t()  # [N, K]
    return {"qweight": pack_dim0(q, bits), "qzeros": qzeros, "scales": scales,
            "g_idx": g_idx.to(torch.int32)}, expect


def test_gptqmodel_layout_loads_module_by_module(tmp_path):
    base = make_tiny_model(tmp_path / "base")
    dense = load_file(str(base / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    out, expect = {}, {}
    dense["lm_head.weight"] = dense["model.embed_tokens.weight"].clone()  # GPTQModel needs it untied
    for name, w in dense.items():
        module = name.removesuffix(".weight")
        cfg = gptq.module_config(QC, module) if w.dim() == 2 and module != "model.embed_tokens" else None
        if cfg is None:
            out[name] = w.to(torch.bfloat16)  # GPTQModel saves the rest in bf16
            expect[module] = w.to(torch.bfloat16).float()
            continue
        t, expect[module] = gptqmodel_v1_tensors(w.shape[0], w.shape[1], cfg, gen)
        out.update({f"{module}.{s}": v for s, v in t.items()})
    folder = tmp_path / "gptqmodel"
    folder.mkdir()
    save_file(out, str(folder / "model.safetensors"))
    config = json.loads((base / "config.json").read_text())
    config.update(tie_word_embeddings=False, torch_dtype="bfloat16", quantization_config=QC)
    (folder / "config.json").write_text(json.dumps(config))

    model = load_quantized_model(folder, "cpu", torch.float32)
    seen = set()
    for name, mod in model.named_modules():
        if not isinstance(mod, (QuantLinear, DenseLinear)):
            continue
        shards = shard_names(name, len(mod.out_sizes))
        seen.update(shards)
        ref = torch.cat([expect[s] for s in shards])
        if isinstance(mod, DenseLinear):
            assert all(gptq.module_config(QC, s) is None for s in shards), name
            assert torch.equal(mod.weight, ref), name
            continue
        cfgs = [gptq.module_config(QC, s) for s in shards]
        assert [(p.bits, p.group_size, p.g_idx is not None) for p in mod.parts] in (
            [(int(c["bits"]), int(c["group_size"]), bool(c["desc_act"])) for c in cfgs],  # one GEMM per shard
            [(int(cfgs[0]["bits"]), int(cfgs[0]["group_size"]), bool(cfgs[0]["desc_act"]))]), name  # merged
        assert torch.equal(mod.dequantized_weight(), ref), name
    assert seen == {m for m in expect if m != "model.embed_tokens" and expect[m].dim() == 2}
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.parts[0].bits == 8
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, DenseLinear)
    assert model.model.layers[1].mlp.down_proj.parts[0].bits == 8
    assert model.model.layers[1].mlp.gate_up_proj.parts[0].group_size == 32
    assert torch.equal(model.model.embed_tokens.weight, expect["model.embed_tokens"])
    h = torch.randn(3, config["hidden_size"])
    assert torch.allclose(model.compute_logits(h), h @ expect["lm_head"].t(), atol=1e-5)
