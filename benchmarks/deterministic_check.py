"""GPU check of deterministic split-K (FITLLM_DETERMINISTIC=1, `quant serve --deterministic`).

The CPU tests run the ordered sum under the interpreter, where atomics happen in program order, so
they cannot show what the option is for: on a GPU the default atomic adds land in whatever order
the programs finish, and the output's last bits vary from launch to launch. Here each GEMM family
at the Llama-3-8B layer's shapes (W4A16 standard and tiled layouts, fp8 W8A8) and M in 1, 3, 16, 64
runs `--repeats` times in each mode on the same inputs. Passes when the ordered mode gives one
output bit for bit in every case and both modes stay within 1e-2 of a float64 oracle; it also
prints how many distinct outputs the atomic mode gave (more than one wherever split-K is used).

    python3 benchmarks/deterministic_check.py [--repeats 20]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench_gemm import SHAPES, make_fp8, make_w4, rel_err  # noqa: E402
from fitllm.kernels.fp8 import fp8_gemm_triton, quantize_fp8_per_token_ref  # noqa: E402
from fitllm.kernels.w4a16 import dequantize_packed, w4a16_gemm_triton  # noqa: E402
from fitllm.kernels.w4a16_tiled import tile_pack, w4a16_tiled_triton  # noqa: E402


def families(K, N, dev):
    """name -> (run(x), oracle(x) in float64; fp8 W8A8's with x rounded as the kernel rounds it)."""
    w4 = make_w4(K, N, dev)
    w64 = dequantize_packed(w4["qweight"], w4["scales"], w4["zeros"], w4["group_size"], 4, dtype=torch.float64)
    qtile = tile_pack(w4["qweight"])
    f8 = make_fp8(K, N, dev)
    f64 = f8["weight_fp8"].double().t() * f8["weight_scale"].double()

    def fp8_oracle(x):
        xq, xs = quantize_fp8_per_token_ref(x)
        return (xq.double() * xs.double()) @ f64

    return {
        "w4a16": (lambda x: w4a16_gemm_triton(x, w4["qweight"], w4["scales"], w4["zeros"], w4["group_size"]),
                  lambda x: x.double() @ w64),
        "w4a16-tiled": (lambda x: w4a16_tiled_triton(x, qtile, w4["scales"], w4["zeros"], w4["group_size"], K),
                        lambda x: x.double() @ w64),
        "fp8-w8a8": (lambda x: fp8_gemm_triton(x, f8["weight_fp8"], f8["weight_scale"]), fp8_oracle),
    }


def distinct(run, x, repeats: int) -> tuple[int, torch.Tensor]:
    outs = [run(x).clone() for _ in range(repeats)]
    return len({o.view(torch.int16).cpu().numpy().tobytes() for o in outs}), outs[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--m", default="1,3,16,64")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a dry run under TRITON_INTERPRET=1
    torch.manual_seed(0)
    ok = True
    print(f"{'family':12s} {'linear':8s} {'M':>4s}  distinct outputs atomic / ordered  rel err atomic / ordered")
    for name_kn, (K, N) in SHAPES.items():
        for fam, (run, oracle) in families(K, N, dev).items():
            for M in map(int, args.m.split(",")):
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                ref = oracle(x)
                os.environ.pop("FITLLM_DETERMINISTIC", None)
                n_atomic, y_atomic = distinct(run, x, args.repeats)
                os.environ["FITLLM_DETERMINISTIC"] = "1"
                n_ordered, y_ordered = distinct(run, x, args.repeats)
                os.environ.pop("FITLLM_DETERMINISTIC")
                e_atomic, e_ordered = rel_err(y_atomic, ref), rel_err(y_ordered, ref)
                good = n_ordered == 1 and max(e_atomic, e_ordered) < 1e-2
                ok &= good
                print(f"{fam:12s} {name_kn:8s} {M:4d}  {n_atomic:3d} / {n_ordered:3d}{'':24s}"
                      f"{e_atomic:.2e} / {e_ordered:.2e}  {'ok' if good else 'FAIL'}", flush=True)
    print("all ok" if ok else "FAILURES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
