"""Programmatic dependent launch (PDL, sm90+), the device side.

A kernel launched with PDL may become resident while the kernel before it in the stream is still
running. Until `wait_for_previous` returns (the previous grid has finished and its writes are
visible) it must neither load what that kernel writes nor store anything at all: torch's caching
allocator hands out memory in stream order, so even a fresh output buffer may still be read by
the previous kernel. `let_next_launch` allows the next kernel to launch that early. In a decode
step of ~10 kernels a layer this overlaps each launch with its predecessor's tail (H200, batch-1
decode, every weight scheme: about +5 % tokens/s; benchmarks/RESULTS.md, sixth session).

Every PDL kernel waits in every program that does any work (a program with nothing to do may exit
at once), so a kernel's completion implies its predecessor's, and "waited for the previous kernel"
covers all the earlier ones too. It follows that a kernel may READ, before its wait, anything written
two or more launches earlier, or by the host before the step: it starts only once its predecessor
released it, which every kernel here does after its own wait, so everything before that one is done.
The small kernels use that to overlap a round trip to memory with the wait (RMSNorm's weight and
residual, the RoPE tables and slots, the attention's sequence lengths). Kernels that fill the GPU
release the next one after their main loop; small ones right after their wait (pdl_start).
Launched without PDL (older GPUs, FITLLM_PDL=0) both are no-ops. The host side is
_utils.pdl_args; under TRITON_INTERPRET=1 the kernels get PDL=False and never emit them.

Weights are the other thing nobody writes during a step, but touching them before the wait pays
only in some kernels (H200, RESULTS.md): the int4 batch-1 GEMV lost every time, with `prefetch.
global.L2` (2-7 %, sixth and ninth sessions) and with its first tile loaded into registers (1.4 %;
two tiles 8 %, fifteenth session), so it issues nothing before the wait. The fp8 GEMV loads its first
tile early (EARLY_W: batch-1 decode +1 %), and the fp8 tensor-core kernel asks L2 for its first two
tiles up to M = 64 (`prefetch_to_l2`; PREFETCH: one layer's linears 1-3 % faster there; at M = 256
mixed, at M >= 1024 1 % slower, so not there).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def let_next_launch(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """The prologue of a small kernel (a few programs, latency-bound): wait, then let the next
    kernel launch. Released only once our predecessor is done, the next kernel (typically a GEMV
    of a full wave) finds the GPU all but empty: its programs spread over every SM while we run.
    (Released at the start of a kernel that fills the GPU, the next one's programs took the few
    slots free at that moment and spilled into a second wave: H200, int4 batch-1 decode 5 %
    slower than without PDL; RESULTS.md, sixth session.)"""
    wait_for_previous(PDL)
    let_next_launch(PDL)


@triton.jit
def prefetch_to_l2(ptrs, mask):
    """Ask L2 for the 128-byte lines holding `ptrs` where `mask` (`prefetch.global.L2`, sm80+): a
    hint that returns nothing and holds no registers. Only for memory no kernel of the step writes
    (weights), and only addresses inside the tensor (masked lanes issue nothing)."""
    tl.inline_asm_elementwise(
        "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\n@p prefetch.global.L2 [$1];\nmov.u32 $0, 0;\n}",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
