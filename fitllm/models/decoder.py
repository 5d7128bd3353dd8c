"""One decoder for Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, Phi-3/Phi-4, Gemma 3 and SmolLM3
(differences are config flags).

It runs on a flat batch: `input_ids [T]`, `positions [T]` and a context whose `attend` reads and
writes the KV cache. Linear layers come from a factory (dense, or quantized backends from
fitllm.quant), and q|k|v and gate|up are fused into one GEMM each.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fitllm.kernels import fused
from fitllm.kernels._utils import Gathered
from fitllm.models.config import ModelConfig, layer_window
from fitllm.models.linear import FusedLinear, LinearFactory, dense_factory


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self._in_order = None  # (perm, the weight's version, weight[perm])

    # Gemma's checkpoints store weight - 1 (offset 1.0): the module holds the weight it multiplies by,
    # and converts on the way in and out. It keeps that weight in float32 whatever the model's dtype,
    # and multiplies the normalised row by it in float32, rounding once (Gemma's reference: 1 + w in
    # bf16 alone would move each weight by up to 2^-9).
    def load_weight(self, stored: torch.Tensor) -> None:
        if self.offset:
            self.weight.data = stored.float().to(self.weight.device) + self.offset
        else:
            self.weight.data.copy_(stored)

    def stored_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() - self.offset).to(dtype)

    def _apply(self, fn, recurse=True):
        if not self.offset:
            return super()._apply(fn, recurse)
        exact = self.weight.data.float()
        out = super()._apply(fn, recurse)
        self.weight.data = exact.to(self.weight.device)  # moved, not cast
        return out

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, quant=None, perm=None):
        """Normalise in float32 as the reference implementations do, then cast back. With `residual`,
        normalises h = x + residual and returns (norm(h), h): the residual add, fused. quant: the next
        layer's FusedLinear.input_quant (the output may come quantized for it); perm: its input_perm
        (the output comes with its columns in that order)."""
        return fused.rms_norm(x, self.weight, self.eps, residual, quant, perm, self.weight_in_order(perm),
                              fp32_product=bool(self.offset))

    def weight_in_order(self, perm: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """weight[perm], which the kernel reads contiguously instead of gathering it (int4-act batch-1
        decode +1.9 %, H100: RESULTS.md, thirtieth session). Made once per perm, at load
        (CausalLM.fold_input_orders: never first inside a CUDA graph capture), and again only if the
        weight changes."""
        if perm is None:
            return None
        cached = self._in_order
        if cached is None or cached[0] is not perm or cached[1] != self.weight._version:
            cached = self._in_order = (perm, self.weight._version, self.weight[perm.long()].contiguous())
        return cached[2]


def rope_inv_freq(config: ModelConfig, long: bool = False, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2]; `long`: LongRoPE's set for sequences past the original
    context (rope_long_context); `local`: the sliding layers' own (Gemma 3: another base, unscaled)."""
    dim = config.rotary_dim or config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = config.rope_scaling
    if not scaling or local:
        return inv_freq
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "longrope":  # Phi-3: one rescaling factor per frequency, a short and a long set
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"longrope: {factors.numel()} factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
        factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: linear, llama3, longrope)")


def rope_long_context(config: ModelConfig) -> tuple[Optional[int], float]:
    """LongRoPE's switch and scale: (first position that selects the long factors, or None, and the
    factor cos and sin are multiplied by). Each token takes the long set when the position the
    forward's context gives for it reaches the original pretraining context (CausalLM.rope): its
    sequence's last position in the forward, or in the engine max(its own position, its prompt's
    last). So a prompt goes by its whole length, as transformers does for one sequence, however it
    is chunked; later tokens go by their own position however they are batched, verified or
    recomputed; and a request's tokens never depend on what it is batched with (vLLM and
    transformers' batched generate decide for the whole batch). Keys already cached keep the
    rotation they were written with, as in vLLM (transformers' generate instead recomputes a
    sequence's cache once it grows past the original context)."""
    scaling = config.rope_scaling or {}
    if (scaling.get("rope_type") or scaling.get("type")) != "longrope":
        return None, 1.0
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or int(scaling.get("max_position_embeddings") or config.max_position_embeddings) / original
    scale = scaling.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return original, float(scale)


