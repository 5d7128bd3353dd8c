"""Quantized linear layers for the decoder, and the factory that picks them from a checkpoint's
`quantization_config` (compressed-tensors, AutoAWQ GEMM, GPTQ v1/v2, bitsandbytes).

Every 4/8-bit layout is repacked at load time into fitllm's one kernel layout (KernelWeight),
so one GEMM serves them all: fitllm.kernels.w4a16 on a GPU, a torch dequantize + matmul on CPU.
On a GPU, 4- and 8-bit weights with 16-bit activations are repacked once more into the tiled layout
of fitllm.kernels.w4a16_tiled (TiledWeight), whose kernels are faster at every batch size. Act-order
weights (g_idx) of any width get their input rows sorted by group there, so the kernels for plain
groups serve them, given x in that order: written so by the producer where it can (input_perm,
decoder.MLP.fold_input_order, the attention's out_cols), else gathered here.
FITLLM_W4_LAYOUT=standard keeps the standard layout (A/B benchmarks).
"""
from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from fitllm.kernels._utils import X16, Fp8Activations, Fp8Input, Gathered, X16Input, backend_for
from fitllm.models.config import MULTIMODAL, ModelConfig
from fitllm.models.errors import ModelLoadError
from fitllm.models.linear import FusedLinear, LinearFactory, dense_factory
from fitllm.models.loader import FUSED_SHARDS, checkpoint_spellings, load_model
from fitllm.quant.formats.packing import KernelWeight, TiledWeight
from fitllm.quant.scheme import CodebookWeight, FP8Weight

FP8_MAX = 448.0
# fused module -> its checkpoint matrices, in shard order
SHARD_NAMES = {}
for _hf, (_fused, _i) in FUSED_SHARDS.items():
    SHARD_NAMES.setdefault(_fused, {})[_i] = _hf


def shard_names(prefix: str, n: int) -> list[str]:
    """HF names of the matrices a fused module of n shards holds: `...qkv_proj` -> [...q_proj,
    ...k_proj, ...v_proj]; a module of one shard is its own checkpoint matrix (o_proj, or the
    qkv_proj of a checkpoint that stores it fused, as Phi-3's do)."""
    head, _, last = prefix.rpartition(".")
    if last in SHARD_NAMES and n == len(SHARD_NAMES[last]):
        return [f"{head}.{SHARD_NAMES[last][i]}" for i in range(n)]
    return [prefix]


Reader = Callable[[dict, str], object]  # (tensors of one checkpoint matrix, its HF name) -> KernelWeight | FP8Weight


