"""Layer-by-layer quantization: calibration hidden states go through one decoder layer at a
time; the layer is quantized; its (quantized) outputs feed the next layer. Weights stream from
the safetensors files, so memory holds one layer plus the calibration activations."""
from __future__ import annotations

import functools
import json
import resource
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from safetensors import safe_open

from fitllm.models.config import MULTIMODAL, ModelConfig, text_only_config
from fitllm.models.decoder import DecoderLayer, RMSNorm, rope_cos_sin, rope_tables
from fitllm.models.linear import FusedLinear, dense_factory
from fitllm.models.loader import route, safetensors_files, text_model_name
from fitllm.quant.awq import awq_layer
from fitllm.quant.formats import get_format
from fitllm.quant.fp8 import fp8_quantize
from fitllm.quant.gptq import HessianAccumulator, gptq_quantize
from fitllm.quant.nf4 import nf4_quantize
from fitllm.quant.output import ShardWriter, atomic_output, copy_side_files
from fitllm.quant.rtn import rtn_quantize
from fitllm.quant.scheme import QuantError, QuantizedWeight, QuantScheme, choose_group_size

QUANT_SUFFIXES = ("qweight", "weight_packed", "weight_scale", "qzeros", "SCB", "absmax", "quant_state")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ConvertResult:
    output: Path
    scheme: QuantScheme
    group_note: str
    seconds: float
    peak_memory: int  # bytes: GPU peak allocation on CUDA, else the process's peak RSS
    layer_errors: list[float] = field(default_factory=list)
    size_bytes: int = 0
    calib_tokens: int = 0
    lm_head_error: Optional[float] = None  # relative logits error, when the lm_head was quantized


class CalibContext:
    """Causal attention over equal-length calibration sequences, batched (one SDPA call); `window`:
    the layer's sliding window, if it has one."""

    def __init__(self, seqs: int, length: int, window: Optional[int] = None):
        self.seqs, self.length = seqs, length
        self.mask = None
        if window is not None and window < length:
            pos = torch.arange(length)
            self.mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)

    def attend(self, layer, q, k, v, scale):
        t, h, d = q.shape
        shape = lambda z: z.reshape(self.seqs, self.length, z.shape[1], d).transpose(1, 2)
        mask = None if self.mask is None else self.mask.to(q.device)
        out = F.scaled_dot_product_attention(shape(q), shape(k), shape(v), attn_mask=mask, is_causal=mask is None,
                                             scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(t, h, d)


class TensorSource:
    """Random access to a checkpoint's tensors by name, without loading the rest. A multimodal
    checkpoint (Gemma 3 4B-27B, Mistral Small 3.x) shows its language model's tensors only, under text-only names."""

    def __init__(self, folder: Path, multimodal: bool = False):
        self.where: dict[str, tuple[object, str]] = {}  # name -> (file handle, name in the file)
        for f in safetensors_files(folder):
            handle = safe_open(str(f), framework="pt")
            for name in handle.keys():
                shown = text_model_name(name) if multimodal else name
                if shown is not None:
                    self.where[shown] = (handle, name)

    def get(self, name: str) -> torch.Tensor:
        handle, stored = self.where[name]
        return handle.get_tensor(stored)

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.where if n.startswith(prefix)]


def check_not_quantized(folder: Path, config: ModelConfig, src: TensorSource) -> None:
    if config.quantization_config:
        method = config.quantization_config.get("quant_method", "?")
        raise QuantError(f"{folder / 'config.json'}: the checkpoint is already quantized "
                         f"(quantization_config.quant_method = {method!r}); convert the original model")
    bad = next((n for n in src.where if n.rsplit(".", 1)[-1] in QUANT_SUFFIXES), None)
    if bad:
        raise QuantError(f"{folder}: tensor {bad!r} is already quantized; convert the original model")


