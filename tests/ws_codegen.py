"""Run as a script (no TRITON_INTERPRET): compile the warp-specialised W4A16 kernel (fitllm.kernels.w4a16_ws)
for sm_90 as the sm90 tile tables launch it (every ws config of every row of the 4- and 8-bit tables, bf16 and
fp16), run ptxas on its PTX for the advisories, and print one JSON line per compile. tests/test_kernels_tiled.py reads it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from sass_offline import compile_kernel, histogram, resource_usage, sass_of  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from fitllm.kernels._utils import config_for  # noqa: E402
from fitllm.kernels.w4a16_tiled import tile_table, words_per_tile  # noqa: E402
from fitllm.kernels.w4a16_ws import _w4a16_ws_kernel, descriptor_layouts  # noqa: E402


def ws_types(bm: int, f16: bool, bits: int = 4) -> dict:
    """The kernel's signature types as the launcher's descriptors give them (tests/pdl_ptx.py too)."""
    t = "fp16" if f16 else "bf16"
    x_layout, q_layout = descriptor_layouts(bm, torch.float16 if f16 else torch.bfloat16)
    return dict(x_desc=f"tensordesc<{t}[{bm}, 64],{x_layout!r}>", q_desc=f"tensordesc<i32[128, {words_per_tile(bits)}],{q_layout!r}>",
                s_ptr=f"*{t}", z_ptr=f"*{t}", bias_ptr=f"*{t}", y_ptr=f"*{t}")


def main() -> None:
    cfgs = {(bits, c["BM"], c["num_stages"], c["BN"]) for bits in (4, 8) for _, row in tile_table(bits)["sm90"]
            for n in (4096, 6144, 28672) for c in [config_for(row, n)] if c["backend"] == "ws"}
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    out = []
    for bits, bm, stages, rows in sorted(cfgs):
        for f16 in (False, True):
            k = compile_kernel(_w4a16_ws_kernel, ws_types(bm, f16, bits), dict(GROUP_SIZE=128, BM=bm, STAGES=stages,
                                                                                HAS_BIAS=True, F16=f16, BITS=bits,
                                                                                ROWS=rows),
                               warps=4, stages=1)
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "k.ptx")
                open(path, "w").write(k.asm["ptx"])
                adv = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                                     capture_output=True, text=True).stderr
            sass = sass_of(k.asm["cubin"])
            out.append(dict(bits=bits, BM=bm, stages=stages, rows=rows, f16=f16, shared=k.metadata.shared,
                            spills=resource_usage(k.asm["cubin"])["stack"],
                            hgmma=sass.count("HGMMA."), full_waits=sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0"),
                            prmt=histogram(sass.splitlines())["PRMT"],
                            advisories=[line for line in adv.splitlines() if "Performance" in line]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
