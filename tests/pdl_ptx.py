"""Run as a script (no TRITON_INTERPRET): compile each PDL kernel for sm_90 with PDL=True and
print, per kernel, where in its PTX the grid-dependency wait and release sit relative to the
first global load and store. tests/test_pdl.py reads the JSON line this prints."""
from __future__ import annotations

import importlib
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from sass_offline import compile_kernel  # noqa: E402
from ws_codegen import ws_types  # noqa: E402  (this folder: the script's own)

BF16_GEMM = dict(x_ptr="*bf16", q_ptr="*i32", s_ptr="*bf16", z_ptr="*bf16", bias_ptr="*bf16", y_ptr="*bf16",
                 ws_ptr="*fp32", cnt_ptr="*i32")
FP8_GEMM = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", wsc_ptr="*fp32", bias_ptr="*fp32",
                y_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32")
ATTN = dict(Q="*bf16", KC="*bf16", VC="*bf16", KS="*fp32", VS="*fp32", KZ="*fp32", VZ="*fp32", BT="*i32",
            SEQ="*i32", OUT="*bf16", OCOLS="*i32", scale="fp32")
KV = dict(KIND=0, KGROUP=128, VGROUP=128, VT=False, H=8, D=128, DC=128, PAGE=16)
# name -> (module:kernel, types, constexprs, warps, stages, fills the GPU: releases after its main loop)
KERNELS = {
    "tiled_gemv": ("fitllm.kernels.w4a16_tiled:_tiled_gemv_kernel", {**BF16_GEMM, "x_ptr": "*i32"},
                   dict(GROUP_SIZE=128, HAS_BIAS=False, USE_WS=True, BM=1, BN=128, UNROLL=4, F16=False, ASM=True,
                        EVEN_K=True), 8, 1, True),
    "dp4a_gemv": ("fitllm.kernels.w4a16_dp4a:_dp4a_gemv_kernel",
                  dict(codes_ptr="*i32", stats_ptr="*fp32", q_ptr="*i32", s_ptr="*bf16", z_ptr="*bf16", bias_ptr="*bf16",
                       y_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32"),
                  dict(GROUP_SIZE=128, HAS_BIAS=False, USE_WS=True, BN=256, ASM=True, EVEN_N=True), 8, 1, True),
    "tiled_tc": ("fitllm.kernels.w4a16_tiled:_w4a16_tiled_kernel", BF16_GEMM,
                 dict(GROUP_SIZE=128, CHUNK=128, HAS_BIAS=False, USE_WS=True, BM=16, BN=64, ROW_WARPS=4, F16=False,
                      ASM=True, SCALE_IN_W=False, UPCAST=False), 4, 3, True),
    "w4_ws": ("fitllm.kernels.w4a16_ws:_w4a16_ws_kernel", ws_types(128, False),
              dict(GROUP_SIZE=128, BM=128, STAGES=3, HAS_BIAS=False, F16=False), 4, 1, True),
    "fp8_gemv": ("fitllm.kernels.fp8:_fp8_gemv_kernel", FP8_GEMM,
                 dict(W8A8=True, WS_PER_CHANNEL=True, HAS_BIAS=False, USE_WS=True, BN=16, BK=512), 8, 1, True),
    "fp8_gemv_early": ("fitllm.kernels.fp8:_fp8_gemv_kernel", FP8_GEMM,
                       dict(W8A8=True, WS_PER_CHANNEL=True, HAS_BIAS=False, USE_WS=True, BN=16, BK=512,
                            EARLY_W=1), 8, 1, True),
    "fp8_tc": ("fitllm.kernels.fp8:_fp8_kernel", FP8_GEMM,
               dict(W8A8=True, XS_PER_ROW=True, WS_PER_CHANNEL=True, HAS_BIAS=False, SWAP=True, SPLIT_K=2,
                    UPCAST=False, BM=16, BN=64, BK=256), 4, 4, True),
    "fp8_tc_prefetch": ("fitllm.kernels.fp8:_fp8_kernel", FP8_GEMM,
                        dict(W8A8=True, XS_PER_ROW=True, WS_PER_CHANNEL=True, HAS_BIAS=False, SWAP=True, SPLIT_K=2,
                             UPCAST=False, BM=16, BN=64, BK=256, PREFETCH=2), 4, 4, True),
    "fp8_tma": ("fitllm.kernels.fp8:_fp8_tma_kernel",
                dict(x_desc="tensordesc<fp8e4nv[128, 128]>", w_desc="tensordesc<fp8e4nv[256, 128]>", xs_ptr="*fp32",
                     wsc_ptr="*fp32", bias_ptr="*fp32", y_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32"),
                dict(XS_PER_ROW=True, WS_PER_CHANNEL=True, HAS_BIAS=False, UPCAST=False, SWAP=False, SPLIT_K=1,
                     BM=128, BN=256, BK=128, GROUP_M=8, FLATTEN=True, WARP_SPEC=False), 8, 4, True),
    "quant_fp8": ("fitllm.kernels.fp8:_quant_fp8_kernel", dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"),
                  dict(STATIC=False, BLOCK=4096, EXACT_ROUND=False), 8, 1, False),
    "decode": ("fitllm.kernels.paged_attention:_decode_kernel", {**ATTN, "PO": "*fp32", "PML": "*fp32", "CNT": "*i32"},
               dict(KV, G=4, GP=16, BLOCK_N=128, DIRECT=False, UPCAST=False, RUN=16, WINDOWED=False, FUSED=True,
                    GQ=4, SP=8, COMBINE_CHUNK=8, COLS=False), 4, 5, True),
    "decode_cols": ("fitllm.kernels.paged_attention:_decode_kernel",
                    {**ATTN, "PO": "*fp32", "PML": "*fp32", "CNT": "*i32"},
                    dict(KV, G=4, GP=16, BLOCK_N=128, DIRECT=False, UPCAST=False, RUN=16, WINDOWED=False, FUSED=True,
                         GQ=4, SP=8, COMBINE_CHUNK=8, COLS=True), 4, 5, True),
    "prefill": ("fitllm.kernels.paged_attention:_prefill_kernel", {**ATTN, "QSTART": "*i32"},
                dict(KV, G=4, BLOCK_M=16, BLOCK_N=64, UPCAST=False, RUN=16, COLS=True), 4, 2, True),
    "cache_write": ("fitllm.kernels.paged_attention:_cache_write_kernel",
                    dict(K="*bf16", V="*bf16", KC="*bf16", VC="*bf16", KS="*fp32", VS="*fp32", KZ="*fp32",
                         VZ="*fp32", SLOTS="*i64"), dict(KV), 1, 1, False),
    "rope_write": ("fitllm.kernels.paged_attention:_rope_write_kernel",
                   dict(Q="*bf16", K="*bf16", V="*bf16", QO="*bf16", COS="*fp32", SIN="*fp32", KC="*bf16",
                        VC="*bf16", SLOTS="*i64"), dict(H=8, G=4, GP=4, D=128, BH=64, RNE=False, RNE_C=False), 1, 1,
                   False),
    "rms_norm": ("fitllm.kernels._fused_triton:rms_norm_kernel",
                 dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", h_ptr="*bf16", eps="fp32"),
                 dict(HAS_RES=True, RNE=False, RNE_OUT=False, BLOCK_N=4096), 8, 1, False),
    "rms_norm_perm": ("fitllm.kernels._fused_triton:rms_norm_kernel",
                      dict(x_ptr="*fp32", r_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", h_ptr="*bf16",
                           idx_ptr="*i32", eps="fp32"),
                      dict(HAS_RES=True, X_SUM=True, RNE=False, RNE_OUT=False, BLOCK_N=4096, PERM=True), 8, 1, False),
    "rms_norm_x16": ("fitllm.kernels._fused_triton:rms_norm_kernel",
                     dict(x_ptr="*fp32", r_ptr="*bf16", w_ptr="*bf16", out_ptr="*i32", h_ptr="*bf16", s_ptr="*fp32",
                          eps="fp32"),
                     dict(HAS_RES=True, X_SUM=True, RNE=False, RNE_OUT=False, BLOCK_N=4096, QUANT=3), 8, 1, False),
    "rope": ("fitllm.kernels._fused_triton:rope_kernel", dict(q_ptr="*bf16", k_ptr="*bf16", cos_ptr="*fp32",
                                                               sin_ptr="*fp32"),
             dict(RNE=False, BLOCK_H=32, BLOCK_D=64), 4, 1, False),
    "silu_mul": ("fitllm.kernels._fused_triton:silu_mul_kernel", dict(x_ptr="*bf16", out_ptr="*bf16"),
                 dict(RNE=False, BLOCK=1024), 4, 1, False),
    "silu_mul_x16": ("fitllm.kernels._fused_triton:silu_mul_kernel",
                     dict(x_ptr="*fp32", out_ptr="*i32", s_ptr="*fp32"),
                     dict(RNE=False, BLOCK=16384, X_SUM=True, QUANT=3), 32, 1, False),
    "head_affine": ("fitllm.kernels._fused_triton:head_affine_kernel",
                    dict(x_ptr="*bf16", r_ptr="*bf16", shift_ptr="*fp32", pre_ptr="*fp32", post_ptr="*fp32",
                         add_ptr="*fp32", y_ptr="*fp16", y2_ptr="*fp32"),
                    dict(D=128, BT=16, HAS_ROT=True, HAS_SHIFT=True, HAS_PRE=True, HAS_POST=True, HAS_ADD=True,
                         RNE=False, RNE_OUT=False, RNE_OUT2=False, UPCAST=False), 4, 1, False),
    "gather_columns": ("fitllm.kernels._fused_triton:gather_columns_kernel",
                       dict(x_ptr="*bf16", idx_ptr="*i32", out_ptr="*bf16"), dict(BLOCK=1024), 4, 1, False),
    "gather_row": ("fitllm.kernels._fused_triton:gather_row_kernel",
                   dict(x_ptr="*bf16", idx_ptr="*i32", out_ptr="*bf16"), dict(BLOCK_K=4096), 8, 1, False),
    "greedy": ("fitllm.kernels._fused_triton:greedy_tokens_kernel",
               dict(x_ptr="*bf16", out_ptr="*i64", pm_ptr="*fp32", pi_ptr="*i32", cnt_ptr="*i32"),
               dict(CHUNK=4096, BLOCK=1024, NCH=32), 4, 1, False),
}


# Kernels that read, before their wait, what was written two or more launches earlier or by the host
# before the step (_pdl.py): RMSNorm its weight, residual (and column order), the row gather its order, the RoPE + cache write its tables and
# slots, decode attention the sequence lengths, the fp8 batch-1 GEMV (EARLY_W) its first weight tile.
# Their other loads (the previous kernel's output) and every store still come after the wait.
EARLY_LOADS = {"rms_norm", "rms_norm_perm", "rms_norm_x16", "gather_row", "rope_write", "decode", "decode_cols", "fp8_gemv_early"}


def first(ptx: str, pattern: str, after: int = 0) -> int:
    m = re.compile(pattern).search(ptx, max(after, 0))
    return m.start() if m else -1


def kernels_with_pdl() -> set[str]:
    """module:kernel of every Triton kernel in fitllm.kernels that takes PDL (all must be listed above)."""
    import fitllm.kernels as pkg

    found = set()
    for mod in ("w4a16_tiled", "w4a16_dp4a", "w4a16_ws", "w4a16", "fp8", "paged_attention", "_fused_triton"):
        m = importlib.import_module(f"{pkg.__name__}.{mod}")
        found |= {f"{m.__name__}:{k}" for k, v in vars(m).items()
                  if "PDL" in getattr(v, "arg_names", ()) and v.fn.__module__ == m.__name__ and k.endswith("_kernel")}
    return found


def main() -> None:
    names = sys.argv[1:] or list(KERNELS)
    out = {"_unlisted": sorted(kernels_with_pdl() - {path for path, *_ in KERNELS.values()})}
    for name in names:
        path, types, consts, warps, stages, big = KERNELS[name]
        mod, fn = path.split(":")
        ptx = compile_kernel(getattr(importlib.import_module(mod), fn), types, {**consts, "PDL": True},
                             warps=warps, stages=stages).asm["ptx"]
        load, wait = r"\b((ld|cp\.async)\.(global|ca|cg)|cp\.async\.bulk\.tensor)", first(ptx, r"griddepcontrol\.wait")
        out[name] = {"big": big, "early": name in EARLY_LOADS, "wait": wait,
                     "release": first(ptx, r"griddepcontrol\.launch_dependents"),
                     "load": first(ptx, load), "load_after_wait": first(ptx, load, wait),
                     "store": first(ptx, r"\b(st|atom|red)\.global"),
                     "prefetch": first(ptx, r"prefetch\.global\.L2"),
                     "fenced_atomics": len(re.findall(r"\batom\.global(\.gpu)?\.acq_rel\b", ptx))}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