def rope_tables(config: ModelConfig, device="cpu", local: bool = False):
    """(inv_freq, LongRoPE's long inv_freq or None, its switch position, the cos/sin scale): what
    rope_cos_sin takes after the positions. local: the sliding layers' (ModelConfig.layer_rope)."""
    if local:
        return rope_inv_freq(config, local=True).to(device), None, None, 1.0
    long_from, scale = rope_long_context(config)
    long_inv_freq = rope_inv_freq(config, long=True).to(device) if long_from is not None else None
    return rope_inv_freq(config).to(device), long_inv_freq, long_from, scale


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, long_inv_freq: Optional[torch.Tensor] = None,
                 long_from: Optional[int] = None, scale: float = 1.0,
                 last_positions: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim / 2] of each position (LongRoPE: rope_long_context, each token by its
    entry in `last_positions`; without it the positions are one sequence). The long/short choice is
    made on the device, so a CUDA graph replays it without a host sync."""
    p = positions.float()[:, None]
    freqs = p * inv_freq[None, :]
    if long_inv_freq is not None:
        last = positions.max() if last_positions is None else last_positions[:, None]
        freqs = torch.where(last >= long_from, p * long_inv_freq[None, :], freqs)
    if scale != 1.0:
        return freqs.cos() * scale, freqs.sin() * scale
    return freqs.cos(), freqs.sin()


# Steps of up to this many tokens get an act-order o_proj's input written in its order by the
# attention kernels (out_cols); longer ones let o_proj gather it (fused.gather_columns). Measured on
# an H100, Llama-3-8B shapes, act-order int4 decode steps: writing the order is 0.3-0.5 % faster at
# batch 1, 0.3 % slower at 8 and 1-1.7 % slower at 32-256 (scattered 2-byte stores from each of the
# many attention programs cost more than one row-gather launch). RESULTS.md, thirtieth session.
ATTENTION_WRITES_ORDER_UP_TO = 1


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, make_linear: LinearFactory):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = config.attn_scale or config.head_dim ** -0.5
        self.window = layer_window(config.attention_windows, layer)  # for contexts without a cache (quant)
        prefix = f"model.layers.{layer}.self_attn"
        # a fused checkpoint (Phi-3) holds q|k|v as one matrix: one shard, split after the GEMM as usual
        qkv = [config.q_size, config.kv_size, config.kv_size]
        self.qkv_proj = make_linear(f"{prefix}.qkv_proj", config.hidden_size,
                                    [sum(qkv)] if config.fused_checkpoint else qkv, config.qkv_bias)
        self.o_proj = make_linear(f"{prefix}.o_proj", config.q_size, [config.hidden_size], False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self._out_cols = None  # (o_proj's input_perm, where the attention writes each column)

    def forward(self, x, cos, sin, ctx, defer: bool = False):
        """defer: the caller hands the output to a fused RMSNorm (o_proj may return a PendingSum).
        cos, sin: None in a layer without RoPE (SmolLM3's NoPE layers)."""
        t = x.shape[0]
        # where RoPE rides in the cache write's launch, that launch also takes the qkv GEMM's
        # unfinished split-K sum (see kernels._utils.PendingSum; not with q/k norms or partial RoPE)
        rope_in_write = getattr(ctx, "fuses_rope", False) and cos is not None
        qkv = self.qkv_proj(x, defer=rope_in_write and self.q_norm is None and 2 * cos.shape[-1] == self.head_dim)
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                             self.num_kv_heads * self.head_dim], -1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # an act-order o_proj takes its input in its weight's order: written so by the attention
        # kernels where the context can (ForwardContext.writes_columns) and the step is short, else
        # it gathers it itself
        writes = getattr(ctx, "writes_columns", False) and t <= ATTENTION_WRITES_ORDER_UP_TO
        perm = self.o_proj.input_perm() if writes else None
        cols = {} if perm is None else {"out_cols": self.output_columns(perm)}
        if rope_in_write:  # RoPE in the launch that writes the cache
            out = ctx.attend(self.layer, q, k, v, self.scale, rope=(cos, sin), **cols)
        else:
            if cos is not None:
                q, k = fused.apply_rope(q, k, cos, sin)  # in place: q and k are views of the qkv output
            out = ctx.attend(self.layer, q, k, v, self.scale, **cols)
        out = out.reshape(t, -1)
        return self.o_proj(out if perm is None else Gathered(out, perm), defer=defer)

    def output_columns(self, perm: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """out_cols for o_proj's input_perm: input column perm[j] goes to position j (int32, made once
        per weight: at load, CausalLM.fold_input_orders, so never first inside a CUDA graph capture,
        which would record the argsort without running it); None without a perm."""
        if perm is None:
            return None
        if self._out_cols is None or self._out_cols[0] is not perm:
            self._out_cols = (perm, torch.argsort(perm.long()).to(torch.int32))
        return self._out_cols[1]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, make_linear: LinearFactory):
        super().__init__()
        prefix = f"model.layers.{layer}.mlp"
        gate_up = [config.intermediate_size] * 2
        self.gate_up_proj = make_linear(f"{prefix}.gate_up_proj", config.hidden_size,
                                        [sum(gate_up)] if config.fused_checkpoint else gate_up, False)
        self.down_proj = make_linear(f"{prefix}.down_proj", config.intermediate_size, [config.hidden_size], False)
        self.act = config.activation

    def forward(self, x: torch.Tensor, defer: bool = False):
        """defer: as Attention.forward's, for down_proj; gate_up_proj's sum always goes to SiLU·mul,
        which can take it pending (linear.FusedLinear.forward)."""
        act = fused.silu_mul(self.gate_up_proj(x, defer=True), self.down_proj.input_quant(), self.act)
        return self.down_proj(act, defer=defer)

    def fold_input_order(self) -> bool:
        """An act-order down_proj wants its input in its stored rows' order (input_perm): permute
        gate_up's outputs (gate's and up's alike) by that order instead, so that SiLU·mul writes it
        so and down_proj skips its gather launch. gate_up's rows and down_proj's columns then both
        follow that order; the MLP computes the same, bit for bit. False where nothing was done."""
        perm = self.down_proj.input_perm()
        if perm is None:
            return False
        p = perm.long()
        if not self.gate_up_proj.permute_outputs(torch.cat([p, p + p.numel()])):
            return False
        self.down_proj.forget_input_perm()
        return True


