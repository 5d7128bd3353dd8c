"""Run as a script (no TRITON_INTERPRET): compile every tensor-core config of the sm90 fp8 table, for
w8a8 and w8a16, as fp8_gemm_triton would launch it on an H100 / H200 (stages fitted to 232448 bytes,
its L2 prefetch where the row asks for one, a TMA row's w8a8 on the TMA kernel),
for sm_90, and print one JSON line: per config the shared memory Triton needs and fp8's estimate of
it. tests/test_kernels_gemm.py reads that line."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from sass_offline import compile_kernel  # noqa: E402

from fitllm.kernels._utils import config_for  # noqa: E402
from fitllm.kernels.fp8 import FP8_CONFIGS, _fit_shared_memory, _fp8_kernel, _fp8_tma_kernel, shared_memory_need  # noqa: E402

H100_SHARED = 232448
WIDTHS = (4096, 6144, 28672)  # o / down, qkv, gate_up of Llama-3-8B: every range of the rows


def main() -> None:
    configs = {}
    for _, row in FP8_CONFIGS["sm90"]:
        for n in WIDTHS:
            cfg = config_for(row, n)
            if cfg["backend"] in ("triton", "tma"):
                configs[tuple(sorted((k, str(v)) for k, v in cfg.items() if k != "by_n"))] = cfg
    out = []
    for cfg in configs.values():
        for x_bytes in (1, 2):
            fitted = _fit_shared_memory(cfg, x_bytes, H100_SHARED)
            types = dict(x_ptr="*fp8e4nv" if x_bytes == 1 else "*bf16", xs_ptr="*fp32", w_ptr="*fp8e4nv",
                         wsc_ptr="*fp32", bias_ptr="*fp32", y_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32")
            consts = dict(W8A8=x_bytes == 1, XS_PER_ROW=True, WS_PER_CHANNEL=True, HAS_BIAS=False, SWAP=cfg["SWAP"],
                          SPLIT_K=2, UPCAST=False, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], PDL=True,
                          PREFETCH=cfg.get("prefetch", 0))  # as launched: the small-M rows prefetch
            kernel = _fp8_kernel
            if cfg["backend"] == "tma" and x_bytes == 1:  # w8a16 runs a tma row on the pointer kernel
                kernel = _fp8_tma_kernel
                types = dict(types, x_desc=f"tensordesc<fp8e4nv[{cfg['BM']}, {cfg['BK']}]>",
                             w_desc=f"tensordesc<fp8e4nv[{cfg['BN']}, {cfg['BK']}]>")
                consts = dict({k: v for k, v in consts.items() if k not in ("W8A8", "PREFETCH")},
                              SPLIT_K=2 if cfg["waves"] else 1, GROUP_M=cfg["group_m"],
                              FLATTEN=cfg["flatten"], WARP_SPEC=cfg["warp_spec"])
            k = compile_kernel(kernel, types, consts, warps=fitted["num_warps"], stages=fitted["num_stages"])
            out.append(dict(cfg={k: v for k, v in cfg.items() if k != "by_n"}, x_bytes=x_bytes,
                            stages=fitted["num_stages"], shared=k.metadata.shared,
                            estimate=shared_memory_need(fitted, x_bytes)))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