def build_layer(config: ModelConfig, i: int, src: TensorSource, device) -> DecoderLayer:
    layer = DecoderLayer(config, i, dense_factory(torch.float32, device)).to(device)
    prefix = f"model.layers.{i}."
    modules = {f"{prefix}{n}" if n else prefix[:-1]: m for n, m in layer.named_modules()}
    params = {f"{prefix}{n}": p for n, p in layer.named_parameters()}
    for name in src.names(prefix):
        module, shard, suffix = route(name)
        t = src.get(name).to(device, torch.float32)
        if isinstance(modules.get(module), FusedLinear):
            modules[module].load(shard, suffix, t)
        elif isinstance(modules.get(module), RMSNorm) and suffix == "weight":
            modules[module].load_weight(t)
        elif name in params:
            params[name].data.copy_(t)
        elif "rotary_emb" not in name:
            raise QuantError(f"checkpoint tensor {name!r} does not fit the decoder layer")
    return layer


def linears(layer: DecoderLayer) -> dict[str, FusedLinear]:
    a, m = layer.self_attn, layer.mlp
    return {"qkv_proj": a.qkv_proj, "o_proj": a.o_proj, "gate_up_proj": m.gate_up_proj, "down_proj": m.down_proj}


@torch.no_grad()
def run_layer(layer, x: torch.Tensor, cos, sin, batch: int, on_input: Optional[Callable] = None) -> torch.Tensor:
    """x [S, L, H] -> layer output [S, L, H], `batch` sequences per call; on_input(name, x2d)
    sees every linear's input (hooks that build Hessians and activation statistics)."""
    handles = []
    if on_input is not None:
        for name, lin in linears(layer).items():
            handles.append(lin.register_forward_pre_hook(lambda mod, args, n=name: on_input(n, args[0])))
    try:
        s, l, h = x.shape
        out = torch.empty_like(x)
        for lo in range(0, s, batch):
            xb = x[lo:lo + batch]
            n = xb.shape[0]
            ctx = CalibContext(n, l, layer.self_attn.window)
            rope = (None, None) if cos is None else (cos.repeat(n, 1), sin.repeat(n, 1))  # None: a NoPE layer
            out[lo:lo + n] = layer(xb.reshape(-1, h), *rope, ctx).reshape(n, l, h)
        return out
    finally:
        for hd in handles:
            hd.remove()


# --- per-method steps: (layer, x, rope, scheme) -> ({fused name: quantized weight}, float output) ---

def step_rtn(layer, x, cos, sin, scheme, batch):
    y = run_layer(layer, x, cos, sin, batch)
    return {n: rtn_quantize(lin.weight, scheme) for n, lin in linears(layer).items()}, y


def step_fp8(layer, x, cos, sin, scheme, batch):
    amax = {}

    def see(name, inp):
        amax[name] = torch.maximum(amax.get(name, torch.zeros(())), inp.abs().max().float().cpu())

    y = run_layer(layer, x, cos, sin, batch, see if scheme.fp8_static_input else None)
    return {n: fp8_quantize(lin.weight, amax.get(n)) for n, lin in linears(layer).items()}, y


def step_gptq(layer, x, cos, sin, scheme, batch):
    hs = {n: HessianAccumulator(lin.in_features, x.device) for n, lin in linears(layer).items()}
    y = run_layer(layer, x, cos, sin, batch, lambda n, inp: hs[n].add(inp))
    return {n: gptq_quantize(lin.weight, hs[n].h, scheme) for n, lin in linears(layer).items()}, y


