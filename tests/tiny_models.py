"""Tiny random-weight checkpoints of each supported family, written by transformers itself."""
from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # for configs whose defaults lie past 256

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "phi3-window": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                          sliding_window=24)),  # Phi-3-mini-4k: 2047
    # LongRoPE: prompts of 100 tokens pass the original 64, so they take the long factors
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=0, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                         "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]})),
    # Phi-4-mini's shape of RoPE: LongRoPE on the first half of each head (it rotates 3/4)
    "phi3-partial": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=0, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=64,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.2, 1.7, 2.5], "long_factor": [1.0, 2.0, 5.0, 11.0]})),
    # Gemma 3: sliding layers (window 16) between full ones with their own RoPE (linear scaling, as
    # 4B-27B), sandwich norms, GELU, scaled embeddings and queries
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, num_hidden_layers=3, sliding_window=16, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_theta=1e6,
        rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})),
    # Gemma 3 4B-27B are multimodal checkpoints: the language model is read, the vision tower not
    "gemma3-mm": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
        text_config=dict(head_dim=32, sliding_window=16, query_pre_attn_scalar=24,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=1000)),
    # SmolLM3: every other layer without RoPE here (every 4th in SmolLM3-3B); and with a window on those
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2, **TOKENS)),
    "smollm3-window": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2, use_sliding_window=True,
                                                                   sliding_window=16, **TOKENS)),
    # Mistral Small 3.1 / 3.2 (24B) are multimodal too; this one keeps an lm_head of its own
    "mistral3-mm": ("Mistral3Config", "Mistral3ForConditionalGeneration", dict(
        text_config=dict(model_type="mistral", head_dim=16, sliding_window=None),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14, head_dim=16),
        image_token_index=1000, tie_word_embeddings=False)),
}


def write_tiny_model(family: str, folder: Path, seed: int = 0):
    """Save a random model of `family` to `folder`; return the transformers model (fp32, eval)."""
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    if "text_config" in extra:  # a multimodal model: the text model is the tiny one
        config = getattr(transformers, config_name)(**{**extra, "text_config": {**BASE, **extra["text_config"]}})
    else:
        config = getattr(transformers, config_name)(**{**BASE, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    # Random init leaves norms at 1; perturb them so a wrong norm path cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model