class DecoderLayer(nn.Module):
    """Llama's layer; with config.sandwich_norms Gemma's, whose modules keep its checkpoint names:
    post_attention_layernorm on the attention's output, pre_feedforward_layernorm before the MLP and
    post_feedforward_layernorm on its output (Llama's post_attention_layernorm is the one before the
    MLP: `mlp_norm` names it in both)."""

    def __init__(self, config: ModelConfig, layer: int, make_linear: LinearFactory):
        super().__init__()
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.input_layernorm = norm()
        self.self_attn = Attention(config, layer, make_linear)
        self.post_attention_layernorm = norm()
        if config.sandwich_norms:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.mlp = MLP(config, layer, make_linear)
        self.sandwich = config.sandwich_norms

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm whose output the MLP takes."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def forward(self, x, cos, sin, ctx) -> torch.Tensor:
        """x -> the layer's output (input to the next layer); one layer on its own, as calibration runs it."""
        out, residual = self.forward_residual(x, None, cos, sin, ctx)
        return out + residual

    def forward_residual(self, x, residual, cos, sin, ctx, defer: bool = False):
        """The same layer with the residual stream carried beside it (vLLM style), so each residual
        add is fused into the norm after it: (x, residual) -> (mlp output, residual), where the
        hidden state is their sum. residual=None for the first layer (x is then the embedding).
        defer: the mlp output goes to a fused RMSNorm with the residual (it may be a PendingSum)."""
        # fp8 GEMMs (and batch-1 4-bit ones on dp4a) get their input quantized by the norm, act-order
        # ones in their weight's order
        qkv, gate_up = self.self_attn.qkv_proj, self.mlp.gate_up_proj
        quant, perm = qkv.input_quant(), qkv.input_perm()
        if residual is None:
            residual, x = x, self.input_layernorm(x, quant=quant, perm=perm)
        else:
            x, residual = self.input_layernorm(x, residual, quant, perm)
        x = self.self_attn(x, cos, sin, ctx, defer=True)
        if self.sandwich:
            x = self.post_attention_layernorm(x)
        x, residual = self.mlp_norm(x, residual, gate_up.input_quant(), gate_up.input_perm())
        if self.sandwich:
            return self.post_feedforward_layernorm(self.mlp(x, defer=True)), residual
        return self.mlp(x, defer=defer), residual


