"""Model configuration: one dataclass read from a Hugging Face config.json (or GGUF metadata).

One decoder covers Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, Phi-3/Phi-4, Gemma 3 (text) and SmolLM3;
the differences are flags here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from fitllm.models.errors import ModelLoadError

# architecture name -> (qkv_bias, qk_norm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Phi3ForCausalLM": (False, False),
    "Gemma3ForCausalLM": (False, True),
    "SmolLM3ForCausalLM": (False, False),
}
# multimodal checkpoints whose language model fitllm runs (the vision tower is not read): the text
# model's architecture and model_type
MULTIMODAL = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "gemma3_text"),  # Gemma 3 4B-27B
    "Mistral3ForConditionalGeneration": ("MistralForCausalLM", "mistral"),  # Mistral Small 3.1 / 3.2
}
MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "smollm3": "SmolLM3ForCausalLM",
}
# checkpoints that store q|k|v as one `qkv_proj` and gate|up as one `gate_up_proj` matrix
FUSED_CHECKPOINT_ARCHITECTURES = {"Phi3ForCausalLM"}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: Optional[int] = None
    fused_checkpoint: bool = False
    rotary_dim: int = 0  # dims of each head RoPE rotates (the first ones; Phi-4-mini: 3/4); 0: all
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    quantization_config: Optional[dict] = None
    quantized_at_load: Optional[str] = None  # int4 | fp8 | nf4: a dense checkpoint quantized as it loaded
    torch_dtype: str = "bfloat16"
    # Gemma 3's differences from Llama (the defaults are Llama's)
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh"
    attn_scale: Optional[float] = None  # the softmax scale; None: head_dim ** -0.5
    embed_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden), rounded to the model dtype)
    norm_offset: float = 0.0  # RMSNorms scale by offset + the stored weight (Gemma stores weight - 1)
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too, before each residual add
    layer_types: Optional[list[str]] = None  # per layer "sliding_attention" or "full_attention"; None: all alike
    local_rope_theta: Optional[float] = None  # RoPE base of the sliding layers (unscaled); None: one RoPE
    rope_layers: Optional[list[bool]] = None  # per layer whether it applies RoPE (SmolLM3: 3 of 4); None: all

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        arch = (raw.get("architectures") or [MODEL_TYPE_TO_ARCH.get(raw.get("model_type", ""), "")])[0]
        if arch in MULTIMODAL:
            text = {**_text_fields(raw), "architectures": [MULTIMODAL[arch][0]]}
            return replace(cls.from_hf_dict(text, source), architecture=arch)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: unsupported architecture {arch or raw.get('model_type')!r}; "
                f"fitllm supports {', '.join(sorted([*SUPPORTED_ARCHITECTURES, *MULTIMODAL]))}"
            )
        if arch == "Gemma3ForCausalLM":
            return _gemma3(raw, source)
        if arch == "SmolLM3ForCausalLM":
            return _smollm3(raw, source)
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            head_dim = int(raw.get("head_dim") or hidden // heads)
            qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
            eos_ids = _token_ids(raw.get("eos_token_id"))
            # Mistral/Qwen configs may carry a window that is disabled by a separate flag.
            window = raw.get("sliding_window")
            if raw.get("use_sliding_window") is False:
                window = None
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(raw, arch, source),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=bool(raw.get("attention_bias", qkv_bias)),
                qk_norm=qk_norm,
                sliding_window=window,
                fused_checkpoint=arch in FUSED_CHECKPOINT_ARCHITECTURES,
                rotary_dim=_rotary_dim(raw, head_dim, source),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                quantization_config=raw.get("quantization_config") or raw.get("compression_config"),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: missing required field {exc.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ModelLoadError(f"{path}: no such file (a model folder needs a config.json)")
        config = cls.from_hf_dict(_read_json(path), source=str(path))
        if config.architecture in MULTIMODAL and _stores_lm_head(path.parent):  # transformers unties such a head
            config = replace(config, tie_word_embeddings=False)
        gen = path.with_name("generation_config.json")
        if gen.exists():  # chat models often list their end-of-turn tokens only here (Phi-3's <|end|>)
            for t in _token_ids(_read_json(gen).get("eos_token_id")):
                if t not in config.eos_token_ids:
                    config.eos_token_ids.append(int(t))
        return config

    # Sizes the KV cache, the memory calculator and the kernels all agree on.
    @property
    def attention_windows(self) -> Optional[int] | list[Optional[int]]:
        """The sliding window the KV caches apply: one for every layer, or a list with each layer's
        (None where a layer attends to everything)."""
        if self.layer_types is None:
            return self.sliding_window
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]

    def layer_rope(self, layer: int) -> Optional[str]:
        """The RoPE a layer applies: "global" (the model's), "local" (Gemma 3's sliding layers, their own
        base) or None (SmolLM3's layers without position encoding)."""
        if self.rope_layers is not None and not self.rope_layers[layer]:
            return None
        if self.local_rope_theta is not None and self.layer_types[layer] == "sliding_attention":
            return "local"
        return "global"

    def layer_ropes(self, global_rope, local_rope=None) -> list:
        """Each layer's (cos, sin) from the model's RoPE and, where it has one, the sliding layers'
        (layer_rope); (None, None) for a layer without position encoding."""
        ropes = {"global": global_rope, "local": local_rope, None: (None, None)}
        return [ropes[self.layer_rope(i)] for i in range(self.num_layers)]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def layer_window(sliding_window: Optional[int] | list[Optional[int]], layer: int) -> Optional[int]:
    """One layer's sliding window: `sliding_window` is one for every layer, or one per layer
    (ModelConfig.attention_windows: Gemma 3 slides on five layers of six)."""
    return sliding_window[layer] if isinstance(sliding_window, (list, tuple)) else sliding_window


def _token_ids(value) -> list[int]:
    """An `eos_token_id` field (absent, one id, or a list) as a list of ids."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def _rotary_dim(raw: dict, head_dim: int, source: str) -> int:
    """How many leading dims of a head RoPE rotates: head_dim * partial_rotary_factor (top level, or
    in rope_parameters as transformers 5 writes it), as transformers rounds it."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = next((float(v) for v in (params.get("partial_rotary_factor"), raw.get("partial_rotary_factor"))
                   if v is not None), 1.0)
    dim = int(head_dim * factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise ModelLoadError(f"{source}: partial_rotary_factor {factor} gives {dim} rotary dims of {head_dim}; "
                             "need an even number between 2 and head_dim")
    return dim


def _rope_scaling(raw: dict, arch: str, source: str) -> Optional[dict]:
    """transformers 4.x writes `rope_scaling`, 5.x writes `rope_parameters`; keep the non-default one.
    Phi-3's LongRoPE (older configs say "su" or "yarn") also needs the pretraining context length,
    which its configs keep at the top level."""
    for key in ("rope_scaling", "rope_parameters"):
        params = raw.get(key)
        kind = params and (params.get("rope_type") or params.get("type", "default"))
        if kind and kind != "default":
            params = dict(params)
            if arch == "Phi3ForCausalLM" and kind in ("su", "yarn", "longrope"):
                params["rope_type"] = "longrope"
                params.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
                params.setdefault("max_position_embeddings", raw.get("max_position_embeddings"))
            return params
    return None


def _gemma3(raw: dict, source: str) -> "ModelConfig":
    """Gemma 3's text model. Hub configs leave most fields to transformers' defaults (the 4B-27B ones
    list five or six), and older ones spell the layer pattern and RoPE differently, so transformers'
    own Gemma3TextConfig fills and normalises them (layer_types, rope_parameters per layer type)."""
    full = _filled_by_transformers("Gemma3TextConfig", raw, source)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if full.get(key) is not None:
            raise ModelLoadError(f"{source}: {key} = {full[key]} is not supported (Gemma 2's soft-capping)")
    if full.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention (an embedding model) is not supported")
    if full.get("hidden_activation") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{source}: hidden_activation {full.get('hidden_activation')!r} is not supported "
                             "(Gemma 3's is gelu_pytorch_tanh)")
    rope = full["rope_parameters"]
    full["rope_theta"] = rope["full_attention"]["rope_theta"]
    full["rope_parameters"] = rope["full_attention"]  # the full layers' scaling (4B-27B: linear, 8)
    config = ModelConfig.from_hf_dict({**full, "architectures": ["LlamaForCausalLM"]}, source)
    return replace(config, architecture="Gemma3ForCausalLM", qk_norm=True, activation="gelu_tanh",
                   attn_scale=float(full["query_pre_attn_scalar"]) ** -0.5,
                   embed_scale=float(full["hidden_size"]) ** 0.5, norm_offset=1.0, sandwich_norms=True,
                   layer_types=list(full["layer_types"]),
                   local_rope_theta=float(rope["sliding_attention"]["rope_theta"]))


