"""Shared plumbing for the GEMM kernels: backend choice, device facts, split-K workspace.

Backend choice: ``FITLLM_KERNEL_BACKEND`` = ``auto`` (default: Triton on CUDA tensors, the torch
reference elsewhere), ``triton`` (always Triton; on CPU that needs ``TRITON_INTERPRET=1`` set before
triton kernels are defined, which is how the tests run them) or ``torch`` (always the reference).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch


def backend_for(x: torch.Tensor) -> str:
    mode = os.environ.get("FITLLM_KERNEL_BACKEND", "auto").lower()
    if mode in ("torch", "ref", "reference"):
        return "torch"
    if mode == "triton":
        return "triton"
    return "triton" if x.is_cuda else "torch"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 8  # interpreter: any small number keeps split-K exercised
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def capability(device_index: int) -> tuple[int, int]:
    """A CUDA card's compute capability, asked once a card: the kernels' launchers ask it on every call,
    which is every eager decode step."""
    return torch.cuda.get_device_capability(device_index)


@functools.lru_cache(maxsize=None)
def gpu_arch(device_index: int | None) -> str:
    """'sm90', 'sm89', ... or 'cpu'. Keys the tuned config tables."""
    if device_index is None or not torch.cuda.is_available():
        return "cpu"
    major, minor = capability(device_index)
    return f"sm{major}{minor}"


def packed_math_ok(device_index: int | None, dtype: torch.dtype) -> bool:
    """Packed bf16x2 FMA needs sm80+ (f16x2: sm53+); the interpreter cannot run inline PTX."""
    if interpreting() or device_index is None:
        return False
    major, minor = capability(device_index)
    return major >= 8 or (dtype == torch.float16 and (major, minor) >= (5, 3))


@functools.lru_cache(maxsize=None)
def max_shared_memory(device_index: int | None) -> int | None:
    """Bytes of shared memory one program may use on this GPU (Triton's own launch limit; 232448 on an
    H100 / H200), None on the CPU and under the interpreter."""
    if device_index is None or interpreting():
        return None
    try:  # the call Triton's own launcher makes before it raises OutOfResources
        import triton

        return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except Exception:  # noqa: BLE001  (no limit known: configs launch as tuned)
        return None


def device_index(t: torch.Tensor) -> int | None:
    return t.device.index if t.is_cuda else None


def pdl_args(t: torch.Tensor) -> dict:
    """Launch options for programmatic dependent launch (see _pdl.py): on sm90+ CUDA tensors
    unless FITLLM_PDL=0; nothing (the kernels' PDL=False default) elsewhere and under the
    interpreter."""
    if not t.is_cuda or interpreting() or os.environ.get("FITLLM_PDL", "1") == "0" or capability(t.device.index)[0] < 9:
        return {}
    return {"PDL": True, "launch_pdl": True}


# Split-K partial sums go to an fp32 workspace with atomics; the last program of each output tile
# (found with a per-tile counter) reads the sum, writes the output and zeroes its slice again, so
# the workspace is always clean between launches: no memset launch, and CUDA graphs stay valid.
# With FITLLM_DETERMINISTIC each split has its own slice (a second buffer, never needing zeros).
# Buffers are never freed (a captured graph may hold their address); one stream at a time.
_WORKSPACES: dict = {}


def deterministic() -> bool:
    """FITLLM_DETERMINISTIC=1: split-K GEMMs sum their partials in a fixed order (see
    w4a16._store_split_ordered), so a launch gives the same bits every run; the default adds them
    with atomics, whose order (and so the last bit, and now and then a greedy token) varies."""
    return os.environ.get("FITLLM_DETERMINISTIC", "0") not in ("", "0")


def defer_splitk(asked: bool, out, bias) -> bool:
    """Whether a GEMM asked to defer (`defer=True`) may hand its consumer a PendingSum: not into a
    caller's `out`, not with a bias (the consumers add none), not with FITLLM_SPLITK_DEFER=0 (A/B
    runs), never in deterministic mode (whose sums are ordered); a launch of one split has y anyway
    (pending_or_y). Checked on the H200 by benchmarks/defer_check.py (RESULTS.md, thirteenth session)."""
    return (asked and out is None and bias is None and os.environ.get("FITLLM_SPLITK_DEFER", "1") != "0"
            and not deterministic())


@dataclass(frozen=True)
class PendingSum:
    """A split-K GEMM's output y [M, N] before its final step: the splits' fp32 partials, already
    added up by atomics in `acc` (a slice of the split-K workspace), not yet rounded to `dtype`.

    Why: ending a split-K GEMM costs two round trips to L2 in its last programs (the per-tile
    counter, then reading the sum back), ~1.8 µs a launch that the next kernel waits for; a batch-1
    W4A16 GEMV without them reads a Llama-3-8B layer in 45.9 instead of 53.1 µs (H200,
    benchmarks/gemv_tail_probe.py). So a GEMM whose consumer is one of fused's kernels (the
    residual add + RMSNorm after o_proj and down_proj, SiLU·mul after gate_up) leaves the sum
    here, and that consumer reads it, rounds it as the GEMM would have, and writes zeros back: the
    workspace is clean again before the next split-K GEMM starts (stream order). The qkv projection's
    goes the same way to the launch that applies RoPE and writes the KV cache
    (paged_attention.rope_cache_write). Exactly one consumer must take it, right away
    (`materialize` is the fallback). See defer_splitk."""

    acc: torch.Tensor  # fp32 [M, N], contiguous
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.acc.shape

    def split(self, sizes: list[int], dim: int = -1) -> tuple["PendingSum", ...]:
        """Views of column ranges (q, k and v of a qkv projection; dim must be the last): each taken
        on its own, or together by one kernel (paged_attention.rope_cache_write)."""
        if dim not in (-1, self.acc.dim() - 1):
            raise ValueError("PendingSum.split: only along the last dim")
        return tuple(PendingSum(a, self.dtype) for a in self.acc.split(sizes, dim=-1))

    def reshape(self, *shape: int) -> "PendingSum":
        return PendingSum(self.acc.reshape(*shape), self.dtype)

    @classmethod
    def holding(cls, values: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> "PendingSum":
        """values (fp32 [M, N]) placed in the split-K workspace as a GEMM would have left them: the
        input of a consumer under test (tests, benchmarks/fp8_act_check.py)."""
        ws, _ = splitk_workspace(values.device, values.numel(), 0)
        acc = ws[: values.numel()].view(values.shape)
        acc.copy_(values)
        return cls(acc, dtype)

    def materialize(self) -> torch.Tensor:
        """y in `dtype`, leaving the workspace zero (torch ops: any consumer)."""
        y = self.acc.to(self.dtype)
        self.acc.zero_()
        return y


@dataclass(frozen=True)
class Fp8Input:
    """What a W8A8 fp8 GEMM wants of its activations (FusedLinear.input_quant): e4m3 codes with one
    dynamic scale per token (static_scale None) or with the checkpoint's static scale. The kernel
    that produces those activations may then quantize them itself (fused.rms_norm, fused.silu_mul)
    and hand over Fp8Activations: the GEMM skips its own quantization launch, which re-reads x."""

    static_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class Fp8Activations:
    """Activations x [M, K] handed to an fp8 GEMM already quantized: x ~= q * scale, q e4m3 codes,
    scale fp32 [M, 1] (per token) or [1] (static); computed exactly as fitllm.kernels.fp8's
    quantizer computes them from x rounded to `dtype` (the GEMM's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@dataclass(frozen=True)
class X16Input:
    """What a batch-1 4-bit GEMM on dp4a asks of its producer (FusedLinear.input_quant): x as X16."""


@dataclass(frozen=True)
class X16:
    """Activations [M, K] as 16-bit integers per 128-column tile, for a batch-1 4-bit GEMM on dp4a
    (fitllm.kernels.w4a16_dp4a, whose docstring gives the layout)."""

    codes: torch.Tensor  # int32 [M, T, 4, 16]
    stats: torch.Tensor  # fp32 [M, T, 2]: step, sum of v
    K: int
    dtype: torch.dtype  # x's (the GEMM's output dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.K))

    @classmethod
    def empty(cls, M: int, K: int, dtype: torch.dtype, device) -> "X16":
        T = -(-K // 128)
        return cls(torch.empty(M, T, 4, 16, dtype=torch.int32, device=device),
                   torch.empty(M, T, 2, dtype=torch.float32, device=device), K, dtype)


@dataclass(frozen=True)
class Gathered:
    """Activations handed to an act-order GEMM with their columns already in its weight's storage
    order: x = a[:, perm] (perm: FusedLinear.input_perm). The producer before the GEMM writes them
    so (fused.rms_norm's perm; paged_attention's out_cols for o_proj), which spares the GEMM its own
    gather launch."""

    x: torch.Tensor
    perm: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.x.shape


def scatter_columns(x: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """x [T, ...] with its columns (trailing dims flattened) moved: column cols[c] of the result is
    column c of x, cols a permutation. The inverse of a gather x[:, cols]: an act-order weight's
    columns back in the input's order, an attention output row in o_proj's (out_cols)."""
    t = x.shape[0]
    res = torch.empty_like(x, memory_format=torch.contiguous_format)
    res.view(t, -1)[:, cols.long()] = x.reshape(t, -1)
    return res


def pending_or_y(y: torch.Tensor, ws: torch.Tensor, pending: bool):
    """What a GEMM launch returns: y, or (pending) the sum it left in the workspace's first y.numel()
    floats as a PendingSum of y's shape and dtype."""
    return PendingSum(ws[: y.numel()].view(y.shape), y.dtype) if pending else y


def splitk_buffers(device: torch.device, n_out: int, n_tiles: int, split: int):
    """(workspace, counters, launch kwargs) of a split-K launch over n_out outputs and n_tiles
    output tiles: one shared slice with atomics, or with FITLLM_DETERMINISTIC a slice per split
    (their own buffer: the atomic one must stay zero between launches)."""
    if deterministic():
        ws, cnt = splitk_workspace(device, split * n_out, n_tiles, ordered=True)
        return ws, cnt, {"ORDERED": True}
    return (*splitk_workspace(device, n_out, n_tiles), {})


def splitk_workspace(device: torch.device, n_floats: int, n_counters: int, ordered: bool = False):
    # torch.device("cuda") (index None) names the current GPU, whose workspace the kernels use (their
    # tensors say cuda:N): one key for both, or a caller zeroing or checking "cuda" sees a fresh buffer.
    index = torch.cuda.current_device() if device.type == "cuda" and device.index is None else device.index
    key = (device.type, index, ordered)
    ws, cnt = _WORKSPACES.get(key, (None, None))
    if ws is None or ws.numel() < n_floats or cnt.numel() < n_counters:
        old = _WORKSPACES.get(key)
        ws = torch.zeros(max(n_floats, 1 << 20, 0 if ws is None else ws.numel()), dtype=torch.float32, device=device)
        cnt = torch.zeros(max(n_counters, 1 << 14, 0 if cnt is None else cnt.numel()), dtype=torch.int32, device=device)
        _WORKSPACES[key] = (ws, cnt)
        if old is not None:
            _WORKSPACES.setdefault("_retired", []).append(old)
    return ws, cnt


def pick_config(table: dict, arch: str, m: int) -> dict:
    """table: {arch: [(max_m, config), ...] sorted by max_m}; falls back to the 'default' rows."""
    rows = table.get(arch, table["default"])
    for max_m, cfg in rows:
        if m <= max_m:
            return cfg
    return rows[-1][1]


def by_width(row: dict, *ranges) -> dict:
    """A table row's config for the weights whose N (output width) no range below claims, and
    ranges (lo, hi, config): that config for lo < N <= hi."""
    return dict(row, by_n=ranges)


def config_for(cfg: dict, N: int) -> dict:
    """The config a by_width row gives a weight N wide (any other config: itself)."""
    for lo, hi, c in cfg.get("by_n", ()):
        if lo < N <= hi:
            return c
    return cfg


def row_bounds(table: dict, arch: str) -> list[int]:
    """The largest M of each bounded row pick_config chooses from for `arch`."""
    return [max_m for max_m, _ in table.get(arch, table["default"]) if max_m < 1 << 62]


def split_waves(cfg: dict, N: int, K: int) -> float:
    """The split-K waves a config asks for (split_k_for) for a weight N wide and K deep: a `wide` rule
    (min_n, waves) from min_n on (the batch-1 GEMV's gate|up), a `deep` rule (min_k, waves) from min_k on
    (fp8 down_proj, as wide as o_proj), else its own `waves`."""
    for rule, size in ((cfg.get("wide"), N), (cfg.get("deep"), K)):
        if rule and size >= rule[0]:
            return rule[1]
    return cfg.get("waves", 0.0)


def split_k_for(tiles_mn: int, k_tiles: int, sms: int, waves: float) -> tuple[int, int]:
    """(splits, K tiles per split): enough programs to fill the GPU `waves` times over, never more
    splits than K tiles, and no empty split (the count is recomputed from the tiles per split)."""
    want = 1 if waves <= 0 else max(1, round(sms * waves / max(tiles_mn, 1)))
    k_iters = -(-k_tiles // max(1, min(want, k_tiles)))
    return -(-k_tiles // k_iters), k_iters


def patch_interpreter_for_numpy_2_4() -> None:
    """triton 3.6's interpreter turns scalar tensors into Python ints with int(ndarray of shape (1,)),
    which numpy >= 2.4 rejects, so `range(runtime_arg)` in a kernel fails under TRITON_INTERPRET=1.
    Re-register __index__ with .item(); harmless where numpy is older. (Interpreter only.)"""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return
    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_fitllm_patched", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._fitllm_patched = True
    interp._patch_lang_tensor = patched


if interpreting():
    patch_interpreter_for_numpy_2_4()
