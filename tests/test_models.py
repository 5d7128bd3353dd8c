"""The foundation: fitllm's decoder against transformers' own models, loading, and load errors."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from fitllm.models.config import ModelConfig
from fitllm.models.errors import ModelLoadError
from fitllm.models.generate import generate, prompt_logits
from fitllm.models.loader import load_model
from tiny_models import FAMILIES, write_tiny_model


def _max_logprob_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().log_softmax(-1) - b.float().log_softmax(-1)).abs().max().item()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_family_matches_transformers(family, tmp_path):
    hf = write_tiny_model(family, tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    assert _max_logprob_diff(prompt_logits(ours, ids[0].tolist()), ref) < 1e-3
    # Greedy decoding, token for token, against transformers' generate. LongRoPE: only up to its
    # original context (64): a sequence growing past it makes transformers recompute its whole cache
    # with the long factors (Phi3ForCausalLM.prepare_inputs_for_generation); fitllm keeps the keys
    # it cached, as vLLM does (rope_long_context).
    prompt, new = ids[0, :12], 40 if family in ("phi3-longrope", "phi3-partial") else 64
    # (the mask given: generate would take a prompt's token 0, the pad id, for padding)
    expected = hf.generate(prompt[None], attention_mask=torch.ones(1, 12, dtype=torch.long), max_new_tokens=new,
                           do_sample=False, min_new_tokens=new, pad_token_id=0)[0, 12:].tolist()
    assert generate(ours, [prompt.tolist()], new) == [expected]


@pytest.mark.parametrize("family", ["phi3-longrope", "phi3-partial"])
def test_longrope_is_chosen_per_sequence(family, tmp_path):
    """A short request batched with one past LongRoPE's original context (64 tokens) decodes as it
    does alone: the long factors are the long sequence's alone (vLLM switches the whole batch)."""
    write_tiny_model(family, tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 30, 100)]
    assert generate(ours, prompts, 40) == [generate(ours, [p], 40)[0] for p in prompts]


def test_multimodal_head_stored_apart_is_untied(tmp_path):
    """A multimodal config that says tie_word_embeddings (at its top level, or by default) over a
    checkpoint that stores its own lm_head: transformers unties them, and so does fitllm."""
    hf = write_tiny_model("mistral3-mm", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("tie_word_embeddings", None)  # transformers' default for these configs: tied
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert not ModelConfig.from_file(tmp_path).tie_word_embeddings
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    assert _max_logprob_diff(prompt_logits(load_model(tmp_path, dtype=torch.float32), ids[0].tolist()), ref) < 1e-3


def test_llama31_rope_scaling_is_applied(tmp_path):
    """Positions beyond the original context must use the scaled frequencies (else logits differ)."""
    write_tiny_model("llama3.1", tmp_path)
    cfg = ModelConfig.from_file(tmp_path)
    assert cfg.rope_scaling and (cfg.rope_scaling.get("rope_type") or cfg.rope_scaling.get("type")) == "llama3"


def test_embedded_model_matches_transformers_gguf(embedded_model, embedded_tokenizer):
    """Real weights: transformers dequantizes the GGUF itself; fitllm's own GGUF reader must agree."""
    from transformers import AutoModelForCausalLM

    from fitllm.models.hub import embedded_gguf_path

    gguf = embedded_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    text = "The history of the Roman Empire spans many centuries, and historians"
    ids = embedded_tokenizer(text)["input_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert _max_logprob_diff(prompt_logits(embedded_model, ids), ref) < 1e-3
    chat = embedded_tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                  add_generation_prompt=True, tokenize=False)
    prompt = embedded_tokenizer(chat)["input_ids"]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt):].tolist()
    got = generate(embedded_model, [prompt], 64, eos_token_ids=embedded_model.config.eos_token_ids)[0]
    assert embedded_tokenizer.eos_token_id == 2  # <|im_end|>, from the GGUF metadata
    assert got == expected
    assert "Paris" in embedded_tokenizer.decode(got)


def test_batched_generation_equals_single(embedded_model):
    prompts = [[1, 504, 3575, 282, 4649, 314], [1, 22, 33, 44], list(range(100, 140))]
    batched = generate(embedded_model, prompts, 12)
    assert batched == [generate(embedded_model, [p], 12)[0] for p in prompts]


def test_unsupported_architecture_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_file(tmp_path)


