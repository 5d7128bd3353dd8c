"""Does anything compile after the engine's warm-up? (Triton compiles a kernel variant at its first
launch, seconds each on a cold cache: mid-serving that stalls every request in the step.)

Builds bench_serving's Llama-3-8B-shaped random model and engine, lists the compiled variants of every
Triton kernel in fitllm.kernels after start-up, runs an offline generation, and prints each variant
compiled during it (its specialisation key says which argument changed). Run on a cold Triton cache
(`rm -rf ~/.triton/cache`) to see compile times too. Exit status 1 if anything compiled.

  python3 benchmarks/compile_watch.py [--scheme fp8] [--kv-dtype auto|fp8|int8|int4] [--requests 1000]
      [--max-num-seqs 1024] [--batched-tokens 16384] [--eager]

--eager runs without CUDA graphs (`quant serve --no-cuda-graphs`): every decode step is launched eagerly at
its own batch size, which the warm-up must have compiled (ModelRunner.warm_up_decode).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import build, engine_for  # noqa: E402
from gpu_engine_check import throughput  # noqa: E402

from fitllm.kernels import TRITON_MODULES  # noqa: E402


def variants() -> dict[str, set[str]]:
    """kernel name -> the specialisation keys compiled so far in this process."""
    out = {}
    for mod in TRITON_MODULES:
        m = importlib.import_module(f"fitllm.kernels.{mod}")
        for name, k in vars(m).items():
            caches = getattr(k, "device_caches", None)
            if caches is not None and getattr(k, "fn", None) is not None and k.fn.__module__ == m.__name__:
                out[f"{mod}.{name}"] = {str(key) for c in caches.values() for key in c[0]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheme", default="fp8")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--batched-tokens", type=int, default=16384)
    ap.add_argument("--kv-dtype", default="auto", help="the KV cache's dtype: the decode kernel's configs depend on it")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (decode steps launched eagerly)")
    a = ap.parse_args()
    model = build(a.scheme)
    t0 = time.perf_counter()
    engine = engine_for(model, kv_dtype=a.kv_dtype, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.batched_tokens,
                        cuda_graphs=not a.eager)
    before = variants()
    print(f"engine + warm-up {time.perf_counter() - t0:.1f} s; {sum(map(len, before.values()))} kernel variants")
    late = 0
    for n, new in ((32, 16), (a.requests, 128)):
        t = time.perf_counter()
        gen, _ = throughput(engine, n, 128, new)
        print(f"{n} x 128/{new}: {gen:.0f} output tok/s, {time.perf_counter() - t:.1f} s")
        now = variants()
        for name, keys in now.items():
            for key in sorted(keys - before.get(name, set())):
                late += 1
                print(f"  compiled during generation: {name} {key[:600]}")
        before = now
    print("PASS: nothing compiled after the warm-up" if not late else f"FAIL: {late} variants compiled mid-run")
    return 1 if late else 0


if __name__ == "__main__":
    sys.exit(main())
