"""Weight loading: safetensors (sharded, memory-mapped, one tensor at a time) into a CausalLM.

Each checkpoint tensor goes straight into its destination (a slice of a fused linear, an
embedding, a norm), so the process never holds two full copies of the weights.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from fitllm.models.config import MULTIMODAL, ModelConfig
from fitllm.models.decoder import CausalLM, RMSNorm
from fitllm.models.errors import ModelLoadError
from fitllm.models.linear import FusedLinear, LinearFactory

# HF module name -> (fused module name, shard index)
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# modules that are one checkpoint matrix (shard 0); a fused checkpoint (Phi-3) stores qkv_proj and
# gate_up_proj whole
UNFUSED_MODULES = ("o_proj", "down_proj", "lm_head", "qkv_proj", "gate_up_proj")


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index}: malformed index ({exc})") from None
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files (fitllm reads safetensors or GGUF)")
    for f in files:
        if not f.exists():
            raise ModelLoadError(f"{f}: listed in the index but missing")
        check_safetensors_file(f)
    return files


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """Parse and check a safetensors header; truncated or corrupted files fail naming the file."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            header_len = struct.unpack("<Q", f.read(8))[0]
            if header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not a valid safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + header_len + end > size:
        raise ModelLoadError(f"{path}: truncated ({size} bytes, header describes {8 + header_len + end})")
    return 8 + header_len, header


def check_safetensors_file(path: Path) -> None:
    read_safetensors_header(path)


def iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs, each read on its own with pread.

    Not memory-mapped on purpose: a mapping keeps every page it touched resident until the file
    is closed, so peak memory would be the weights plus the whole file. Here it is the weights
    plus the largest single tensor."""
    for path in safetensors_files(folder):
        data_start, header = read_safetensors_header(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                lo, hi = info["data_offsets"]
                dtype = _DTYPES.get(info["dtype"])
                if dtype is None:
                    raise ModelLoadError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
                buf = bytearray(hi - lo)
                if os.preadv(fd, [buf], data_start + lo) != hi - lo:
                    raise ModelLoadError(f"{path}: short read for tensor {name}")
                flat = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
                yield name, flat.reshape(info["shape"])
        finally:
            os.close(fd)


def route(name: str) -> tuple[str, Optional[int], str]:
    """Checkpoint name -> (module name in fitllm, fused shard index or None, parameter suffix).

    `model.layers.3.self_attn.k_proj.qweight` -> (`model.layers.3.self_attn.qkv_proj`, 1, `qweight`)
    """
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        head, tail = parts[:cut], ".".join(parts[cut:])
        if head[-1] in FUSED_SHARDS:
            fused, shard = FUSED_SHARDS[head[-1]]
            return ".".join(head[:-1] + [fused]), shard, tail
        if head[-1] in UNFUSED_MODULES:
            return ".".join(head), 0, tail
    return ".".join(parts[:-1]), None, parts[-1]


# a multimodal checkpoint's language model under the names of a text-only one: transformers 5 writes
# model.language_model.*, earlier versions language_model.model.* and language_model.lm_head.*
TEXT_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head.", "lm_head."))


def text_model_name(name: str) -> Optional[str]:
    """The text-only name of a multimodal checkpoint's tensor; None for the rest (vision tower,
    projector), which fitllm does not read."""
    for old, new in TEXT_MODEL_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name if name == "lm_head.weight" else None


def checkpoint_spellings(module: str) -> list[str]:
    """The names a multimodal checkpoint may give text module `module` (text_model_name's inverse), the
    text name first: the rules of its quantization config (ignore lists, `dynamic` patterns,
    modules_to_not_convert) are written with the checkpoint's own spelling."""
    dotted = module + "."
    return [module] + [(old + dotted[len(new):]).rstrip(".") for old, new in TEXT_MODEL_PREFIXES
                       if dotted.startswith(new)]


def text_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        renamed = text_model_name(name)
        if renamed is not None:
            yield renamed, tensor


def load_weights(model: CausalLM, folder: Path) -> None:
    tensors = iter_tensors(folder)
    if model.config.architecture in MULTIMODAL:
        tensors = text_tensors(tensors)
    load_tensors(model, tensors, source=str(folder))


def load_tensors(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
    """Route each (HF name, tensor) into the model, check nothing is missing, then finalize."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for name, tensor in tensors:
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # some tied checkpoints still store a copy
        if "rotary_emb" in name:
            continue
        module_name, shard, suffix = route(name)
        module = modules.get(module_name)
        if isinstance(module, FusedLinear):
            module.load(shard, suffix, tensor)
        elif isinstance(module, RMSNorm) and suffix == "weight":
            if module.weight.shape != tensor.shape:
                raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(module.weight.shape)}")
            module.load_weight(tensor)
        elif name in params:
            target = params[name]
            if target.shape != tensor.shape:
                raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.data.copy_(tensor)
        else:
            raise ModelLoadError(f"{source}: unexpected tensor {name!r} (does config.json match the weights?)")
        seen.add(module_name if isinstance(module, FusedLinear) else name)
    missing = [n for n in params if n not in seen and not _owned_by_fused(n, modules)]
    missing += [n for n, m in modules.items() if isinstance(m, FusedLinear) and n not in seen]
    if missing:
        raise ModelLoadError(f"{source}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    for module in modules.values():
        if isinstance(module, FusedLinear):
            module.finalize()
    model.fold_input_orders()


def _owned_by_fused(param_name: str, modules: dict) -> bool:
    return isinstance(modules.get(param_name.rsplit(".", 1)[0]), FusedLinear)


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_model(folder: Path, device: torch.device | str = "cpu", dtype: Optional[torch.dtype] = None,
               make_linear: Optional[LinearFactory] = None, config: Optional[ModelConfig] = None) -> CausalLM:
    """Build the decoder for `folder` and fill it from its safetensors files."""
    config = config or ModelConfig.from_file(folder)
    model = CausalLM(config, make_linear=make_linear, dtype=dtype or default_dtype(device), device=device)
    load_weights(model, folder)
    return model.eval()