def test_gemma3_configs_as_the_hub_writes_them():
    """Gemma 3 4B's multimodal config lists five text fields and leaves the rest to transformers' defaults
    (and an older spelling of RoPE and the layer pattern); 1B's is complete in that older spelling.
    Gemma 2's soft-capping and EmbeddingGemma's bidirectional attention are refused by name."""
    four_b = ModelConfig.from_hf_dict({
        "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024}})
    assert (four_b.num_heads, four_b.num_kv_heads, four_b.head_dim, four_b.vocab_size) == (8, 4, 256, 262208)
    assert four_b.attention_windows[:6] == [1024] * 5 + [None] and four_b.eos_token_ids == [1, 106]
    assert four_b.rope_theta == 1e6 and four_b.rope_scaling["factor"] == 8.0 and four_b.local_rope_theta == 1e4
    assert [four_b.layer_rope(i) for i in range(6)] == ["local"] * 5 + ["global"]
    one_b = ModelConfig.from_hf_dict({
        "architectures": ["Gemma3ForCausalLM"], "hidden_size": 1152, "intermediate_size": 6912, "head_dim": 256,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 262144,
        "query_pre_attn_scalar": 256, "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
        "sliding_window": 512, "sliding_window_pattern": 6})
    assert one_b.rope_scaling is None and one_b.attention_windows[4:7] == [512, None, 512]
    for field, value in (("final_logit_softcapping", 30.0), ("use_bidirectional_attention", True)):
        with pytest.raises(ModelLoadError, match=field):
            ModelConfig.from_hf_dict({"architectures": ["Gemma3ForCausalLM"], field: value})
    with pytest.raises(ModelLoadError, match="unsupported architecture 'Gemma2ForCausalLM'"):
        ModelConfig.from_hf_dict({"architectures": ["Gemma2ForCausalLM"]})


PHI3 = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 8192,
        "original_max_position_embeddings": 4096}


def test_phi3_config_variants(tmp_path):
    """Older Phi-3 configs call LongRoPE "su" and keep the original context at the top level;
    partial RoPE (Phi-4-mini: 3/4 of each head) rotates the leading dims; a factor that leaves an odd
    count is refused with a message naming the field."""
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    cfg = ModelConfig.from_hf_dict({**PHI3, "rope_scaling": {"type": "su", **factors}})
    assert cfg.fused_checkpoint and cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096 and cfg.rotary_dim == cfg.head_dim == 16
    assert ModelConfig.from_hf_dict({**PHI3, "partial_rotary_factor": 0.75}).rotary_dim == 12
    (tmp_path / "config.json").write_text(json.dumps({**PHI3, "partial_rotary_factor": 0.2}))  # 3.2 -> 3 dims
    with pytest.raises(ModelLoadError, match=r"config\.json: partial_rotary_factor 0\.2 gives 3 rotary dims"):
        ModelConfig.from_file(tmp_path)


def test_generation_config_adds_end_of_turn_tokens(tmp_path):
    """HF `generate` stops at generation_config.json's eos ids; so must the server."""
    (tmp_path / "config.json").write_text(json.dumps({**PHI3, "eos_token_id": 32000}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [32000, 32001, 32007]}))
    assert ModelConfig.from_file(tmp_path).eos_token_ids == [32000, 32001, 32007]
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match=r"generation_config\.json: not valid JSON"):
        ModelConfig.from_file(tmp_path)


def test_missing_config_field_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="missing required field 'hidden_size'"):
        ModelConfig.from_file(tmp_path)


def test_truncated_shard_is_named(tmp_path):
    write_tiny_model("llama", tmp_path)
    shard = tmp_path / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated"):
        load_model(tmp_path)


def test_missing_folder_and_tensor(tmp_path):
    from fitllm.models.hub import resolve_model

    with pytest.raises(ModelLoadError, match="no such file or folder"):
        resolve_model(str(tmp_path / "nope"))
    write_tiny_model("llama", tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("model.layers.1.mlp.down_proj.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks 1 tensors, e.g. model.layers.1.mlp.down_proj"):
        load_model(tmp_path)


def test_loading_never_holds_two_copies(embedded_folder):
    """Peak RSS growth while loading is one copy of the weights plus a tensor (fresh process)."""
    # VmHWM, not ru_maxrss: ru_maxrss survives exec, so a child forked from a large pytest
    # process would report the parent's peak.
    code = textwrap.dedent(f"""
        import pathlib, torch
        from fitllm.models.loader import load_model

        def status(key):
            line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
            return int(line.split()[1]) * 1024

        torch.ones(1)
        base = status("VmRSS")  # current RSS, not the high-water mark imports pushed up
        m = load_model(pathlib.Path({str(embedded_folder)!r}), dtype=torch.float32)
        peak = status("VmHWM")
        weights = sum(p.numel() * p.element_size() for p in m.parameters())
        print("RSS", base, peak, weights)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    base, peak, weights = map(int, out.split("RSS", 1)[1].split())
    print(f"weights {weights / 2**20:.0f} MiB, peak RSS growth while loading {(peak - base) / 2**20:.0f} MiB")
    assert weights < peak - base < 1.25 * weights
