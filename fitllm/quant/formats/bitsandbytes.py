"""bitsandbytes checkpoints (quant_method "bitsandbytes"), as transformers saves a model loaded with a
BitsAndBytesConfig, read and written without the library (its own functions are the tests' oracle).

4-bit (`load_in_4bit`), per linear [N out, K in]; B (blocksize, 64 by default) consecutive weights of the
row-major matrix share one absmax:
  weight                uint8 [N*K/2, 1]  two 4-bit codes a byte, the earlier weight in the high nibble (or those
                        bytes viewed as bnb_4bit_quant_storage, e.g. bf16 [N*K/4, 1])
  weight.quant_map      float32 [16]      each code's value in [-1, 1] (NF4's or FP4's table)
  weight.absmax         float32 [N*K/B], or with double quantization (`nested`) uint8, itself coded:
  weight.nested_absmax  float32 [ceil(N*K/B/NB)]   absmax = nested_quant_map[a] * nested_absmax[i // NB]
  weight.nested_quant_map float32 [256]             + nested_offset
  weight.quant_state.bitsandbytes__nf4 (or __fp4)  uint8 bytes of a JSON object: quant_type, blocksize,
                        dtype, shape [N, K], and nested_blocksize (NB), nested_dtype, nested_offset
  w = quant_map[code] * absmax[i // B]
8-bit (`load_in_8bit`, LLM.int8()): weight int8 [N, K], SCB float32 [N] (each row's absmax), weight_format
uint8 0 ("row"); w = q * SCB / 127. It becomes fitllm's 8-bit affine layout exactly (zero point 128, one
group per row), so the 8-bit GEMM kernels serve it; 4-bit codes become a CodebookWeight
(fitllm.kernels.codebook4). A module bitsandbytes left dense (lm_head, `llm_int8_skip_modules`) is read dense.
"""
from __future__ import annotations

import json

import torch

from fitllm.models.errors import ModelLoadError
from fitllm.quant.formats.packing import KernelWeight, pack_dim0
from fitllm.quant.scheme import CodebookWeight, QuantError, QuantScheme

STATE_PREFIX = "weight.quant_state.bitsandbytes__"
QUANT_TYPES = ("nf4", "fp4")


def _flags(qc: dict) -> tuple[bool, bool]:
    """(4-bit, 8-bit) as transformers writes them (both spellings)."""
    return (bool(qc.get("load_in_4bit", qc.get("_load_in_4bit", False))),
            bool(qc.get("load_in_8bit", qc.get("_load_in_8bit", False))))


def bits_of(qc: dict) -> int:
    return 4 if _flags(qc)[0] else 8


def check_supported(qc: dict, source: str) -> None:
    if sum(_flags(qc)) != 1:
        raise ModelLoadError(f"{source}: a bitsandbytes quantization_config needs exactly one of load_in_4bit and "
                             "load_in_8bit set")


def skipped_modules(qc: dict) -> list[str]:
    return list(qc.get("llm_int8_skip_modules") or []) + list(qc.get("modules_to_not_convert") or [])


def read(t: dict[str, torch.Tensor], qc: dict, dtype, name: str) -> KernelWeight | CodebookWeight:
    """The checkpoint tensors of one linear (`name`, its HF name) -> the runtime weight."""
    return _read_4bit(t, name) if bits_of(qc) == 4 else _read_8bit(t, dtype, name)


def _read_8bit(t: dict, dtype, name: str) -> KernelWeight:
    q, scb = t.get("weight"), t.get("SCB")
    if q is None or scb is None or q.dtype != torch.int8:
        raise ModelLoadError(f"{name}: a bitsandbytes 8-bit linear needs an int8 `weight` and its `SCB` "
                             f"(found {sorted(t)})")
    fmt = t.get("weight_format")
    if fmt is not None and int(fmt) != 0:  # 0: row-major; older files held GPU-specific tile orders
        raise ModelLoadError(f"{name}: bitsandbytes weight_format {int(fmt)} is not supported (only 0, row-major)")
    n, k = q.shape
    if scb.numel() != n:
        raise ModelLoadError(f"{name}: SCB has {scb.numel()} scales for {n} rows")
    unsigned = (q.to(torch.int32) + 128).t().contiguous()  # [K, N] in 0..255, zero point 128
    scales = (scb.float() / 127).reshape(1, n).to(dtype)
    zeros = torch.full((1, n), 128.0, dtype=dtype)
    return KernelWeight(pack_dim0(unsigned, 8), scales, zeros, bits=8, group_size=k)


