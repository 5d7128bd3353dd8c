"""8-bit weights (GPTQ int8, g128) on the GPU: the launcher's own table (W8A16_CONFIGS) checked against
float64 at M in {1, 3, 16, 33, 128, 1000} for one Llama-3-8B layer's four linears (outputs poisoned
first), then µs per layer for bf16 cuBLAS, the 4-bit table's rows run on 8-bit weights (what 8-bit
weights ran before the thirtieth session) and W8A16_CONFIGS, each a CUDA-graph replay of two layer copies.

  python3 benchmarks/w8_table_check.py
"""
import os, sys, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import SHAPES, make_w4, graph_time, rel_err
from fitllm.kernels.w4a16 import W4A16_CONFIGS, W8A16_CONFIGS, dequantize_packed, w4a16_gemm_triton
from fitllm.kernels._utils import pick_config

dev = "cuda"
torch.manual_seed(0)
copies = [{n: (make_w4(K, N, dev, bits=8), torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02) for n, (K, N) in SHAPES.items()} for _ in range(2)]

def layer_time(M, cfg):
    xs = {K: torch.randn(M, K, device=dev, dtype=torch.bfloat16) for K in (4096, 14336)}
    ys = {n: torch.empty(M, N, device=dev, dtype=torch.bfloat16) for n, (K, N) in SHAPES.items()}
    if cfg == "bf16":
        fn = lambda: [torch.mm(xs[SHAPES[n][0]], c[n][1].t(), out=ys[n]) for c in copies for n in SHAPES]
    else:
        fn = lambda: [w4a16_gemm_triton(xs[SHAPES[n][0]], **c[n][0], config=cfg, out=ys[n]) for c in copies for n in SHAPES]
    return graph_time(fn)

worst = 0.0
for M in (1, 3, 16, 33, 128, 1000):  # the table itself (config=None), poisoned outputs, every linear
    for n, (K, N) in SHAPES.items():
        w = copies[1][n][0]
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        ref = x.double() @ dequantize_packed(w["qweight"], w["scales"], w["zeros"], 128, 8).double()
        y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
        w4a16_gemm_triton(x, **w, out=y)
        worst = max(worst, rel_err(y, ref))
print(f"{torch.cuda.get_device_name()}  8-bit table check vs float64, M in 1,3,16,33,128,1000, 4 linears: worst rel err {worst:.2e} {'PASS' if worst < 1e-2 else 'FAIL'}")
print("| M | bf16 cuBLAS | 8-bit, the 4-bit table's row | 8-bit, W8A16_CONFIGS | change |")
print("|---|---|---|---|---|")
for M in (1, 2, 4, 8, 16, 32, 64, 128, 256):
    a, b, c = layer_time(M, "bf16"), layer_time(M, pick_config(W4A16_CONFIGS, "sm90", M)), layer_time(M, pick_config(W8A16_CONFIGS, "sm90", M))
    print(f"| {M} | {a:.1f} | {b:.1f} | {c:.1f} | {100 * (c / b - 1):+.0f} % |", flush=True)
