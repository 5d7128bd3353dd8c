"""Search for KV-cache quantization schemes: perplexity with fake-quantized K/V (CPU, scratch tool).

Keys and values are quantized and dequantized in model space inside attention (no paged cache),
so a scheme can be tried before it is built. The embedded SmolLM2 on WikiText-2 test, windows of
1024 tokens; statistics (means, fp8 scales) from 8 x 512 tokens at the end of the file, as
benchmarks/kv_accuracy.py does. A scheme is "k:OPTS|v:OPTS" (either side may be left out);
OPTS is a comma list:
  fp8 | int8 | int4 | bf16          format
  tensor | head | token             fp8 scale: calibrated per layer / per kv head, or dynamic per token-head
  clipX                             calibrated fp8 scale = X * amax / 448 (X = 2: headroom)
  16 | 32 | 64                      int4 group size (values per scale and zero)
  mean                              subtract the calibrated per-channel mean first
  kivi                              divide by sqrt(per-channel range) (folded into q in the real cache)
  rot | rots                        Hadamard rotation of the head (rots: with random signs)
  mse                               int4: per group, the range shrink (1 .. 0.8) with the least error

    python benchmarks/kv_fakequant.py 6 "none;k:fp8,tensor,clip2,mean,rot|v:fp8,tensor,clip2,mean,rot"
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from fitllm.models.hub import resolve_model
from fitllm.models.kv_cache import causal_attention, hadamard
from fitllm.models.loader import load_model
from fitllm.models.tokenizer import load_tokenizer

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "wikitext-2" / "wiki.test.raw"


def fp8(x):
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


def int_quant(x, bits, group, symmetric, ratios=(1.0,)):
    """Round-trip through `bits`-bit codes with an fp16 scale (and zero) per `group` values."""
    n, h, d = x.shape
    g = x.reshape(n, h, d // group, group)
    if symmetric:
        qm = 2 ** (bits - 1) - 1
        s = (g.abs().amax(-1, keepdim=True) / qm).clamp_min(1e-5).half().float()
        return (torch.floor(g / s + 0.5).clamp(-qm, qm) * s).reshape(n, h, d)
    qm = 2 ** bits - 1
    lo0, hi0 = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    best = None
    for r in ratios:
        s = ((hi0 - lo0) * r / qm).clamp_min(1e-5).half().float()
        z = (lo0 * r).half().float()
        y = torch.floor((g - z) / s + 0.5).clamp(0, qm) * s + z
        better = None if best is None else ((y - g) ** 2).sum(-1, keepdim=True) < ((best - g) ** 2).sum(-1, keepdim=True)
        best = y if best is None else torch.where(better, y, best)
    return best.reshape(n, h, d)


class Side:
    """One of K/V: x -> ((x - shift) * mul) @ R -> quantize -> back to model space."""

    def __init__(self, opts: list[str], calib: dict[int, torch.Tensor], d: int):
        self.o, self.kind = opts, opts[0]
        signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(0)).float() * 2 - 1
        rot = torch.diag(signs) @ hadamard(d) if "rots" in opts else hadamard(d) if "rot" in opts else torch.eye(d)
        clip = next((float(t[4:]) for t in opts if t.startswith("clip")), 1.0)
        self.layers = {}
        for layer, x in calib.items():
            shift = x.mean(0) if "mean" in opts else torch.zeros(x.shape[1:])
            mul = 1 / (x - shift).abs().amax(0).clamp_min(1e-6).sqrt() if "kivi" in opts else torch.ones(x.shape[1:])
            y = ((x - shift) * mul) @ rot
            p = dict(shift=shift, mul=mul, rot=rot)
            if "tensor" in opts:
                p["scale"] = clip * y.abs().amax() / 448 * torch.ones(y.shape[1], 1)
            elif "head" in opts:
                p["scale"] = clip * y.abs().amax((0, 2))[:, None] / 448
            self.layers[layer] = p

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p, o = self.layers[layer], self.o
        y = ((x - p["shift"]) * p["mul"]) @ p["rot"]
        if self.kind == "fp8":
            s = (y.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-8).half().float() if "token" in o else p["scale"]
            y = fp8(y / s) * s
        elif self.kind == "bf16":
            y = y.bfloat16().float()
        elif self.kind == "int8":
            y = int_quant(y, 8, y.shape[-1], True)
        elif self.kind == "int4":
            group = next((int(t) for t in o[1:] if t.isdigit()), 32)
            y = int_quant(y, 4, group, "sym" in o, (1.0, 0.95, 0.9, 0.85, 0.8) if "mse" in o else (1.0,))
        return (y @ p["rot"].T) / p["mul"] + p["shift"]


class Recorder:
    def __init__(self):
        self.k, self.v = {}, {}

    def attend(self, layer, q, k, v, scale):
        self.k.setdefault(layer, []).append(k.clone())
        self.v.setdefault(layer, []).append(v.clone())
        return causal_attention(q, k, v, scale)


class FakeQuant:
    def __init__(self, k_side, v_side):
        self.k_side, self.v_side = k_side, v_side

    def attend(self, layer, q, k, v, scale):
        k = self.k_side(layer, k) if self.k_side else k
        v = self.v_side(layer, v) if self.v_side else v
        return causal_attention(q, k, v, scale)


@torch.inference_mode()
def main() -> None:
    num_windows, schemes = int(sys.argv[1]), sys.argv[2].split(";")
    folder = resolve_model(None)
    model, tok = load_model(folder, dtype=torch.float32), load_tokenizer(folder)
    text = DATA.read_text()
    ids = tok.encode(text[: num_windows * 1024 * 8])[: num_windows * 1024]
    windows = [ids[i * 1024:(i + 1) * 1024] for i in range(num_windows)]
    tail = tok.encode(text[-8 * 512 * 8:])
    rec = Recorder()
    for j in range(8):
        c = tail[len(tail) - (j + 1) * 512: len(tail) - j * 512]
        model(torch.tensor(c), torch.arange(len(c)), rec)
    calib = {"k": {i: torch.cat(x) for i, x in rec.k.items()}, "v": {i: torch.cat(x) for i, x in rec.v.items()}}
    d = model.config.head_dim
    for spec in schemes:
        t0 = time.time()
        parts = dict(p.split(":") for p in spec.split("|")) if spec != "none" else {}
        sides = [Side(parts[n].split(","), calib[n], d) if n in parts else None for n in ("k", "v")]
        nll, n = 0.0, 0
        for w in windows:
            hidden = model(torch.tensor(w), torch.arange(len(w)), FakeQuant(*sides))
            logp = torch.log_softmax(model.compute_logits(hidden).float(), -1)
            nll -= logp[:-1].gather(1, torch.tensor(w[1:])[:, None]).sum().item()
            n += len(w) - 1
        print(f"{spec:60s} {math.exp(nll / n):.4f}  {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