class Backbone(nn.Module):
    """Named `model` inside CausalLM so parameter names match HF checkpoints."""

    def __init__(self, config: ModelConfig, make_linear: LinearFactory):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, make_linear) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, make_linear: Optional[LinearFactory] = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        make_linear = make_linear or dense_factory(dtype, device)
        with torch.device(device):
            self.model = Backbone(config, make_linear)
            # lm_head stays dense (it is the layer most sensitive to quantization) unless the
            # checkpoint holds it quantized (GPTQ `lm_head: true`): then the factory builds it.
            if getattr(make_linear, "quantizes_lm_head", False):
                self.lm_head = make_linear("lm_head", config.hidden_size, [config.vocab_size], False)
            elif config.tie_word_embeddings:
                self.lm_head = None
            else:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                self.lm_head.weight.requires_grad_(False)
        # Embeddings and norms take the compute dtype; linear layers chose their own storage
        # (Module.to would also cast fp8 weights, which count as floating point).
        for module in self.modules():
            if not isinstance(module, FusedLinear):
                for p in module.parameters(recurse=False):
                    p.data = p.data.to(dtype)
        inv_freq, long_inv_freq, self.rope_long_from, self.rope_scale = rope_tables(config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)
        local = rope_tables(config, device, local=True)[0] if config.local_rope_theta is not None else None
        self.register_buffer("local_inv_freq", local, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for a flat batch of T tokens."""
        local = rope_cos_sin(positions, self.local_inv_freq) if self.local_inv_freq is not None else None
        ropes = self.config.layer_ropes(self.rope(positions, ctx), local)
        x, residual = self.embed(input_ids), None
        for layer, (cos, sin) in zip(self.model.layers, ropes):
            x, residual = layer.forward_residual(x, residual, cos, sin, ctx, defer=True)
        return self.model.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings, scaled where the model scales them (Gemma: by sqrt(hidden), rounded to the
        model dtype first, as transformers does)."""
        x = self.model.embed_tokens(input_ids)
        return x if self.config.embed_scale == 1.0 else x * torch.tensor(self.config.embed_scale, dtype=x.dtype)

    def rope(self, positions: torch.Tensor, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the positions; LongRoPE asks the context which position each token's factors
        go by (rope_long_context; a context that cannot say holds one sequence)."""
        ask = getattr(ctx, "last_positions", None) if self.long_inv_freq is not None else None
        last = ask(positions) if ask is not None else None
        return rope_cos_sin(positions, self.inv_freq, self.long_inv_freq, self.rope_long_from, self.rope_scale, last)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, FusedLinear):  # a quantized lm_head
            return self.lm_head(hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def fold_input_orders(self) -> int:
        """After loading: each act-order down_proj's input order moved into its gate_up
        (MLP.fold_input_order), and the orders that producers write made: each act-order o_proj's
        column map for the attention, each norm's weight in its GEMM's input order. Returns how many
        MLPs changed."""
        for layer in self.model.layers:
            layer.self_attn.output_columns(layer.self_attn.o_proj.input_perm())
            layer.input_layernorm.weight_in_order(layer.self_attn.qkv_proj.input_perm())
            layer.mlp_norm.weight_in_order(layer.mlp.gate_up_proj.input_perm())
        return sum(layer.mlp.fold_input_order() for layer in self.model.layers)

    def fused_linears(self) -> dict[str, FusedLinear]:
        return {name: m for name, m in self.named_modules() if isinstance(m, FusedLinear)}
