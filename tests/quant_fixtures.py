"""Tiny random models in HF layout (the embedded model's tokenizer) for the quant tests: a Llama,
and a Phi-3 (whose checkpoints hold q|k|v and gate|up fused), written by transformers."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from fitllm.models.hub import resolve_model

TINY = dict(hidden=128, inter=256, layers=2, heads=4, kv_heads=2)


def make_tiny_model(folder: Path, vocab: int = 49152, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    h, i, n = TINY["hidden"], TINY["inter"], TINY["layers"]
    hd = h // TINY["heads"]
    kv = TINY["kv_heads"] * hd
    t = {"model.embed_tokens.weight": torch.randn(vocab, h) * 0.5, "model.norm.weight": torch.ones(h)}
    for layer in range(n):
        p = f"model.layers.{layer}."
        shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
        for name, shape in shapes.items():
            t[p + name + ".weight"] = torch.randn(shape) / shape[1] ** 0.5
        t[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(h)
        t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(h)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": i, "num_hidden_layers": n, "num_attention_heads": TINY["heads"],
              "num_key_value_heads": TINY["kv_heads"], "head_dim": hd, "vocab_size": vocab,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
              "tie_word_embeddings": True, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(config))
    src = resolve_model(None)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, folder / f)
    return folder


def _save(model, folder: Path, seed: int, norm_center: float = 1.0) -> Path:
    """Random weights (norms around norm_center, linears ~ 1/sqrt(fan-in)), saved by transformers with
    the embedded model's tokenizer beside them."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(norm_center + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.float().save_pretrained(folder, safe_serialization=True)
    src = resolve_model(None)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, folder / f)
    return folder


def _text(vocab: int, **extra) -> dict:
    return dict(vocab_size=vocab, hidden_size=TINY["hidden"], intermediate_size=TINY["inter"],
                num_hidden_layers=TINY["layers"], num_attention_heads=TINY["heads"],
                num_key_value_heads=TINY["kv_heads"], max_position_embeddings=2048, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, **extra)


def make_tiny_phi3(folder: Path, vocab: int = 49152, seed: int = 0) -> Path:
    from transformers import Phi3Config, Phi3ForCausalLM

    return _save(Phi3ForCausalLM(Phi3Config(**_text(vocab))), folder, seed)


def make_tiny_gemma3(folder: Path, multimodal: bool = False, vocab: int = 49152, seed: int = 0) -> Path:
    """A Gemma 3 text model (window 16 on its sliding layer, shorter than the tests' calibration rows),
    or the multimodal checkpoint around one (a one-layer vision tower the quantizer leaves out)."""
    import transformers

    text = _text(vocab, head_dim=32, sliding_window=16, query_pre_attn_scalar=32,
                 layer_types=["sliding_attention", "full_attention"])
    if multimodal:
        config = transformers.Gemma3Config(text_config=text, mm_tokens_per_image=4, image_token_index=vocab + 10,
                                           vision_config=dict(hidden_size=32, intermediate_size=64, image_size=28,
                                                              num_hidden_layers=1, num_attention_heads=2,
                                                              patch_size=14))
        model = transformers.Gemma3ForConditionalGeneration(config)
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**text))
    return _save(model, folder, seed, norm_center=0.0)  # Gemma stores norm weights less one


def make_tiny_mistral3(folder: Path, vocab: int = 49152, seed: int = 0) -> Path:
    """Mistral Small 3.x's multimodal checkpoint around a tiny Mistral (its own lm_head, a Pixtral tower)."""
    import transformers

    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14, head_dim=16)
    config = transformers.Mistral3Config(text_config=_text(vocab, model_type="mistral", head_dim=32, sliding_window=None),
                                         vision_config=vision, image_token_index=vocab + 10, tie_word_embeddings=False)
    return _save(transformers.Mistral3ForConditionalGeneration(config), folder, seed)


def make_tiny_smollm3(folder: Path, vocab: int = 49152, seed: int = 0) -> Path:
    """SmolLM3 with its second layer left without RoPE."""
    import transformers

    config = transformers.SmolLM3Config(**_text(vocab, no_rope_layer_interval=2))
    return _save(transformers.SmolLM3ForCausalLM(config), folder, seed)

CALIB_TEXT = " ".join(
    f"Line {k}: the quick brown fox {k % 7} jumps over {k * 3} lazy dogs while numbers {k ** 2} grow."
    for k in range(400))


def gptqmodel_v1_qzeros(zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Zero points [G, N] as GPTQModel's v1 export stores them: packed as they are, then 1 taken off
    each slot by one int32 subtraction per word (so a zero point of 0 borrows from the next slot)."""
    from fitllm.quant.formats.packing import pack_dim1

    ones = sum(1 << (bits * j) for j in range(32 // bits))
    word = (pack_dim1(zero, bits).long() - ones) & 0xFFFFFFFF
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
