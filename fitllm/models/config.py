"""Model configuration: one dataclass read from a Hugging Face config.json (or GGUF metadata).

One decoder covers Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3 and Phi-3/Phi-4; the differences are
flags here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
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
}
MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
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

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        arch = (raw.get("architectures") or [MODEL_TYPE_TO_ARCH.get(raw.get("model_type", ""), "")])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: unsupported architecture {arch or raw.get('model_type')!r}; "
                f"fitllm supports {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
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
        gen = path.with_name("generation_config.json")
        if gen.exists():  # chat models often list their end-of-turn tokens only here (Phi-3's <|end|>)
            for t in _token_ids(_read_json(gen).get("eos_token_id")):
                if t not in config.eos_token_ids:
                    config.eos_token_ids.append(int(t))
        return config

    # Sizes the KV cache, the memory calculator and the kernels all agree on.
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


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