def step_awq(layer, x, cos, sin, scheme, batch, search_tokens: int = 2048):
    total = x.shape[0] * x.shape[1]
    stride = max(total // search_tokens, 1)
    sums, samples = {}, {}

    def see(name, inp):
        inp = inp.reshape(-1, inp.shape[-1]).float()
        sums[name] = sums.get(name, 0) + inp.abs().sum(0)
        samples.setdefault(name, []).append(inp[::stride])

    y = run_layer(layer, x, cos, sin, batch, see)
    feats = {n: (torch.cat(samples[n])[:search_tokens], sums[n] / total) for n in sums}
    return awq_layer(layer, feats, scheme), y


def step_nf4(layer, x, cos, sin, scheme, batch):
    y = run_layer(layer, x, cos, sin, batch)
    return {n: nf4_quantize(lin.weight, scheme.group_size) for n, lin in linears(layer).items()}, y


STEPS = {"rtn": step_rtn, "fp8": step_fp8, "gptq": step_gptq, "awq": step_awq, "nf4": step_nf4}
DATA_FREE = ("rtn", "fp8", "nf4")  # calibration only measures their per-layer error


@torch.no_grad()
def quantize_lm_head(x: torch.Tensor, src: TensorSource, config: ModelConfig, scheme: QuantScheme,
                     rows: int = 16384) -> tuple[QuantizedWeight, float]:
    """The lm_head (or the tied embedding table) quantized on the final norm of the calibration
    hidden states x [S, L, H]: GPTQ with their Hessian for --method gptq, else RTN (AWQ's scales
    would need a layer before it to fold into). GPTQ runs on `rows` output rows at a time (its
    error feedback stays within a row), so a 128k vocabulary never needs a float64 copy of the
    whole matrix. Returns the weight and the relative error of the logits on calibration tokens."""
    norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset).to(x.device)
    norm.load_weight(src.get("model.norm.weight"))
    h = norm(x.reshape(-1, x.shape[-1]))  # every calibration token's final hidden state
    name = "lm_head.weight" if "lm_head.weight" in src.where else "model.embed_tokens.weight"
    w = src.get(name).to(x.device, torch.float32)
    if scheme.method == "gptq":
        hessian = HessianAccumulator(w.shape[1], x.device)
        for lo in range(0, h.shape[0], 4096):
            hessian.add(h[lo:lo + 4096])
        parts = [gptq_quantize(w[lo:lo + rows], hessian.h, scheme) for lo in range(0, w.shape[0], rows)]
        qw = QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                             torch.cat([p.zero for p in parts]), scheme.bits, scheme.group_size, scheme.sym,
                             parts[0].g_idx)  # one Hessian, so one column order for every chunk
    else:
        qw = rtn_quantize(w, scheme)
    sample = h[::max(h.shape[0] // 512, 1)]
    ref = sample @ w.t()
    return qw, float((sample @ qw.dequantize().t() - ref).norm() / ref.norm().clamp(min=1e-12))


def split_rows(lin: FusedLinear, hf_names: list[str], qw) -> dict:
    return {name: qw.rows(lin.shard_slice(i)) for i, name in enumerate(hf_names)}


def hf_names(prefix: str, lin: FusedLinear) -> list[str]:
    from fitllm.quant.layers import shard_names

    return shard_names(prefix, len(lin.out_sizes))


def peak_memory(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_scheme(config: ModelConfig, method: str, bits: int, group_size: Optional[int], sym: Optional[bool],
                fmt: str, act_order: bool, static_groups: bool, fp8_static: bool) -> tuple[QuantScheme, str]:
    """Validate the request against the model and the format; pick the group size."""
    format_mod = get_format(fmt)
    if method == "fp8" and fmt != "compressed-tensors":
        raise QuantError(f"--format {fmt}: FP8 checkpoints are written as compressed-tensors only")
    if (method == "nf4") != (fmt == "bitsandbytes"):
        raise QuantError(f"--format {fmt}: NF4 checkpoints are written as bitsandbytes, and bitsandbytes "
                         "checkpoints hold NF4 (--method nf4 --format bitsandbytes)")
    sizes = [config.hidden_size, config.q_size, config.intermediate_size]
    if method == "nf4":  # bitsandbytes' default block of 64, not the integer methods' 128
        group, _ = choose_group_size(sizes, 64 if group_size is None else group_size)
        note = f"NF4 codes, one absmax per {group} weights" + (" (bitsandbytes' default)" if group_size is None else "")
    else:
        group, note = choose_group_size(sizes, group_size)
    if fmt == "compressed-tensors" and act_order and group != -1:
        static_groups = True  # compressed-tensors >= 0.20 has no g_idx
        note += "; act-order with static groups (compressed-tensors has no g_idx)"
    scale_dtype = torch.float16 if fmt in ("autoawq", "gptq") else DTYPES.get(config.torch_dtype, torch.float32)
    scheme = QuantScheme(method=method, bits=8 if method == "fp8" else bits, group_size=group,
                         sym=bool(sym), act_order=act_order, static_groups=static_groups,
                         fp8_static_input=fp8_static, scale_dtype=scale_dtype,
                         zero_min=1 if fmt == "gptq" and not sym else 0)
    if method != "fp8":
        format_mod.check_scheme(scheme)
    return scheme, ("FP8 e4m3, per-channel weight scales, " +
                    ("static per-tensor" if fp8_static else "dynamic per-token") + " activations"
                    if method == "fp8" else note)


def quantize_model(folder: Path, out: Path, method: str, bits: int = 4, group_size: Optional[int] = None,
                   sym: Optional[bool] = None, fmt: Optional[str] = None, calib: Optional[str] = None,
                   calib_samples: int = 32, calib_len: int = 512, act_order: Optional[bool] = None,
                   static_groups: bool = False, fp8_static: bool = False, force: bool = False,
                   device: str = "cpu", batch: int = 4, progress: bool = True,
                   lm_head_bits: Optional[int] = None, log: Callable[[str], None] = print) -> ConvertResult:
    """fmt: the checkpoint format (None: bitsandbytes for NF4, else compressed-tensors). lm_head_bits: quantize
    the lm_head too, to 4 or 8 bits (GPTQ format only); None keeps it dense."""
    start = time.time()
    folder = Path(folder)
    config = ModelConfig.from_file(folder)
    multimodal = config.architecture in MULTIMODAL
    src = TensorSource(folder, multimodal)
    check_not_quantized(folder, config, src)
    if fmt is None:
        fmt = "bitsandbytes" if method == "nf4" else "compressed-tensors"
    if sym is None:
        sym = False  # asymmetric: better on every model we measured, and all three formats carry it
    if act_order is None:
        act_order = method == "gptq"  # GPTQ: outlier-heavy inputs (q/k/v) gain most from it (RESULTS.md)
    scheme, note = make_scheme(config, method, bits, group_size, sym, fmt, act_order, static_groups, fp8_static)
    format_mod = get_format(fmt)
    lm_head = lm_head_bits is not None
    if lm_head and fmt != "gptq":
        raise QuantError(f"--quantize-lm-head: --format {fmt} keeps the lm_head dense; only --format gptq records "
                         "a quantized one (quantize_config `lm_head: true`, as GPTQModel writes and vLLM reads)")
    if lm_head and lm_head_bits not in (4, 8):
        raise QuantError(f"--lm-head-bits: {lm_head_bits} is not supported (4 or 8)")
    if lm_head:
        note += f"; lm_head quantized too ({lm_head_bits}-bit " + ("GPTQ" if method == "gptq" else "RTN") + ")"
    log(f"{method.upper()} -> {fmt}: {note}")
    if out.exists() and not force:
        raise QuantError(f"{out}: already exists (pass --force to replace it)")

    from fitllm.models.tokenizer import load_tokenizer
    from fitllm.quant.calibration import load_calibration

    if method in DATA_FREE and not fp8_static:
        calib_samples = min(calib_samples, 8)
    ids = load_calibration(folder, load_tokenizer(folder), calib_samples, calib_len, calib, progress=progress)
    ids = ids.to(device)
    seqs, length = ids.shape
    log(f"calibration: {seqs} x {length} tokens" + ("" if calib else " (built-in, generated by the model)"))
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    x = F.embedding(ids, src.get("model.embed_tokens.weight").to(device, torch.float32)) * config.embed_scale
    positions = torch.arange(length, device=device)
    local = None
    if config.local_rope_theta is not None:
        local = rope_cos_sin(positions, *rope_tables(config, device, local=True))
    ropes = config.layer_ropes(rope_cos_sin(positions, *rope_tables(config, device)), local)
    errors: list[float] = []
    write = format_mod.write
    if fmt == "bitsandbytes":  # its quant_state records the model's dtype
        write = functools.partial(write, dtype=format_mod.dtype_name(scheme))
    with atomic_output(out, force) as tmp, _progress(progress, config.num_layers + lm_head, method) as advance:
        writer = ShardWriter(tmp)
        for i in range(config.num_layers):
            layer = build_layer(config, i, src, device)
            cos, sin = ropes[i]
            quantized, y_float = STEPS[method](layer, x, cos, sin, scheme, batch)
            prefix = f"model.layers.{i}."
            # the next layer sees this layer as it will run: dequantized weights
            for name, lin in linears(layer).items():
                qw = quantized[name]
                lin.weight.data.copy_(qw.dequantize().to(lin.weight.dtype))
                mod_prefix = prefix + ("self_attn." if name in ("qkv_proj", "o_proj") else "mlp.") + name
                for hf, part in split_rows(lin, hf_names(mod_prefix, lin), qw).items():
                    for suffix, t in write(part).items():
                        writer.add(f"{hf}.{suffix}", t)
                if lin.bias is not None:
                    for hf, sl in zip(hf_names(mod_prefix, lin), map(lin.shard_slice, range(len(lin.out_sizes)))):
                        writer.add(f"{hf}.bias", lin.bias[sl])
            norm_dtype = DTYPES.get(config.torch_dtype, torch.float32)
            for mname, norm in layer.named_modules():
                if isinstance(norm, RMSNorm):  # (AWQ may have folded scales into them)
                    writer.add(f"{prefix}{mname}.weight", norm.stored_weight(norm_dtype))
            y = run_layer(layer, x, cos, sin, batch)
            errors.append(float((y - y_float).norm() / (y_float - x).norm().clamp(min=1e-12)))
            x = y
            del layer, quantized, y_float
            advance(i, errors[-1])
        head_error = None
        if lm_head:
            qw, head_error = quantize_lm_head(x, src, config, replace(scheme, bits=lm_head_bits))
            for suffix, t in format_mod.write(qw).items():
                writer.add(f"lm_head.{suffix}", t)
            advance(config.num_layers, head_error)
        for name in src.names():
            if not name.startswith("model.layers.") and "rotary_emb" not in name and not (lm_head and name == "lm_head.weight"):
                writer.add(name, src.get(name))
        size = writer.close()
        raw = json.loads((folder / "config.json").read_text())
        if multimodal:
            log("the language model is written alone, as a text-only checkpoint (the vision tower is not)")
            raw = text_only_config(raw, config)
        if lm_head:  # a quantized head next to the dense embedding table: no longer tied
            raw["quantization_config"] = format_mod.quantization_config(scheme, lm_head_bits)
            raw["tie_word_embeddings"] = False
        else:
            raw["quantization_config"] = format_mod.quantization_config(scheme)
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        copy_side_files(folder, tmp)
    return ConvertResult(out, scheme, note, time.time() - start, peak_memory(device), errors, size, seqs * length,
                         head_error)


class _progress:
    """A rich progress bar over layers with an ETA (or nothing, for tests and scripts)."""

    def __init__(self, show: bool, total: int, method: str):
        self.show, self.total, self.method = show, total, method

    def __enter__(self):
        if not self.show:
            return lambda i, err: None
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.bar = Progress(TextColumn(f"{self.method} layer"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("err {task.fields[err]}"), TimeElapsedColumn(), TextColumn("ETA"),
                            TimeRemainingColumn(), transient=False)
        self.bar.__enter__()
        task = self.bar.add_task("quantize", total=self.total, err="-")
        return lambda i, err: self.bar.update(task, advance=1, err=f"{err:.4f}")

    def __exit__(self, *exc):
        if self.show:
            self.bar.__exit__(*exc)
        return False
