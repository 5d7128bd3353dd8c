"""Which model to evaluate, how to load it, and the one scoring primitive every eval uses.

A model spec is `PATH[@OPTION[,OPTION]]`, OPTION `kv=DTYPE` or `quant=METHOD`: PATH is a model folder, a .gguf,
a hub id, `embedded` (the default model) or empty/`base` (the base model's weights, e.g. `@kv=fp8` = base weights
with an fp8 KV cache, `@quant=nf4` = base weights quantized to NF4 as they load, as `quant serve --quantization`
does). Scoring runs through `fitllm.models.generate.forward_tokens` over a PagedKVCache
built with the spec's kv dtype: the same decoder and KV path `quant serve` runs, so a quantized
KV cache is part of what is measured.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from fitllm.models.errors import FitLLMError
from fitllm.models.generate import forward_tokens, make_cache
from fitllm.models.hub import resolve_model
from fitllm.models.loader import default_dtype, load_model
from fitllm.models.tokenizer import load_tokenizer

KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8", "int8", "int4")


class EvalError(FitLLMError):
    """A bad eval request (model spec, kv dtype, task); the message says what to change."""


@dataclass
class ModelSpec:
    name: str  # label in the report
    path: Optional[str]  # None: the embedded model
    kv_dtype: str = "auto"
    quantization: Optional[str] = None  # int4 | fp8 | nf4: a dense checkpoint quantized as it loads
    # Tests and library users may hand over an already-built model instead of a path.
    loader: Optional[Callable[[], "LoadedModel"]] = field(default=None, repr=False)


def parse_spec(text: Optional[str], base: Optional["ModelSpec"] = None, default_kv: str = "auto") -> ModelSpec:
    """`PATH[@kv=DTYPE,quant=METHOD]` (either option, or both) -> ModelSpec. PATH empty or `base` means the base's
    weights."""
    from fitllm.quant.inplace import ON_THE_FLY_METHODS

    text = text if text is not None else "embedded"
    path, _, opts = text.partition("@")
    kv, quant = default_kv, None
    for opt in filter(None, opts.split(",")):
        key, _, value = opt.partition("=")
        if key == "kv":
            kv = value
        elif key == "quant":
            quant = value
        else:
            raise EvalError(f"{text}: unknown option {key!r} after '@' (supported: kv=DTYPE, one of "
                            f"{'/'.join(KV_DTYPES)}; quant=METHOD, one of {'/'.join(ON_THE_FLY_METHODS)})")
    if kv not in KV_DTYPES:
        raise EvalError(f"{text}: kv dtype {kv!r} is not one of {', '.join(KV_DTYPES)}")
    if quant is not None and quant not in ON_THE_FLY_METHODS:
        raise EvalError(f"{text}: quant {quant!r} is not one of {', '.join(ON_THE_FLY_METHODS)}")
    if path in ("", "base"):
        if base is None:
            raise EvalError(f"{text}: '{path or '@'}' refers to the base model, so it cannot be the base itself")
        path = base.path
    elif path in ("embedded", "default") and not Path(path).exists():
        path = None
    if path is not None:
        _check_model_path(path)
    name = Path(path).name if path else "embedded"
    opts = [f"{k}={v}" for k, v in (("quant", quant), ("kv", kv)) if v not in (None, "auto")]
    name += "@" + ",".join(opts) if opts else ""
    return ModelSpec(name=name, path=path, kv_dtype=kv, quantization=quant)


def _check_model_path(path: str) -> None:
    """Before any model runs: a local path that is not there (or is no model folder) fails now, not after
    the base has been evaluated. `org/name` that is no local path is a hub id, fetched when loaded."""
    local = Path(path).expanduser()
    hub_id = "/" in path and not path.startswith((".", "/", "~"))
    if not local.exists() and not hub_id:
        raise EvalError(f"{path}: no such file or folder")
    if local.is_dir() and not (local / "config.json").exists():
        raise EvalError(f"{local / 'config.json'}: no such file (not a Hugging Face model folder)")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    folder: Optional[Path]
    method: str  # "dense" or the checkpoint's quantization method
    kv_calibration: object = None  # computed once, shared by every quantized-KV variant


def cache_kwargs(loaded: LoadedModel, kv_dtype: str, calib_ids: Optional[list[list[int]]] = None) -> dict:
    """PagedKVCache options for `kv_dtype`. fp8 and int4 need per-channel K/V statistics, computed
    once per model: from `calib_ids` (token sequences of the user's calibration text) or else with
    the cache's data-free default (text the model samples itself). Never from the eval's own text."""
    if kv_dtype == "auto":
        return {}
    kwargs = {"kv_dtype": kv_dtype}
    if kv_dtype in ("fp8", "int4"):
        if loaded.kv_calibration is None:
            from fitllm.models.kv_cache import calibrate_kv_scales

            loaded.kv_calibration = calibrate_kv_scales(loaded.model, calib_ids)
        kwargs["calibration"] = loaded.kv_calibration
    return kwargs


def load_for_eval(path: Optional[str], device: str, dtype: Optional[torch.dtype] = None,
                  quantize: Optional[str] = None) -> LoadedModel:
    """Dense folders through models.loader; quantized ones (and `quantize`d ones) through fitllm.quant."""
    folder = resolve_model(path)
    config = json.loads((folder / "config.json").read_text())
    qc = config.get("quantization_config")
    dtype = dtype or default_dtype(device)
    if quantize:
        method = f"{quantize} (quantized at load)"
        model = _quantized_loader(folder, method)(folder, device=device, dtype=dtype, quantize=quantize)
    elif qc:
        method = "/".join(str(qc[k]) for k in ("quant_method", "format") if qc.get(k)) or "quantized"
        model = _quantized_loader(folder, method)(folder, device=device, dtype=dtype)
    else:
        method = "dense"
        model = load_model(folder, device=device, dtype=dtype)
    return LoadedModel(model.eval(), load_tokenizer(folder), folder, method)


def _quantized_loader(folder: Path, method: str):
    import importlib

    for module in ("fitllm.quant", "fitllm.quant.layers"):
        try:
            return getattr(importlib.import_module(module), "load_quantized_model")
        except (ImportError, AttributeError):
            continue
    raise EvalError(f"{folder}: a {method} checkpoint, but this fitllm build has no quantized loader "
                    "(fitllm.quant.load_quantized_model)")


class Scorer:
    """Log-probabilities of token sequences through the paged KV cache, in flat batches.

    Sequences are packed greedily into steps of at most `max_batch_tokens` tokens (a flat batch
    needs no padding, so packing in input order wastes nothing). One cache is allocated up front
    and reused: each step overwrites the slots it uses, and attention reads only up to seq_len.
    """

    def __init__(self, model: torch.nn.Module, cache_options: Optional[dict] = None, max_batch_tokens: int = 4096,
                 max_seq_len: int = 2048, block_size: int = 16):
        self.model, self.cache_options, self.block_size = model, dict(cache_options or {}), block_size
        self.max_batch_tokens = max(max_batch_tokens, max_seq_len)
        # One extra block per sequence covers rounding; 64 sequences per step is plenty.
        self.max_seqs = 64
        self.cache = self.new_cache(self.max_batch_tokens + self.max_seqs * block_size, 1)

    def new_cache(self, max_tokens: int, num_seqs: int):
        return make_cache(self.model, max_tokens, num_seqs=num_seqs, block_size=self.block_size, **self.cache_options)

    @property
    def kv_bytes_per_token(self) -> int:
        return int(self.cache.bytes_per_token)

    def _batches(self, seqs: Sequence[Sequence[int]]) -> Iterator[list[int]]:
        batch, tokens = [], 0
        for i, s in enumerate(seqs):
            if len(s) > self.max_batch_tokens:
                raise EvalError(f"a sequence of {len(s)} tokens exceeds the batch budget ({self.max_batch_tokens})")
            if batch and (tokens + len(s) > self.max_batch_tokens or len(batch) == self.max_seqs):
                yield batch
                batch, tokens = [], 0
            batch.append(i)
            tokens += len(s)
        if batch:
            yield batch

    @torch.inference_mode()
    def logprobs(self, seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> Iterator[tuple[int, torch.Tensor]]:
        """For each sequence i (in order): float32 log-softmax rows [len - starts[i], vocab], row j
        being the distribution that predicts token seqs[i][starts[i] + j]. starts[i] >= 1."""
        for batch in self._batches(seqs):
            tables, next_block = [], 0
            for i in batch:
                n = math.ceil(len(seqs[i]) / self.block_size)
                tables.append(list(range(next_block, next_block + n)))
                next_block += n
            chunks = [list(seqs[i]) for i in batch]
            hidden = forward_tokens(self.model, self.cache, chunks, [len(c) for c in chunks], tables)
            offset = 0
            for i, chunk in zip(batch, chunks):
                # Logits only for the rows needed, one sequence at a time, to bound memory.
                rows = hidden[offset + starts[i] - 1: offset + len(chunk) - 1]
                yield i, torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
                offset += len(chunk)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the weights occupy in memory: parameters, buffers, and tensors that quantized layers
    keep as plain attributes or inside small holder objects (packed weights, scales)."""
    tensors = list(model.parameters()) + list(model.buffers())
    for module in model.modules():
        values = list(vars(module).values())
        values += [x for v in values if isinstance(v, (list, tuple)) for x in v]  # e.g. a list of packed parts
        for value in values:
            if hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.Tensor)):
                tensors += [v for v in vars(value).values() if isinstance(v, torch.Tensor)]
            elif isinstance(value, torch.Tensor):
                tensors.append(value)
    seen, total = set(), 0
    for t in tensors:
        if t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def disk_bytes(folder: Optional[Path]) -> Optional[int]:
    if folder is None or not folder.is_dir():
        return None
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf"))