def quant_state(t: dict, name: str) -> dict:
    keys = [key for key in t if key.startswith(STATE_PREFIX)]
    if len(keys) != 1:
        raise ModelLoadError(f"{name}: a bitsandbytes 4-bit linear needs one `{STATE_PREFIX}nf4|fp4` tensor "
                             f"(found {sorted(t)})")
    try:
        state = json.loads(bytes(t[keys[0]].to(torch.uint8).tolist()).decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{name}: unreadable bitsandbytes quant_state ({exc})") from None
    if state.get("quant_type") not in QUANT_TYPES:
        raise ModelLoadError(f"{name}: bitsandbytes quant_type {state.get('quant_type')!r} is not supported (nf4, fp4)")
    return state


def _read_4bit(t: dict, name: str) -> CodebookWeight:
    state = quant_state(t, name)
    packed, quant_map, absmax = t.get("weight"), t.get("weight.quant_map"), t.get("weight.absmax")
    if packed is None or quant_map is None or absmax is None:
        raise ModelLoadError(f"{name}: a bitsandbytes 4-bit linear needs weight, weight.absmax and weight.quant_map")
    if packed.dtype != torch.uint8:  # bnb_4bit_quant_storage bf16 / fp16 / fp32 (FSDP QLoRA): the same bytes
        packed = packed.contiguous().reshape(-1).view(torch.uint8)
    n, k = (int(v) for v in state.get("shape", (0, 0)))
    size = int(state.get("blocksize", 0))
    if n * k != packed.numel() * 2 or quant_map.numel() != 16:
        raise ModelLoadError(f"{name}: {packed.numel()} bytes and {quant_map.numel()} code values do not hold "
                             f"a 4-bit [{n}, {k}] matrix")
    if size <= 0 or size % 2 or k % size:
        raise ModelLoadError(f"{name}: blocksize {size} must be even and divide the input size {k} "
                             "(fitllm's kernel keeps each block inside one row)")
    absmax = _nested_absmax(t, state, name) if "nested_absmax" in state or "nested_blocksize" in state else absmax
    if absmax.numel() != n * k // size:
        raise ModelLoadError(f"{name}: {absmax.numel()} absmax values for {n * k // size} blocks")
    return CodebookWeight(packed.reshape(n, k // 2).contiguous(), absmax.float().reshape(n, k // size),
                          quant_map.float().contiguous(), size)


def _nested_absmax(t: dict, state: dict, name: str) -> torch.Tensor:
    """Double quantization: the uint8 absmax decoded through the 256-value nested map, per nested block."""
    codes, scales, values = t.get("weight.absmax"), t.get("weight.nested_absmax"), t.get("weight.nested_quant_map")
    if scales is None or values is None or codes.dtype != torch.uint8 or values.numel() != 256:
        raise ModelLoadError(f"{name}: double-quantized absmax needs uint8 weight.absmax, weight.nested_absmax and "
                             "a 256-value weight.nested_quant_map")
    block = int(state.get("nested_blocksize", 256))
    idx = torch.arange(codes.numel()) // block
    if int(idx[-1]) >= scales.numel():
        raise ModelLoadError(f"{name}: {scales.numel()} nested_absmax values for {codes.numel()} absmax codes")
    return values.float()[codes.long().reshape(-1)] * scales.float()[idx] + float(state.get("nested_offset", 0.0))



# --- writing (quant convert --method nf4): 4-bit NF4 without double quantization, the tensors and quant_state
# transformers itself saves (tested: transformers loads the files with the same weights); vLLM's loader reads the
# same layout for pre-quantized bitsandbytes checkpoints (not tested here)

BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes' GPU kernels take


def check_scheme(scheme: QuantScheme) -> None:
    if scheme.method != "nf4":
        raise QuantError(f"--format bitsandbytes carries NF4 codes (--method nf4), not {scheme.method}")
    if scheme.group_size not in BLOCK_SIZES:
        raise QuantError(f"--group-size: NF4 blocks of {scheme.group_size} are not supported "
                         f"({', '.join(map(str, BLOCK_SIZES))}; bitsandbytes' default is 64)")


def dtype_name(scheme: QuantScheme) -> str:
    """The model's dtype (make_scheme's scale_dtype), which bitsandbytes dequantizes and computes in."""
    return str(scheme.scale_dtype).removeprefix("torch.")


def quantization_config(scheme: QuantScheme) -> dict:
    compute_dtype = dtype_name(scheme)
    return {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
            "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False, "bnb_4bit_compute_dtype": compute_dtype,
            "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": None, "llm_int8_threshold": 6.0,
            "llm_int8_has_fp16_weight": False, "llm_int8_enable_fp32_cpu_offload": False}


def write(w: CodebookWeight, dtype: str = "bfloat16") -> dict[str, torch.Tensor]:
    """dtype: the model's (dtype_name), recorded in the quant_state."""
    n, k = w.codes.shape[0], w.in_features
    state = {"quant_type": "nf4", "blocksize": w.blocksize, "dtype": dtype, "shape": [n, k]}
    return {
        "weight": w.codes.reshape(-1, 1).contiguous(),
        "weight.absmax": w.absmax.float().reshape(-1).contiguous(),
        "weight.quant_map": w.codebook.float().clone(),  # one copy per matrix: safetensors refuses shared storage
        f"{STATE_PREFIX}nf4": torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8),
    }
