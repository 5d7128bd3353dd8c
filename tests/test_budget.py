"""The memory model against hand calculations, and `quant memory` end to end (CPU, fast)."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from fitllm import budget as bm
from fitllm.cli.main import app
from fitllm.models.errors import FitLLMError

LLAMA3 = bm.known_model("llama-3-8b")  # vocab 128256, hidden 4096, MLP 14336, 32 layers, 32 q / 8 kv heads of 128
SMOL = bm.known_model("smollm2-135m")  # vocab 49152, hidden 576, MLP 1536, 30 layers, 9 q / 3 kv heads of 64, tied
runner = CliRunner()


# ---------------------------------------------------------------- KV cache
def test_kv_bytes_per_token_llama3():
    # K and V x 32 layers x 8 KV heads (not 32 query heads) x 128 dims x bytes
    assert bm.kv_bytes_per_token(LLAMA3, "bf16") == 2 * 32 * 8 * 128 * 2 == 131072
    assert bm.kv_bytes_per_token(LLAMA3, "auto") == 131072
    assert bm.kv_bytes_per_token(LLAMA3, "fp8") == 2 * 32 * 8 * 128 * 1 == 65536
    # int8: 128 B of values + an fp16 scale per (token, kv head)
    assert bm.kv_bytes_per_token(LLAMA3, "int8") == 2 * 32 * 8 * (128 + 2) == 66560
    # int4 asymmetric: 64 B of nibbles + an fp16 scale and zero per 16 channels of a key (8 groups
    # of 128) and per 32 channels of a value (4 groups)
    assert bm.kv_bytes_per_token(LLAMA3, "int4") == 32 * 8 * ((64 + 4 * 8) + (64 + 4 * 4)) == 45056


def test_kv_bytes_per_token_smollm2():
    assert bm.kv_bytes_per_token(SMOL, "bf16") == 2 * 30 * 3 * 64 * 2 == 23040


def test_kv_rounds_up_to_whole_blocks():
    assert bm.kv_cache_bytes(LLAMA3, "bf16", 16, block_size=16) == 16 * 131072
    assert bm.kv_cache_bytes(LLAMA3, "bf16", 17, block_size=16) == 2 * 16 * 131072
    assert bm.kv_cache_bytes(LLAMA3, "fp8", 8192, block_size=16) == 512 * 16 * 65536 == 512 * bm.MiB
    # 1 GiB / (16 tokens x 128 KiB) = 512 blocks; anything short of a block is not a block
    assert bm.kv_cache_blocks_for(bm.GiB, LLAMA3, "bf16", 16) == 512
    assert bm.kv_cache_blocks_for(bm.GiB - 1, LLAMA3, "bf16", 16) == 511
    assert bm.kv_cache_blocks_for(-5, LLAMA3) == 0


def test_unknown_kv_dtype_is_a_clear_error():
    with pytest.raises(FitLLMError, match="int4"):
        bm.kv_bytes_per_token(LLAMA3, "int3")


# ---------------------------------------------------------------- weights
LLAMA3_PARAMS_PER_LAYER = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q,o + k,v + gate,up,down
EMBED = 128256 * 4096
NORMS = (2 * 32 + 1) * 4096


def test_llama3_bf16_weights():
    w = bm.weight_bytes(LLAMA3, "bf16")
    assert LLAMA3_PARAMS_PER_LAYER * 32 + 2 * EMBED + NORMS == 8_030_261_248  # the published 8.03B
    assert w.total == 2 * 8_030_261_248


def test_llama3_awq_int4_g128_weights_by_hand():
    # As fitllm holds a k->n linear on the GPU (KernelWeight, after repacking any int4 layout):
    # int4 weights k*n/2 bytes, and per group of 128 inputs a bf16 scale and a bf16 zero per output.
    # (On disk AWQ packs the zeros in 4 bits and keeps fp16 scales: 3,625,975,808 B of linears.)
    def awq(k, n):
        return k * n // 2 + (k // 128) * n * 2 + (k // 128) * n * 2

    q = o = 4096 * 4096 // 2 + 32 * 4096 * 2 + 32 * 4096 * 2  # 8,388,608 + 262,144 + 262,144
    k = v = 4096 * 1024 // 2 + 32 * 1024 * 2 + 32 * 1024 * 2  # 2,097,152 + 65,536 + 65,536
    gate = up = 4096 * 14336 // 2 + 32 * 14336 * 2 + 32 * 14336 * 2  # 29,360,128 + 917,504 + 917,504
    down = 14336 * 4096 // 2 + 112 * 4096 * 2 + 112 * 4096 * 2  # 112 groups along k = 14336
    assert (q, k, gate, down) == (8_912_896, 2_228_224, 31_195_136, 31_195_136) == (
        awq(4096, 4096), awq(4096, 1024), awq(4096, 14336), awq(14336, 4096))
    layer = q + o + k + v + gate + up + down
    assert layer == 115_867_648
    w = bm.weight_bytes(LLAMA3, "awq")
    assert w.linears == 32 * layer == 3_707_764_736
    assert w.embeddings == w.lm_head == 2 * EMBED == 1_050_673_152  # both stay bf16
    assert w.norms_biases == 2 * NORMS == 532_480
    assert w.total == 5_809_643_520  # 5.41 GiB, vs 14.96 GiB in bf16


def test_other_schemes_by_hand():
    p = LLAMA3_PARAMS_PER_LAYER * 32
    # fp8 per channel: 1 byte per weight + an fp32 scale per output row of each checkpoint matrix
    rows = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)
    assert bm.weight_bytes(LLAMA3, "fp8").linears == p + 4 * rows
    # nf4: half a byte per weight + one fp16 absmax per 64 weights (CodebookWeight as served)
    assert bm.weight_bytes(LLAMA3, "nf4").linears == p // 2 + 2 * p // 64
    # gptq = awq + an int32 g_idx per input row of each fused GEMM: qkv, o, gate|up (4096 each), down (14336)
    in_rows = 32 * (4096 * 3 + 14336)
    assert bm.weight_bytes(LLAMA3, "gptq").linears == bm.weight_bytes(LLAMA3, "awq").linears + 4 * in_rows


def test_smollm2_weights_tied_and_group_64():
    assert bm.default_group_size(SMOL) == 64  # 576 is not a multiple of 128 (DESIGN.md)
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    w = bm.weight_bytes(SMOL, "bf16")
    assert w.lm_head == 0 and w.embeddings == 2 * 49152 * 576
    assert w.total == 2 * (30 * per_layer + 49152 * 576 + 61 * 576) == 2 * 134_515_008
    # tied: the one table is both the input gather and the lm_head a decode step streams
    assert w.read_per_step == w.total


def test_a_quantized_lm_head_counts_as_int4():
    """GPTQ `lm_head: true`: the head is a 4096 -> 128256 int4 GEMM (+ its g_idx); the embedding
    table stays bf16 and, tied or not, is no longer what a decode step streams."""
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}
    head = 4096 * 128256 // 2 + 32 * 128256 * 2 * 2 + 4 * 4096  # words, bf16 scales and zeros, g_idx
    for tied in (False, True):
        w = bm.weight_bytes(replace(LLAMA3, quantization_config=gptq, tie_word_embeddings=tied), "gptq")
        assert w.lm_head == head and w.embeddings == 2 * EMBED
        assert w.read_per_step == w.linears + head + w.norms_biases
    assert bm.weight_bytes(replace(LLAMA3, quantization_config={**gptq, "lm_head": False}), "gptq").lm_head == 2 * EMBED
    # an 8-bit head through a GPTQModel `dynamic` rule: a byte per weight (tiled: K padded to 128, here none)
    head8 = {**gptq, "dynamic": {"+:lm_head": {"bits": 8}}}
    assert bm.weight_bytes(replace(LLAMA3, quantization_config=head8), "gptq").lm_head == \
        4096 * 128256 + 32 * 128256 * 2 * 2 + 4 * 4096


def test_detect_scheme_from_checkpoint_config():
    cfg = replace(LLAMA3, quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128})
    assert bm.detect_scheme(cfg) == "awq" and bm.checkpoint_bits(cfg) == 4
    ct = {"quant_method": "compressed-tensors",
          "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}}}
    assert bm.detect_scheme(replace(LLAMA3, quantization_config=ct)) == "fp8"
    ct["config_groups"]["group_0"]["weights"] = {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 128}
    assert bm.detect_scheme(replace(LLAMA3, quantization_config=ct)) == "awq"  # int8 groups: awq's bytes at 8 bits
    assert bm.checkpoint_bits(replace(LLAMA3, quantization_config=ct)) == 8
    gptq8 = replace(LLAMA3, quantization_config={"quant_method": "gptq", "bits": 8, "group_size": 128})
    assert bm.detect_scheme(gptq8) == "gptq" and bm.checkpoint_bits(gptq8) == 8
    assert bm.detect_scheme(LLAMA3) == "bf16" and bm.checkpoint_bits(LLAMA3) == 4


def test_gptq_int8_layers_by_hand():
    """GPTQ int8 (e.g. the published *-GPTQ-Int8 checkpoints): a byte per weight in the tiled layout (K
    padded to 128), bf16 scales and zeros per group of 128, the act-order int32 per input row; on Hopper
    8-bit GEMMs take the warp-specialised kernel up to 2048 tokens a step and dequantize from 2049."""
    def gptq8(k, n):
        return -(-k // 128) * 128 * n + 2 * (k // 128) * n * 2

    layer = 2 * gptq8(4096, 4096) + 2 * gptq8(4096, 1024) + 2 * gptq8(4096, 14336) + gptq8(14336, 4096)
    in_rows = 4096 * 3 + 14336
    w = bm.weight_bytes(LLAMA3, "gptq", 128, bits=8)
    assert w.linears == 32 * (layer + 4 * in_rows)
    # against int4: the same scales, zeros and g_idx; half a byte more per weight
    assert w.linears - bm.weight_bytes(LLAMA3, "gptq", 128).linears == 32 * LLAMA3_PARAMS_PER_LAYER // 2
    assert bm.dequant_min_tokens(LLAMA3, 128, "sm90", bits=8) == 2049
    assert bm.dequant_min_tokens(LLAMA3, 64, "sm90", bits=8) == 257  # groups of 64: not the ws kernel's
    s = bm.Settings(scheme="gptq", bits=8, max_model_len=8192, max_num_seqs=128, group_size=128, gpu_arch="sm90")
    terms = bm.estimate(LLAMA3, s, 140 * bm.GiB).terms
    assert terms["weights"] == w.total
    ws = bm.attention_workspace_bytes(LLAMA3, 128, 8192, 2048, s.attention)
    assert terms["activations"] == bm.activation_bytes(LLAMA3, 2048, 128, "gptq", ws, dequant_from=2049)


# ---------------------------------------------------------------- activations, whole budget
def test_activation_peak_llama3_by_hand():
    t = 2048
    residual = 3 * t * 4096 * 2
    rope_tables = t * 128 * 4
    mlp = t * (2 * 14336 + 14336 + 14336) * 2  # gate|up, silu(gate), product (bigger than attention here)
    logits = t * 4096 * 2 + 64 * 128256 * 22  # hidden states + sampler buffers of 64 sampled rows
    assert bm.activation_bytes(LLAMA3, t, 64) == max(residual + rope_tables + mlp, logits) == 286_261_248
    # W4A16 at large M may dequantize the fused gate|up weight (4096 x 2*14336, bf16) for cuBLAS
    assert bm.activation_bytes(LLAMA3, t, 64, "awq") == residual + rope_tables + mlp + 4096 * 2 * 14336 * 2
    # a vocabulary-heavy case: many sampled rows make the logits the peak
    assert bm.activation_bytes(LLAMA3, 512, 512) == 512 * 4096 * 2 + 512 * 128256 * 22


def test_dequant_transient_follows_the_cards_tile_tables():
    """A 4-bit GEMM dequantizes its weight to bf16 (a transient of the gate|up's size) only from the
    step size its kernel table says: on Hopper the warp-specialised kernel takes Llama-3-8B's shapes up
    to 3072 tokens (a default 2048-token step needs no copy), elsewhere the tiled rows stop at 64 (so
    decode graphs of 65+ sequences hold one: the graph pool must count it)."""
    gate_up = 4096 * 2 * 14336 * 2
    assert bm.dequant_min_tokens(LLAMA3, 128, "sm90") == 3073
    assert bm.dequant_min_tokens(LLAMA3, 128, "sm89") == bm.dequant_min_tokens(LLAMA3) == 65
    assert bm.dequant_min_tokens(SMOL, 64, "sm90") == 257  # 576-wide: no whole 128-row blocks, groups of 64
    assert bm.dequant_min_tokens(LLAMA3, -1, "sm90") == 3073  # per channel
    assert bm.dequant_min_tokens(LLAMA3, 64, "sm90") == 257  # groups of 64: not the ws kernel's
    no_dq = bm.activation_bytes(LLAMA3, 2048, 64, "bf16")
    assert bm.activation_bytes(LLAMA3, 2048, 64, "awq", dequant_from=3073) == no_dq
    assert bm.activation_bytes(LLAMA3, 2048, 64, "awq", dequant_from=2048) == no_dq + gate_up
    s = bm.Settings(scheme="awq", max_model_len=8192, max_num_seqs=128, group_size=128)
    h200 = bm.estimate(LLAMA3, replace(s, gpu_arch="sm90"), 140 * bm.GiB).terms
    ada = bm.estimate(LLAMA3, replace(s, gpu_arch="sm89"), 140 * bm.GiB).terms
    ws = bm.attention_workspace_bytes(LLAMA3, 128, 8192, 2048, s.attention)
    assert h200["activations"] == bm.activation_bytes(LLAMA3, 2048, 128, "awq", ws, dequant_from=3073)
    assert ada["activations"] == bm.activation_bytes(LLAMA3, 2048, 128, "awq", ws, dequant_from=65) > h200["activations"]
    graph_ws = bm.attention_workspace_bytes(LLAMA3, 128, 8192, 128, s.graph_attention)
    assert h200["cuda_graphs"] == bm.activation_bytes(LLAMA3, 128, 0, "bf16", graph_ws)
    # NF4 dequantizes from codebook4.DEQUANT_FROM_M rows on, on any card
    from fitllm.kernels.codebook4 import DEQUANT_FROM_M
    for t in (DEQUANT_FROM_M - 1, DEQUANT_FROM_M, 2048):
        plain = bm.activation_bytes(LLAMA3, t, 0, "bf16")
        assert bm.activation_bytes(LLAMA3, t, 0, "nf4") == plain + (gate_up if t >= DEQUANT_FROM_M else 0)
    # the batch-128 graph dequantizes on sm89: the copy lives while the MLP runs
    assert ada["cuda_graphs"] == bm.activation_bytes(LLAMA3, 128, 0, "awq", graph_ws, dequant_from=65) \
        == 3 * 128 * 4096 * 2 + 128 * 128 * 4 + 4 * 128 * 14336 * 2 + gate_up
    graph_ws = bm.attention_workspace_bytes(LLAMA3, 64, 8192, 64, s.graph_attention)
    small = bm.estimate(LLAMA3, replace(s, max_num_seqs=64, gpu_arch="sm89"), 140 * bm.GiB).terms
    assert small["cuda_graphs"] == bm.activation_bytes(LLAMA3, 64, 0, "bf16", graph_ws)  # 64 tokens: no copy
    # the group size the threshold is read at: a compressed-tensors checkpoint states it per weight group
    ct = {"quant_method": "compressed-tensors",
          "config_groups": {"group_0": {"weights": {"num_bits": 4, "strategy": "group", "group_size": 32}}}}
    assert bm.checkpoint_group_size(replace(LLAMA3, quantization_config=ct)) == 32
    ct["config_groups"]["group_0"]["weights"] = {"num_bits": 4, "strategy": "channel"}
    assert bm.checkpoint_group_size(replace(LLAMA3, quantization_config=ct)) == -1
    assert bm.checkpoint_group_size(replace(LLAMA3, quantization_config={"quant_method": "gptq", "group_size": 64})) == 64
    assert bm.checkpoint_group_size(LLAMA3) is None
    # a catalog card brings its architecture to the plan
    plan = bm.plan(LLAMA3, s, bm.find_gpu("h200").memory_bytes, bm.find_gpu("h200"))
    assert plan.budget.settings.gpu_arch == "sm90" and plan.budget.terms["activations"] == h200["activations"]


def test_attention_workspace_by_hand():
    # today's torch fallback in the decode graphs: every sequence's K/V padded to the context,
    # K and V repeated from 8 KV heads to 32 query heads, plus a bool mask
    padded = 64 * (8192 * (2 * 1024 + 2 * 4096) * 2 + 8192)
    assert bm.attention_workspace_bytes(LLAMA3, 64, 8192, 64, "padded") == padded  # 10 GiB: no graphs at this size
    # fused Triton decode: 16 splits of 512 tokens, fp32 partial output + max + sum per query head
    assert bm.attention_workspace_bytes(LLAMA3, 64, 8192, 64, "fused") == 64 * 32 * 16 * (128 + 2) * 4
    s = bm.Settings(max_model_len=8192, graph_attention="padded")
    assert bm.estimate(LLAMA3, s, 80 * bm.GiB).terms["cuda_graphs"] > padded


def test_estimate_fills_the_card_and_answers_fit_questions():
    s = bm.Settings(scheme="awq", kv_dtype="bf16", max_model_len=8192, max_num_seqs=64)
    b = bm.estimate(LLAMA3, s, 24 * bm.GiB)
    assert b.terms["weights"] == 5_809_643_520 and b.terms["cuda_context"] == 768 * bm.MiB
    assert b.total <= b.usable < b.total + 16 * 131072  # KV takes what is left, short of one block
    assert b.max_seqs_at(8192) == b.num_kv_blocks // 512
    assert b.longest_context_at(64) == b.num_kv_blocks // 64 * 16
    assert b.longest_context_at(1) == 8192  # capped by the model's own limit
    assert b.torch_peak == b.total - b.terms["cuda_context"] - b.terms["allocator_slack"]
    assert b.fits
    # the server passes its real block count to predict its peak
    assert bm.estimate(LLAMA3, s, 24 * bm.GiB, num_kv_blocks=100).kv_cache == 100 * 16 * 131072


def test_decode_roofline():
    b = bm.estimate(LLAMA3, bm.Settings(scheme="awq", max_model_len=8192), 24 * bm.GiB)
    step = b.weights.read_per_step + 4 * 2048 * 131072  # weights once + each sequence's KV
    assert b.weights.read_per_step == 5_809_643_520 - 1_050_673_152  # the embedding table is gathered, not read
    assert bm.decode_tokens_per_s(b, 1008, 4, 2048) == pytest.approx(4 * 1008e9 * bm.BANDWIDTH_EFFICIENCY / step)


def test_plan_does_not_fit_suggests_commands_that_fit():
    s = bm.Settings(scheme="bf16", max_model_len=8192)
    gpu = bm.find_gpu("rtx3060")
    p = bm.plan(LLAMA3, s, gpu.memory_bytes, gpu, "llama-3-8b")
    assert not p.budget.fits and p.command is None
    assert {"fp8", "awq"} <= {a.get("scheme") for a in p.alternatives}
    assert all("fp8" != a.get("kv_dtype") for a in p.alternatives)  # no FP8 on Ampere: int8 instead
    for a in p.alternatives:  # every suggested command fits by the same model
        changes = {k: a[k] for k in ("scheme", "kv_dtype", "max_model_len", "max_num_seqs") if k in a}
        assert bm.estimate(LLAMA3, replace(s, **changes), gpu.memory_bytes).fits, a
        converted = "scheme" in a  # another scheme is another checkpoint: convert, then serve that
        assert a["command"].startswith("quant serve CONVERTED_DIR " if converted else "quant serve llama-3-8b ")


def test_plan_fits_gives_a_command():
    gpu = bm.find_gpu("rtx4090")
    p = bm.plan(LLAMA3, bm.Settings(scheme="awq", max_model_len=8192), gpu.memory_bytes, gpu, "llama-3-8b")
    n = min(64, p.budget.max_seqs_at(8192))
    assert p.command == f"quant serve llama-3-8b --kv-dtype bf16 --max-model-len 8192 --max-num-seqs {n} --gpu-memory-utilization 0.9"


def test_gpu_catalog_lookup():
    assert bm.find_gpu("RTX 4090").key == bm.find_gpu("rtx4090").key == bm.find_gpu("4090").key == "rtx4090"
    assert bm.find_gpu("NVIDIA GeForce RTX 4070 Ti SUPER").key == "rtx4070tisuper"
    assert bm.find_gpu("NVIDIA H100 80GB HBM3").key == "h100-sxm"
    assert bm.find_gpu("NVIDIA H100 PCIe").key == "h100-pcie"
    assert bm.find_gpu("Tesla T4").key == "t4" and bm.find_gpu("NVIDIA L4").key == "l4"
    assert bm.find_gpu("NVIDIA L40S").key == "l40s" and bm.find_gpu("h200").fp8
    assert not bm.find_gpu("a100-80g").fp8
    with pytest.raises(FitLLMError, match="rtx4090"):
        bm.find_gpu("voodoo5")


def test_compare_with_measured(monkeypatch):
    import torch

    b = bm.estimate(LLAMA3, bm.Settings(scheme="awq"), 24 * bm.GiB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: b.torch_peak // 2)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: b.torch_peak)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (24 * bm.GiB - b.total, 24 * bm.GiB))
    report = bm.compare_with_measured(b)
    assert report["torch_peak"]["error"] == pytest.approx(1.0, abs=1e-6)
    assert report["device_used"]["error"] == 0
    assert "predicted" in bm.format_comparison(report)


def test_config_from_gguf_metadata(tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [("add_block_count", 2), ("add_embedding_length", 64), ("add_feed_forward_length", 128),
                       ("add_head_count", 4), ("add_head_count_kv", 2), ("add_context_length", 512)]:
        getattr(w, add)(value)
    w.add_token_list([f"t{i}" for i in range(100)])
    w.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))  # no output.weight: tied
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg, _ = bm.load_config(str(path))
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (2, 2, 16, 100)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 512


def test_known_names_and_hub_ids_map_to_the_table():
    assert bm.load_config("meta-llama/Meta-Llama-3-8B-Instruct")[0] == LLAMA3
    assert bm.load_config("Qwen/Qwen2.5-7B-Instruct")[0].num_kv_heads == 4
    with pytest.raises(FitLLMError, match="known"):
        bm.load_config("no-such-model")


def test_gemma3_counts_its_four_norms_a_layer():
    """google/gemma-3-1b-it holds 999,885,952 parameters: with its sandwich norms (four a layer) and
    q/k norms the bf16 weights are exactly twice that; its KV is full on every layer (fitllm keeps the
    sliding layers' whole cache): 26 layers x 1 KV head x 256 x 2 x 2 bytes a token."""
    config = bm.load_config("google/gemma-3-1b-it")[0]
    assert config.architecture == "Gemma3ForCausalLM" and config.sandwich_norms
    assert bm.weight_bytes(config, "bf16").total == 2 * 999_885_952
    assert bm.kv_bytes_per_token(config, "bf16") == 26 * 256 * 2 * 2


# ---------------------------------------------------------------- CLI
def _json(args):
    result = runner.invoke(app, ["memory", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_cli_json_llama3_awq_on_4090():
    doc = _json(["llama-3-8b", "--gpu", "RTX 4090", "--quant", "awq", "--max-model-len", "8192"])
    assert doc["weights_bytes"]["total"] == 5_809_643_520
    assert doc["kv_bytes_per_token"] == 131072
    assert doc["fits"] and doc["needs_convert"]
    assert doc["max_seqs_at_max_model_len"] == doc["kv_blocks"] // 512
    assert doc["command"].startswith("quant serve CONVERTED_DIR --kv-dtype bf16 --max-model-len 8192")
    assert doc["gpu"]["key"] == "rtx4090" and doc["decode_tokens_per_s"]["single_seq_short_ctx"] > 0
    assert doc["total_bytes"] <= doc["usable_bytes"]


def test_cli_plans_a_quantized_lm_head():
    """--quantize-lm-head with --quant gptq: the plan counts the head at 8 (default) or 4 bits and
    says how to convert; other schemes are refused with the fix."""
    base = _json(["llama-3-8b", "--gpu", "RTX 4090", "--quant", "gptq"])["weights_bytes"]
    head8 = _json(["llama-3-8b", "--gpu", "RTX 4090", "--quant", "gptq", "--quantize-lm-head"])["weights_bytes"]
    head4 = _json(["llama-3-8b", "--gpu", "RTX 4090", "--quant", "gptq", "--quantize-lm-head", "--lm-head-bits", "4"])
    assert base["lm_head"] == 2 * EMBED
    assert head8["lm_head"] == EMBED + 32 * 128256 * 4 + 4 * 4096
    assert head4["weights_bytes"]["lm_head"] == EMBED // 2 + 32 * 128256 * 4 + 4 * 4096
    assert head8["total"] == base["total"] - 2 * EMBED + head8["lm_head"]
    result = runner.invoke(app, ["memory", "llama-3-8b", "--gpu", "rtx4090", "--quant", "gptq", "--quantize-lm-head"])
    assert "--method gptq --format gptq --quantize-lm-head --lm-head-bits 8" in " ".join(result.output.split())
    result = runner.invoke(app, ["memory", "llama-3-8b", "--gpu", "rtx4090", "--quant", "awq", "--quantize-lm-head"])
    assert result.exit_code == 1 and "--quant gptq" in result.output


def test_cli_json_does_not_fit():
    doc = _json(["llama-3-8b", "--gpu", "rtx3060"])
    assert not doc["fits"] and doc["command"] is None
    assert any(a.get("scheme") == "awq" for a in doc["alternatives"])
    doc = _json(["llama-3.1-70b", "--gpu", "rtx4090"])
    assert not doc["fits"] and not doc["alternatives"] and "h200" in doc["cards_that_fit"]


def test_cli_table_and_embedded_default():
    result = runner.invoke(app, ["memory", "--gpu", "l4", "--max-model-len", "2048"])
    assert result.exit_code == 0, result.output
    assert "SmolLM2" in result.output and "Fits" in result.output and "quant serve --kv-dtype bf16" in result.output
    assert _json(["--gpu-mem", "8"])["kv_bytes_per_token"] == 23040
    result = runner.invoke(app, ["memory", "llama-3-8b", "--gpu", "rtx3060"])
    assert "Does not fit" in result.output and "awq" in result.output


def test_cli_config_json_file_and_catalog(tmp_path, monkeypatch):
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    doc = _json([str(tmp_path / "config.json"), "--gpu-mem", "4", "--kv-dtype", "fp8"])
    assert doc["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 1
    # no --gpu and no GPU here: every card of the catalog
    from fitllm.cli import memory as memory_cli

    monkeypatch.setattr(memory_cli, "_local_gpu", lambda: (None, 0, None))
    doc = _json([str(tmp_path)])
    assert len(doc["gpus"]) == len(bm.GPUS) and all(r["fits"] for r in doc["gpus"])


def test_cli_plans_gptq_int8():
    """--quant gptq --bits 8 counts a byte per weight and says how to convert; a GPTQ int8 checkpoint
    is planned at its own bits; --bits is checked."""
    four = _json(["llama-3-8b", "--gpu", "h200", "--quant", "gptq"])["weights_bytes"]
    eight = _json(["llama-3-8b", "--gpu", "h200", "--quant", "gptq", "--bits", "8"])["weights_bytes"]
    assert eight["linears"] == bm.weight_bytes(LLAMA3, "gptq", 128, bits=8).linears > 1.8 * four["linears"]
    assert eight["lm_head"] == four["lm_head"] == 2 * EMBED
    result = runner.invoke(app, ["memory", "llama-3-8b", "--gpu", "h200", "--quant", "gptq", "--bits", "8"])
    text = " ".join(result.output.split())
    assert "weights gptq 8-bit" in text and "--method gptq --bits 8" in text
    for args, why in ((["--quant", "awq", "--bits", "8"], "--quant gptq"),
                      (["--quant", "gptq", "--bits", "3"], "4 or 8")):
        result = runner.invoke(app, ["memory", "llama-3-8b", "--gpu", "h200", *args])
        assert result.exit_code == 1 and why in result.output and "Traceback" not in result.output


def test_cli_errors_are_one_line():
    result = runner.invoke(app, ["memory", "llama-3-8b", "--gpu", "voodoo5"])
    assert result.exit_code == 1 and "rtx4090" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["memory", "llama-3-8b", "--gpu", "h200", "--quant", "int3"])
    assert result.exit_code == 1 and "nf4" in result.output
    result = runner.invoke(app, ["memory", "llama-3-8b", "--gpu", "h200", "--gpu-mem", "24"])
    assert result.exit_code == 1 and "not both" in result.output


@pytest.mark.parametrize("args,why", [
    (["--gpu", "rtx4090", "--max-model-len", "-5"], "--max-model-len -5: must be at least 1"),
    (["--gpu", "rtx4090", "--max-model-len", "0"], "--max-model-len 0: must be at least 1"),
    (["--gpu", "rtx4090", "--block-size", "0"], "--block-size 0: must be at least 1"),
    (["--gpu", "rtx4090", "--max-num-seqs", "0"], "--max-num-seqs 0: must be at least 1"),
    (["--gpu", "rtx4090", "--max-num-seqs", "-3"], "--max-num-seqs -3: must be at least 1"),
    (["--gpu", "rtx4090", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens 0: must be at least 1"),
    (["--gpu", "rtx4090", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
    (["--gpu-mem", "0"], "give the card's memory in GiB"),
])
def test_cli_refuses_numbers_that_make_no_plan(args, why):
    """Each was a ZeroDivisionError traceback or a plan (and a serve command) built on the bad number."""
    result = runner.invoke(app, ["memory", "llama-3-8b", *args])
    assert result.exit_code == 1 and why in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


def test_cli_commands_for_a_known_name_say_where_the_checkpoint_goes():
    """llama-3-8b is a shape the planner knows, not a folder `quant convert` / `quant serve` can open."""
    result = runner.invoke(app, ["memory", "llama-3-8b", "--gpu", "rtx4090", "--quant", "awq"])
    text = " ".join(result.output.split())
    assert "quant convert MODEL_DIR --method awq" in text and "quant serve CONVERTED_DIR" in text
    assert "quant convert llama-3-8b" not in text and "MODEL_DIR" in text and "hub id" in text
    assert _json(["llama-3-8b", "--gpu", "h200"])["command"].startswith("quant serve MODEL_DIR ")
    # no fit as asked, a shorter context in the same scheme: its rows serve CONVERTED_DIR, so the convert comes too
    result = runner.invoke(app, ["memory", "gemma-3-27b", "--gpu", "rtx4090", "--quant", "awq"])
    text = " ".join(result.output.split())
    assert "Does not fit" in text and "quant serve CONVERTED_DIR" in text
    assert "First convert: quant convert MODEL_DIR --method awq -o CONVERTED_DIR" in text


def test_block_size_defaults_follow_the_kv_dtype():
    """fp8 and int8 KV get 64-token blocks (their transposed values load in whole cache lines), others
    16; an explicit size always wins, and the engine and the calculator agree."""
    from fitllm.serve.engine import EngineConfig

    assert bm.Settings(kv_dtype="fp8").block_size == EngineConfig(kv_dtype="fp8").block_size == 64
    assert bm.Settings(kv_dtype="int8").block_size == EngineConfig(kv_dtype="int8").block_size == 64
    assert bm.Settings(kv_dtype="bf16").block_size == EngineConfig(kv_dtype="auto").block_size == 16
    assert bm.Settings(kv_dtype="int4").block_size == EngineConfig(kv_dtype="int4").block_size == 16
    assert bm.Settings(kv_dtype="fp8", block_size=16).block_size == EngineConfig(kv_dtype="fp8", block_size=16).block_size == 16


def test_plan_offers_quantization_at_load_for_data_free_schemes():
    result = runner.invoke(app, ["memory", "llama-3-8b", "--gpu", "rtx4090", "--quant", "nf4"])
    assert result.exit_code == 0 and "--method nf4" in result.output
    assert "--quantization nf4" in " ".join(result.output.split())
    result = runner.invoke(app, ["memory", "llama-3-8b", "--gpu", "rtx4090", "--quant", "awq"])
    assert result.exit_code == 0 and "--quantization" not in result.output  # AWQ needs its calibration


def test_split_pages_by_hand():
    """A page holds the most layers that divide the full ones and pad the sliding ones by <= 1/8;
    auto splits where the context is longer than the window."""
    def cfg(name):
        return bm.known_model(name)
    assert bm.page_geometry(cfg("gemma-3-27b")) == (5, (2, 11))  # 10 full, 52 sliding: 55 planes (g = 10: 60)
    assert bm.page_geometry(cfg("gemma-3-1b")) == (4, (1, 6))  # 4 full, 22 sliding: 24 planes (2 / 22 <= 1/8)
    g, (full, sliding) = bm.page_geometry(cfg("gemma-3-4b"))
    n_sliding = bm.sliding_layers(cfg("gemma-3-4b"))[0]
    assert full * g == cfg("gemma-3-4b").num_layers - n_sliding and 0 <= sliding * g - n_sliding <= n_sliding / 8
    assert bm.splits_kv(cfg("gemma-3-27b"), 32768, "auto") and not bm.splits_kv(cfg("gemma-3-27b"), 1024, "auto")
    assert bm.splits_kv(cfg("gemma-3-27b"), 1024, "split") and not bm.splits_kv(cfg("gemma-3-27b"), 32768, "shared")
    assert not bm.splits_kv(cfg("llama-3-8b"), 32768, "split")  # no sliding layers
    with pytest.raises(FitLLMError, match="--kv-layout"):
        bm.splits_kv(cfg("gemma-3-27b"), 32768, "ring")


def test_gemma3_27b_on_a_24gb_card_with_a_split_cache():
    """Gemma 3 27B AWQ on an RTX 4090: 52 of 62 layers slide over 1,024 tokens. Split, one sequence
    holds ~5x the tokens of one shared pool in the same bytes, and it does not depend on
    --max-num-seqs (the sliding layers' pages come back behind each window)."""
    cfg = bm.known_model("gemma-3-27b")
    assert bm.sliding_layers(cfg) == (52, 1024)
    per_layer = 16 * 128 * 2 * 2  # K and V, 16 KV heads of 128, bf16
    gpu = bm.find_gpu("rtx4090")
    s = bm.Settings(scheme="awq", max_model_len=32768, max_num_seqs=1, gpu_arch=gpu.arch)
    split = bm.estimate(cfg, s, gpu.memory_bytes)
    shared = bm.estimate(cfg, replace(s, kv_layout="shared"), gpu.memory_bytes)
    assert split.split and not shared.split and shared.terms == split.terms
    assert split.page_widths == (2, 11) and split.page_bytes_per_token == 5 * per_layer
    assert split.kv_cache == 16 * split.num_kv_blocks * 5 * per_layer
    assert shared.kv_cache == 16 * shared.num_kv_blocks * 62 * per_layer
    free = split.usable - sum(split.terms.values())
    assert free - 16 * 5 * per_layer < split.kv_cache <= free and shared.kv_cache <= free
    # one sequence: 66 sliding blocks of 11 pages, the rest 2 pages a block of 16 tokens
    assert split.kv_tokens == (split.num_kv_blocks - 66 * 11) // 2 * 16
    assert split.kv_tokens > 4.5 * shared.kv_tokens and split.fits and not shared.fits
    assert split.max_seqs_at(32768) == split.num_kv_blocks // (2048 * 2 + 66 * 11) >= 1
    assert split.longest_context_at(1) == split.kv_tokens > 50_000  # (the model's limit: 131072)
    assert split.longest_context_at(2) == (split.num_kv_blocks // 2 - 66 * 11) // 2 * 16
    # short sequences hold both kinds alike: 13 pages a block (5 % more than 62 layers' worth)
    assert split.max_seqs_at(512) == split.num_kv_blocks // (32 * 13)
    many = bm.estimate(cfg, replace(s, max_num_seqs=64), gpu.memory_bytes)
    assert many.num_kv_blocks <= split.num_kv_blocks and many.split and many.fits  # (activations grow a little)
    # a step of one sequence at 32k reads the sliding layers' window only, in either layout
    assert split.kv_read_bytes(32768) == shared.kv_read_bytes(32768) == (10 * 32768 + 52 * 1024) * per_layer


def test_cli_plans_a_split_cache_at_the_default_sequences():
    res = CliRunner().invoke(app, ["memory", "gemma-3-27b", "--gpu", "rtx4090", "--quant", "awq",
                                   "--max-model-len", "32768", "--json"])
    doc = json.loads(res.output)
    assert doc["fits"] and doc["kv_layout"] == "split" and doc["kv_page_widths"] == [2, 11]
    res = CliRunner().invoke(app, ["memory", "gemma-3-27b", "--gpu", "rtx4090", "--quant", "awq",
                                   "--max-model-len", "32768"])
    assert res.exit_code == 0 and "KV split" in res.output and "--kv-layout shared:" in res.output
    res = CliRunner().invoke(app, ["memory", "gemma-3-27b", "--gpu", "rtx4090", "--quant", "awq",
                                   "--max-model-len", "32768", "--kv-layout", "shared"])
    assert res.exit_code == 0 and "Does not fit" in res.output


def test_every_layer_sliding_keeps_windows_only():
    """Phi-3-mini-4k slides every layer over 2047 tokens: one pool, each sequence holding at most its
    window (2046 tokens behind the newest: 128 blocks of 16, and one more at each end)."""
    cfg = bm.known_model("phi-3-mini-4k")
    assert bm.sliding_layers(cfg) == (32, 2047)
    s = bm.Settings(max_model_len=4096, max_num_seqs=64)
    win = bm.estimate(cfg, s, 24 * bm.GiB)
    shared = bm.estimate(cfg, replace(s, kv_layout="shared"), 24 * bm.GiB)
    assert win.window_only and not win.split and not shared.window_only
    assert win.num_kv_blocks == shared.num_kv_blocks and win.kv_cache == shared.kv_cache
    assert win.max_seqs_at(4096) == win.num_kv_blocks // 130 > shared.max_seqs_at(4096) == shared.num_kv_blocks // 256
    assert win.max_seqs_at(1000) == shared.max_seqs_at(1000) == win.num_kv_blocks // 63
    assert win.longest_context_at(win.num_kv_blocks // 130) == 4096
    assert not bm.estimate(cfg, replace(s, max_model_len=2047), 24 * bm.GiB).window_only  # the window is the context