class QuantLinear(FusedLinear):
    """Collects each shard's checkpoint tensors, converts them in finalize(), then serves GEMMs."""

    def __init__(self, prefix, in_features, out_sizes, bias, reader: Reader, dtype, device):
        super().__init__(prefix, in_features, out_sizes, bias)
        self.reader, self.dtype, self.device = reader, dtype, device
        self.names = shard_names(prefix, len(self.out_sizes))
        self.pending: list[dict] = [{} for _ in self.out_sizes]
        self.bias = torch.zeros(self.out_features, dtype=dtype, device=device) if bias else None
        self.parts: list = []  # KernelWeight or FP8Weight, one per output slice after finalize
        self.fp8_mode = "w8a8"  # or "w8a16": weight-only (what a GPU without FP8 tensor cores runs)

    def load(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        if name == "bias":
            if self.bias is None:
                raise ModelLoadError(f"{self.prefix}: unexpected bias")
            self.bias[self.shard_slice(shard)].copy_(tensor)
            return
        self.pending[shard][name] = tensor

    def finalize(self) -> None:
        parts = []
        for shard, (tensors, name) in enumerate(zip(self.pending, self.names)):
            if not tensors:
                raise ModelLoadError(f"{name}: no quantized tensors in the checkpoint")
            if set(tensors) == {"weight"}:
                raise ModelLoadError(f"{name}: stored dense (a plain weight), but the quantization config quantizes "
                                     "it (no ignore / dynamic / modules_to_not_convert rule names it)")
            part = self.reader(tensors, name)
            n, k = _out_features(part), (part.weight.shape[1] if isinstance(part, FP8Weight) else part.in_features)
            if (n, k) != (self.out_sizes[shard], self.in_features):
                raise ModelLoadError(f"{name}: quantized weight is [{n}, {k}], config expects "
                                     f"[{self.out_sizes[shard]}, {self.in_features}]")
            parts.append(part)
        self.set_parts(_merge(parts))

    def set_parts(self, parts: list) -> None:
        """Install converted weights: moved to the device, 4-bit ones tiled for the GPU kernels."""
        self.pending = []
        self.parts = [_to_runtime(p, self.device, self.dtype) for p in parts]

    def input_quant(self) -> Fp8Input | X16Input | None:
        """One W8A8 fp8 GEMM: its producer may quantize x for it (FITLLM_FP8_FUSED_QUANT=0 turns that off,
        A/B runs); one 4-bit tiled GEMM whose batch-1 GEMV runs on dp4a (w4a16_dp4a.dp4a_wanted;
        FITLLM_W4_DP4A=0 turns it off): the producer of one row may hand it X16."""
        one = self.parts[0] if len(self.parts) == 1 else None
        if (isinstance(one, FP8Weight) and self.fp8_mode == "w8a8"
                and os.environ.get("FITLLM_FP8_FUSED_QUANT", "1") != "0"):
            return Fp8Input(one.input_scale)
        if isinstance(one, TiledWeight):
            from fitllm.kernels.w4a16_dp4a import dp4a_wanted

            if dp4a_wanted(one.bits, one.group_size, one.in_features, one.perm, one.qtile.device):
                return X16Input()
        return None

    def input_perm(self) -> torch.Tensor | None:
        """One act-order GEMM with its rows sorted by group: the order its stored rows hold the input
        columns in (TiledWeight.perm, KernelWeight.perm), which its producer may write x in (a
        Gathered x; see FusedLinear.input_perm). FITLLM_ACT_ORDER_FOLD=0: None, the layer gathers
        (A/B runs)."""
        one = self.parts[0] if len(self.parts) == 1 else None
        perm = one.perm if isinstance(one, (TiledWeight, KernelWeight)) else None
        # (the environment is read for act-order weights only: the decoder asks on every eager step)
        return perm if perm is not None and os.environ.get("FITLLM_ACT_ORDER_FOLD", "1") != "0" else None

    def forget_input_perm(self) -> None:
        """The producer now writes x in input_perm's order for good (decoder.MLP.fold_input_order)."""
        self.parts[0].perm = None

    def permute_outputs(self, idx: torch.Tensor) -> bool:
        """Output j becomes output idx[j] (rows of every part, and the bias); False, unchanged, when
        idx mixes outputs of different parts."""
        new, start = [], 0
        for p in self.parts:
            n = _out_features(p)
            local = idx[start:start + n] - start
            if local.numel() != n or bool(((local < 0) | (local >= n)).any()):
                return False
            new.append(p.rows(local) if isinstance(p, (FP8Weight, CodebookWeight)) else p.permute_outputs(local))
            start += n
        self.parts = new
        if self.bias is not None:
            self.bias = self.bias[idx]
        return True

    def forward(self, x: torch.Tensor | Fp8Activations | Gathered, defer: bool = False):
        """y = x W^T (+ bias). defer (x 2-D, the decoder's consumers only): the GEMM may return a
        PendingSum that one of fitllm.kernels.fused's kernels takes (see _utils.PendingSum). x may
        be Fp8Activations or X16 where input_quant asked for them, Gathered where input_perm did."""
        if defer and len(self.parts) == 1 and self.bias is None and len(x.shape) == 2:
            return self._gemm(x, self.parts[0], defer=True)
        outs = [self._gemm(x, p) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if self.bias is None else y + self.bias

    def _gemm(self, x, p, defer: bool = False):
        if isinstance(x, Gathered) and getattr(p, "perm", None) is not x.perm:
            raise ValueError(f"{self.prefix}: x was gathered for another weight")
        if isinstance(p, FP8Weight):
            return fp8_linear(x, p, self.fp8_mode, defer)
        if isinstance(p, CodebookWeight):
            return codebook_linear(x, p)
        if isinstance(x, X16):  # one row, as input_quant asked of the producer
            from fitllm.kernels.w4a16_dp4a import dp4a_gemv

            return dp4a_gemv(x, p.qtile, p.scales, p.zeros, p.group_size, defer=defer)
        shape = x.shape
        x2 = _in_stored_order(x, p.perm)
        if isinstance(p, TiledWeight):
            from fitllm.kernels.w4a16_tiled import w4a16_tiled_gemm

            y = w4a16_tiled_gemm(x2, p.qtile, p.scales, p.zeros, p.group_size, p.in_features, defer=defer, bits=p.bits)
            return y if defer else y.reshape(*shape[:-1], y.shape[-1])
        kept = _kept_dense(p, x2)
        if kept is not None:  # the torch reference's product, its dequantization done once
            y = x2 @ kept
        else:
            try:  # Triton on CUDA, its torch reference on CPU
                from fitllm.kernels.w4a16 import w4a16_gemm
            except ImportError:  # no Triton (then nothing was sorted: perm is None)
                y = F.linear(x2, p.dequantize(x2.dtype))
            else:
                y = w4a16_gemm(x2, p.qweight, p.scales, p.zeros, p.group_size, bits=p.bits, g_idx=p.g_idx)
        return y.reshape(*shape[:-1], y.shape[-1])

    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] float32 (tests, evaluation tools)."""
        return torch.cat([p.dequantize(torch.float32) for p in self.parts], dim=0)


# On a CPU the kernels' torch reference dequantizes a weight at every call: a quantized checkpoint of the
# embedded model decoded ~10x slower than the dense one (32 tokens: 15.5 s against 1.5 s, 2-core CPU,
# benchmarks/cpu_decode_speed.py). Each weight's dequantized copy ([K, N], as the reference makes it) is kept
# instead (1.5 s), while all kept copies together fit FITLLM_CPU_DEQUANT_CACHE_MB (default 4096; 0 turns it
# off); past that, per call as before.
_KEPT = {"bytes": 0, "lock": threading.Lock()}


def _kept_dense(p: KernelWeight | CodebookWeight, x: torch.Tensor) -> Optional[torch.Tensor]:
    """p's dequantized weight [K, N] in x's dtype, where x takes the torch reference (a CPU tensor on the default
    backend) and the budget allows; else None (the GEMM's own path)."""
    if x.is_cuda or backend_for(x) == "triton":
        return None
    dtype = x.dtype
    w = getattr(p, "kept_dense", None)
    if w is not None:
        return w if w.dtype == dtype else None
    nbytes = p.in_features * _out_features(p) * dtype.itemsize
    budget = float(os.environ.get("FITLLM_CPU_DEQUANT_CACHE_MB", "4096")) * 2**20
    with _KEPT["lock"]:
        if _KEPT["bytes"] + nbytes > budget:
            return None
        _KEPT["bytes"] += nbytes
    if isinstance(p, CodebookWeight):
        p.kept_dense = p.dequantize(dtype).t()
    else:
        from fitllm.kernels.w4a16 import dequantize_packed

        p.kept_dense = dequantize_packed(p.qweight, p.scales, p.zeros, p.group_size, p.bits, p.g_idx, dtype=dtype)
    weakref.finalize(p, _release_kept, nbytes)  # the budget is the live weights'
    return p.kept_dense


def _release_kept(nbytes: int) -> None:
    with _KEPT["lock"]:
        _KEPT["bytes"] -= nbytes


def _in_stored_order(x, perm) -> torch.Tensor:
    """x [..., K] as 2-D rows whose columns follow a weight's stored rows: a Gathered x as its
    producer wrote it (input_perm), else gathered by perm (act-order rows sorted by group), else x."""
    if isinstance(x, Gathered):
        return x.x
    x2 = x.reshape(-1, x.shape[-1])
    if perm is None:
        return x2
    from fitllm.kernels.fused import gather_columns

    return gather_columns(x2, perm)


def _out_features(part) -> int:
    """N of a converted weight (FP8Weight [N, K]; CodebookWeight codes [N, K/2]; KernelWeight and TiledWeight
    scales [G, N])."""
    if isinstance(part, CodebookWeight):
        return part.codes.shape[0]
    return part.weight.shape[0] if isinstance(part, FP8Weight) else part.scales.shape[1]


def fp8_linear(x: torch.Tensor | Fp8Activations, p: FP8Weight, mode: str, defer: bool = False):
    if isinstance(x, Fp8Activations) or x.is_cuda or backend_for(x) == "triton":
        from fitllm.kernels.fp8 import fp8_gemm

        return fp8_gemm(x, p.weight, p.scale, input_scale=p.input_scale, mode=mode, defer=defer)
    if mode == "w8a8":  # reference: activations rounded through e4m3 exactly as the kernel would
        if p.input_scale is None:
            s = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        else:
            s = p.input_scale.float().reshape(1, 1)
        x = ((x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).to(x.dtype)
    return F.linear(x, p.dequantize(x.dtype))


def codebook_linear(x: torch.Tensor, p: CodebookWeight) -> torch.Tensor:
    """A bitsandbytes 4-bit GEMM: fitllm's codebook kernel on a GPU; on a CPU the reference's product, with
    the weight dequantized once and kept while the budget allows (as for KernelWeight)."""
    x2 = x.reshape(-1, x.shape[-1])
    kept = _kept_dense(p, x2)
    if kept is not None:
        y = x2 @ kept
    else:
        from fitllm.kernels.codebook4 import codebook4_gemm

        y = codebook4_gemm(x2, p.codes, p.absmax, p.codebook, p.blocksize)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _merge(parts: list) -> list:
    """One GEMM for q|k|v when the shards agree on layout (same g_idx); else one per shard."""
    if len(parts) == 1:
        return parts
    if all(isinstance(p, FP8Weight) for p in parts):
        static = [p.input_scale for p in parts if p.input_scale is not None]
        return [FP8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.stack([s.reshape(()) for s in static]).max() if static else None)]
    if all(isinstance(p, CodebookWeight) for p in parts):
        a = parts[0]
        if all(p.blocksize == a.blocksize and torch.equal(p.codebook, a.codebook) for p in parts):
            return [CodebookWeight(torch.cat([p.codes for p in parts]), torch.cat([p.absmax for p in parts]),
                                   a.codebook, a.blocksize)]
        return parts
    if all(isinstance(p, KernelWeight) for p in parts):
        a = parts[0]
        same = all(p.bits == a.bits and p.group_size == a.group_size and
                   ((p.g_idx is None and a.g_idx is None) or
                    (p.g_idx is not None and a.g_idx is not None and torch.equal(p.g_idx, a.g_idx)))
                   for p in parts)
        if same:
            return [KernelWeight(torch.cat([p.qweight for p in parts], 1), torch.cat([p.scales for p in parts], 1),
                                 torch.cat([p.zeros for p in parts], 1), a.bits, a.group_size, a.g_idx)]
    return parts


def _to_runtime(p, device, dtype):
    """A converted weight on `device`, in the form its kernels there take (gpu_form on a GPU)."""
    if isinstance(p, FP8Weight):
        return FP8Weight(p.weight.to(device), p.scale.to(device),
                         None if p.input_scale is None else p.input_scale.to(device))
    if isinstance(p, CodebookWeight):
        return p.to(device)
    p = KernelWeight(p.qweight.to(device), p.scales.to(device), p.zeros.to(device), p.bits, p.group_size,
                     None if p.g_idx is None else p.g_idx.to(device))
    return gpu_form(p, dtype) if torch.device(device).type == "cuda" else p


def gpu_form(p: KernelWeight, dtype: torch.dtype) -> KernelWeight | TiledWeight:
    """How a GPU serves a KernelWeight: act-order rows sorted by group (any width), so the kernels for
    plain groups take it with x in that order (perm; the g_idx kernels are the slow legacy rows: 4-bit
    sorted and tiled is 3.2-3.8x faster at M <= 64, RESULTS.md, twenty-seventh session), and 4- and
    8-bit weights the tiled kernels take tiled. The CPU keeps the stored form (its torch reference gains
    nothing by sorting)."""
    p = p.grouped_by_permutation() or p
    if os.environ.get("FITLLM_W4_LAYOUT", "tiled") != "standard":
        from fitllm.kernels.w4a16_tiled import tiled_supported

        if tiled_supported(p.bits, p.group_size, p.in_features, p.g_idx, dtype):
            return TiledWeight.from_kernel(p)
    return p


def quant_factory(qc: Optional[dict], dtype: torch.dtype, device, source: str = "config.json",
                  multimodal: bool = False) -> LinearFactory:
    """The make_linear factory for a checkpoint whose config.json holds `qc`. multimodal: the checkpoint
    names the text model otherwise (model.language_model.layers...), and so may its quantization rules."""
    if not qc:
        return dense_factory(dtype, device)
    from fitllm.quant.formats import get_format

    def aliases(name: str) -> list[str]:
        return checkpoint_spellings(name)[1:] if multimodal else []

    method = str(qc.get("quant_method", "")).lower()
    dense = dense_factory(dtype, device)
    if method == "compressed-tensors":
        compressed_tensors = get_format("compressed-tensors")

        def make(prefix, in_features, out_sizes, bias):
            names = shard_names(prefix, len(out_sizes))
            groups = [compressed_tensors.scheme_for(qc, n, aliases(n)) for n in names]
            if all(g is None for g in groups):
                return dense(prefix, in_features, out_sizes, bias)
            if any(g is None for g in groups):
                raise ModelLoadError(f"{source}: {prefix} fuses quantized and unquantized matrices ({names})")
            reader = lambda t, name: compressed_tensors.read(t, compressed_tensors.scheme_for(qc, name, aliases(name)),
                                                             dtype, name)
            return QuantLinear(prefix, in_features, out_sizes, bias, reader, dtype, device)
        return make
    if method == "awq":
        if str(qc.get("version", "gemm")).lower() != "gemm":
            raise ModelLoadError(f"{source}: quantization_config.version {qc.get('version')!r}: only AutoAWQ 'gemm' is supported")
        if int(qc.get("bits", 4)) != 4:
            raise ModelLoadError(f"{source}: quantization_config.bits must be 4 for AWQ")
        reader = lambda t, name: get_format("autoawq").read(t, qc, dtype)
    elif method == "bitsandbytes":
        bnb = get_format("bitsandbytes")
        bnb.check_supported(qc, source)
        reader = lambda t, name: bnb.read(t, qc, dtype, name)
    elif method == "gptq":
        if qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
            raise ModelLoadError(f"{source}: quantization_config.checkpoint_format {qc.get('checkpoint_format')!r} is not supported")
        if str(qc.get("pack_dtype") or "int32").removeprefix("torch.") != "int32":  # GPTQModel may pack in int8/16/64
            raise ModelLoadError(f"{source}: quantization_config.pack_dtype {qc['pack_dtype']!r} is not supported "
                                 "(GPTQ words must be int32)")
        gptq = get_format("gptq")
        reader = lambda t, name: gptq.read(t, gptq.module_config(qc, name, aliases(name)), dtype)
    else:
        raise ModelLoadError(f"{source}: quantization_config.quant_method {method!r} is not supported "
                             "(compressed-tensors, awq, gptq, bitsandbytes)")
    skip = set(bnb.skipped_modules(qc) if method == "bitsandbytes" else qc.get("modules_to_not_convert") or [])

    def make(prefix, in_features, out_sizes, bias):
        if any(s and s in p for s in skip for p in (prefix, *aliases(prefix))):
            return dense(prefix, in_features, out_sizes, bias)
        if method == "gptq":  # `dynamic` rules may leave modules dense
            names = shard_names(prefix, len(out_sizes))
            kept = [gptq.module_config(qc, n, aliases(n)) is not None for n in names]
            if not any(kept):
                return dense(prefix, in_features, out_sizes, bias)
            if not all(kept):
                raise ModelLoadError(f"{source}: {prefix} fuses quantized and unquantized matrices ({names})")
        return QuantLinear(prefix, in_features, out_sizes, bias, reader, dtype, device)
    # GPTQ's `lm_head: true` (GPTQModel, vLLM): the lm_head is quantized too, and CausalLM asks us for it
    make.quantizes_lm_head = method == "gptq" and bool(qc.get("lm_head", False))
    return make


def load_quantized_model(folder: Path, device="cpu", dtype: Optional[torch.dtype] = None,
                         quantize: Optional[str] = None):
    """Load any checkpoint fitllm reads: dense, compressed-tensors, AutoAWQ GEMM, GPTQ or bitsandbytes.
    quantize (int4 | fp8 | nf4): a dense checkpoint quantized as it loads (fitllm.quant.inplace.at_load_factory)."""
    from fitllm.models.loader import default_dtype

    folder = Path(folder)
    config = ModelConfig.from_file(folder)
    dtype = dtype or default_dtype(device)
    if quantize is not None:
        if config.quantization_config:
            raise ModelLoadError(f"{folder / 'config.json'}: --quantization {quantize} needs a dense checkpoint; this "
                                 f"one is already quantized ({config.quantization_config.get('quant_method')!r})")
        from fitllm.quant.inplace import at_load_factory

        factory = at_load_factory(quantize, config, dtype, device)
        config.quantized_at_load = quantize
        return load_model(folder, device, dtype, make_linear=factory, config=config)
    factory = quant_factory(config.quantization_config, dtype, device, source=str(folder / "config.json"),
                            multimodal=config.architecture in MULTIMODAL)
    return load_model(folder, device, dtype, make_linear=factory, config=config)