def _filled_by_transformers(config_class: str, raw: dict, source: str) -> dict:
    """raw with transformers' defaults and derived fields filled in by its own config class."""
    import transformers

    try:
        return getattr(transformers, config_class)(
            **{k: v for k, v in raw.items() if k not in ("architectures", "model_type")}).to_dict()
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: not a valid {config_class} ({exc})") from None


def _smollm3(raw: dict, source: str) -> "ModelConfig":
    """SmolLM3: Llama with RoPE left out of every 4th layer (no_rope_layers, 1 where RoPE applies), and
    optionally a window on those layers; transformers' SmolLM3Config fills both lists."""
    full = _filled_by_transformers("SmolLM3Config", raw, source)
    config = ModelConfig.from_hf_dict({**full, "architectures": ["LlamaForCausalLM"]}, source)
    sliding = bool(full.get("use_sliding_window")) and full.get("sliding_window") is not None
    return replace(config, architecture="SmolLM3ForCausalLM", rope_layers=[bool(r) for r in full["no_rope_layers"]],
                   layer_types=list(full["layer_types"]) if sliding else None)


def _text_fields(raw: dict) -> dict:
    """A multimodal config's text model: its text_config, with the fields such configs keep at the top
    level. Whether the lm_head is tied goes by the top level, as in transformers (ModelConfig.from_file
    then checks the checkpoint: transformers unties a head stored apart)."""
    text = dict(raw.get("text_config") or {})
    for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "quantization_config", "compression_config"):
        if key in raw and key not in text:
            text[key] = raw[key]
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", True)
    text.pop("architectures", None)
    return text


def text_only_config(raw: dict, config: ModelConfig) -> dict:
    """The config.json of a multimodal checkpoint's language model written alone (quant convert), e.g.
    Gemma3ForConditionalGeneration -> Gemma3ForCausalLM, which fitllm, vLLM and transformers load."""
    arch, model_type = MULTIMODAL[config.architecture]
    return {**_text_fields(raw), "architectures": [arch], "model_type": model_type,
            "tie_word_embeddings": config.tie_word_embeddings}


def _stores_lm_head(folder: Path) -> Optional[bool]:
    """Whether a checkpoint holds an lm_head of its own (None: it cannot be told here; the loader
    reports broken or missing files when it loads them)."""
    from fitllm.models.loader import read_safetensors_header, safetensors_files

    try:
        names = [name for f in safetensors_files(folder) for name in read_safetensors_header(f)[1]]
    except ModelLoadError:
        return None
    return any("lm_head" in name.split(".") for name in names)
