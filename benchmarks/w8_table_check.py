"""8-bit weights (GPTQ int8, g128) on the GPU: both launchers' own tables checked against float64 at M in
{1, 2, 3, 4, 16, 33, 128, 300, 1000} for one Llama-3-8B layer's four linears (outputs poisoned first): the
standard layout's W8A16_CONFIGS (fitllm.kernels.w4a16) and the tiled layout's TILED8_CONFIGS
(fitllm.kernels.w4a16_tiled, what the GPU serves; its rows reach the warp-specialised kernel from M = 65),
the tiled one with bf16 and fp16 activations. Then µs per layer for bf16 cuBLAS and both tables, each
linear alone in a CUDA graph over two copies of the layer (bench_gemm.graph_time).

  python3 benchmarks/w8_table_check.py
"""
import os, sys, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import SHAPES, make_w4, graph_time, rel_err
from fitllm.kernels.w4a16 import dequantize_packed, w4a16_gemm_triton
from fitllm.kernels.w4a16_tiled import tile_pack, w4a16_tiled_triton

dev = "cuda"
torch.manual_seed(0)
copies = []
for _ in range(2):
    layer = {}
    for n, (K, N) in SHAPES.items():
        w = make_w4(K, N, dev, bits=8)
        layer[n] = dict(std=w, bf16=torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02,
                        tiled=dict(qtile=tile_pack(w["qweight"], 8), scales=w["scales"], zeros=w["zeros"],
                                   group_size=128, K=K))
    copies.append(layer)


def run(kind, x, w, y):
    if kind == "bf16":
        torch.mm(x, w["bf16"].t(), out=y)
    elif kind == "standard":
        w4a16_gemm_triton(x, **w["std"], out=y)
    else:
        w4a16_tiled_triton(x, **w["tiled"], out=y, bits=8)


def layer_time(M, kind):
    total = 0.0
    for n, (K, N) in SHAPES.items():
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        total += graph_time(lambda: [run(kind, x, c[n], y) for c in copies], 30.0)
    return total


def as_dtype(w, dt):
    """The layer's weights with scales and zeros in the activations' dtype (fp16 runs)."""
    sz = dict(scales=w["std"]["scales"].to(dt), zeros=w["std"]["zeros"].to(dt))
    return dict(w, std=dict(w["std"], **sz), tiled=dict(w["tiled"], **sz))


worst = {"standard": 0.0, "tiled": 0.0, "tiled fp16": 0.0}
for M in (1, 2, 3, 4, 16, 33, 128, 300, 1000):
    for n, (K, N) in SHAPES.items():
        for kind in worst:
            dt = torch.float16 if kind.endswith("fp16") else torch.bfloat16
            w = as_dtype(copies[1][n], dt)
            x = torch.randn(M, K, device=dev, dtype=dt)
            ref = x.double() @ dequantize_packed(w["std"]["qweight"], w["std"]["scales"], w["std"]["zeros"], 128,
                                                 8).double()
            y = torch.full((M, N), float("nan"), device=dev, dtype=dt)
            run(kind.split()[0], x, w, y)
            worst[kind] = max(worst[kind], rel_err(y, ref))
ok = all(v < 1e-2 for v in worst.values())
print(f"{torch.cuda.get_device_name()}  8-bit tables vs float64, 4 linears: worst rel err "
      + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + f": {'PASS' if ok else 'FAIL'}")
print("| M | bf16 cuBLAS | 8-bit standard (W8A16_CONFIGS) | 8-bit tiled (TILED8_CONFIGS) | tiled vs bf16 |")
print("|---|---|---|---|---|")
for M in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):
    a, b, c = layer_time(M, "bf16"), layer_time(M, "standard"), layer_time(M, "tiled")
    print(f"| {M} | {a:.1f} | {b:.1f} | {c:.1f} | {a / c:.2f}x |", flush=True)
