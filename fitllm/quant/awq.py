"""AWQ (Lin et al. 2023): protect the input channels that carry large activations by scaling
them up in the weight (and down in the op that feeds the linear, where it is free), searching
the scale exponent on a grid against the layer's float output; then search per-group clipping
of the weight range. Groups as in the paper: q|k|v after the input norm, gate|up after the
norm before the MLP (Llama's post-attention norm, Gemma's pre-feedforward one), down after up, o after
v only when their shapes match (not under GQA)."""
from __future__ import annotations

from typing import Callable

import torch

from fitllm.kernels.fused import silu_mul_ref
from fitllm.quant.rtn import rtn_quantize
from fitllm.quant.scheme import QuantizedWeight, QuantScheme


def fake_quant(w: torch.Tensor, scheme: QuantScheme, clip=None) -> torch.Tensor:
    return rtn_quantize(w, scheme, clip).dequantize()


def group_mean(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Mean over output rows of |w| normalised within each quantization group: [K]."""
    n, k = w.shape
    size = k if scheme.group_size == -1 else scheme.group_size
    a = w.abs().reshape(n, k // size, size)
    return (a / a.amax(dim=2, keepdim=True).clamp(min=1e-8)).reshape(n, k).mean(0)


def search_scale(w: torch.Tensor, x_mean: torch.Tensor, out_fn: Callable[[torch.Tensor], torch.Tensor],
                 scheme: QuantScheme, grid: int = 20) -> torch.Tensor:
    """Per-input-channel scale s [K] minimising |out_fn(Q(w*s)/s) - out_fn(w)|^2."""
    ref = out_fn(w)
    w_mean = group_mean(w, scheme)
    best, best_s = float("inf"), torch.ones_like(x_mean)
    for r in range(grid):
        a = r / grid
        s = (x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        loss = (out_fn(fake_quant(w * s, scheme) / s) - ref).pow(2).mean().item()
        if loss < best:
            best, best_s = loss, s
    return best_s


def search_clip(w: torch.Tensor, x: torch.Tensor, scheme: QuantScheme, steps: int = 20,
                max_shrink: float = 0.5, chunk: int = 512) -> torch.Tensor:
    """Per-(row, group) shrink of the weight range minimising each group's output error: [N, G]."""
    n, k = w.shape
    size = k if scheme.group_size == -1 else scheme.group_size
    xg = x.reshape(x.shape[0], k // size, size)
    clips = []
    for lo in range(0, n, chunk):
        wc = w[lo:lo + chunk]
        wg = wc.reshape(wc.shape[0], k // size, size)
        ref = torch.einsum("tgk,ngk->tng", xg, wg)
        best_err = torch.full(wg.shape[:2], float("inf"))
        best = torch.ones(wg.shape[:2])
        for i in range(int(max_shrink * steps)):
            c = torch.full(wg.shape[:2], 1 - i / steps)
            wq = fake_quant(wc, scheme, c).reshape_as(wg)
            err = (torch.einsum("tgk,ngk->tng", xg, wq) - ref).pow(2).mean(0)
            better = err < best_err
            best_err, best = torch.where(better, err, best_err), torch.where(better, c, best)
        clips.append(best)
    return torch.cat(clips)


@torch.no_grad()
def awq_layer(layer, feats: dict, scheme: QuantScheme, grid: int = 20) -> dict[str, QuantizedWeight]:
    """Scale, clip and quantize one DecoderLayer in place (norm weights and up rows absorb 1/s).

    feats[name] = (x sample [T, K], mean |x| [K]) for the inputs of qkv_proj, gate_up_proj, down_proj
    and o_proj, captured from the float layer. Returns quantized weights by fused module name."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o, gu, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
    inter = down.in_features

    # q|k|v after the input norm; the loss is on the fused projection's output
    x, m = feats["qkv_proj"]
    s = search_scale(qkv.weight.float(), m, lambda w: x @ w.t(), scheme, grid)
    layer.input_layernorm.weight.div_(s.to(layer.input_layernorm.weight.dtype))
    qkv.weight.mul_(s)
    feats["qkv_proj"] = (x / s, m / s)

    # gate|up after the post-attention norm; the loss is on the whole MLP's output
    x, m = feats["gate_up_proj"]
    wd = down.weight.float()

    def mlp_out(w):
        return silu_mul_ref(x @ w.t(), mlp.act) @ wd.t()

    s = search_scale(gu.weight.float(), m, mlp_out, scheme, grid)
    layer.mlp_norm.weight.div_(s.to(layer.mlp_norm.weight.dtype))
    gu.weight.mul_(s)
    feats["gate_up_proj"] = (x / s, m / s)

    # down after up: up's output rows absorb 1/s (SiLU(gate) * up is linear in up)
    x, m = feats["down_proj"]
    s = search_scale(down.weight.float(), m, lambda w: x @ w.t(), scheme, grid)
    gu.weight[inter:].div_(s[:, None])
    down.weight.mul_(s)
    feats["down_proj"] = (x / s, m / s)

    # o after v only for multi-head attention (under GQA v's rows do not line up with o's columns)
    if attn.num_heads == attn.num_kv_heads:
        x, m = feats["o_proj"]
        s = search_scale(o.weight.float(), m, lambda w: x @ w.t(), scheme, grid)
        v_rows = slice(qkv.out_features - o.in_features, qkv.out_features)
        qkv.weight[v_rows].div_(s[:, None])
        o.weight.mul_(s)
        feats["o_proj"] = (x / s, m / s)

    out = {}
    for name, lin in (("qkv_proj", qkv), ("o_proj", o), ("gate_up_proj", gu), ("down_proj", down)):
        w = lin.weight.float()
        clip = search_clip(w, feats[name][0][:512], scheme)
        if name == "qkv_proj":  # q and k feed attention scores: AWQ leaves their range unclipped
            clip[: (attn.num_heads + attn.num_kv_heads) * attn.head_dim] = 1.0  # (also when q|k|v is one shard)
        out[name] = rtn_quantize(w, scheme, clip)
    return out
