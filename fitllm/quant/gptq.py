"""GPTQ (Frantar et al. 2022): quantize W column by column, spreading each column's rounding
error over the columns not yet quantized through the inverse Hessian H = 2 X^T X of the layer's
calibration inputs. Blocked lazy updates, dampening, act-order (desc_act) with g_idx or static
groups, per-group or per-channel grids, int4/int8, sym/asym.

Two defaults differ from the original recipe because calibration text rarely matches what the
model later reads: the error feedback fits the calibration Hessian so closely that, on other text,
it can end up worse than plain rounding. Stronger dampening (QuantScheme.damp) and grids whose range
is clipped to minimise each group's squared error (rtn.mse_grid_params) keep most of GPTQ's gain on
calibration data and carry it to held-out text (benchmarks/RESULTS.md, issue 3)."""
from __future__ import annotations

import torch

from fitllm.quant.rtn import grid_params, mse_grid_params
from fitllm.quant.scheme import QuantError, QuantizedWeight, QuantScheme


class HessianAccumulator:
    """Running X^T X / n over calibration tokens (a forward hook feeds it)."""

    def __init__(self, k: int, device):
        self.h = torch.zeros(k, k, dtype=torch.float64, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        self.h.mul_(self.n / (self.n + x.shape[0])).add_(x.t() @ x, alpha=2.0 / (self.n + x.shape[0]))
        self.n += x.shape[0]


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of H^-1 after dampening; raises more damping when H is singular."""
    diag = torch.arange(h.shape[0], device=h.device)
    for extra in (1, 10, 100):
        hd = h.clone()
        hd[diag, diag] += damp * extra * hd.diagonal().mean()
        l, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(l)
            return torch.linalg.cholesky(hinv, upper=True)
    raise QuantError("GPTQ: the Hessian stays singular after dampening (calibration data too small?)")


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, block: int = 128) -> QuantizedWeight:
    """w [N, K], h [K, K] (float64) -> QuantizedWeight in the original column order."""
    n, k = w.shape
    g = k if scheme.group_size == -1 else scheme.group_size
    if k % g:
        raise QuantError(f"GPTQ: group size {g} does not divide {k}")
    block = max(block // g, 1) * g if g <= block else g  # a group never straddles two blocks
    find = mse_grid_params if scheme.extra.get("mse_grid", True) else grid_params
    W = w.double().clone()
    H = h.clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(H.diagonal(), descending=True) if scheme.act_order else torch.arange(k, device=w.device)
    # static groups: grids from the untouched weights, indexed by original column
    static = None
    if scheme.act_order and scheme.static_groups or scheme.group_size == -1:
        static = [find(W[:, j:j + g], scheme) for j in range(0, k, g)]
    W, H = W[:, perm], H[perm][:, perm]
    U = _inverse_cholesky(H, scheme.damp)
    Q = torch.zeros(n, k, dtype=torch.int32, device=w.device)
    scales = torch.zeros(n, k // g, dtype=torch.float64, device=w.device)
    zeros = torch.zeros(n, k // g, dtype=torch.float64, device=w.device)
    group_of = torch.zeros(k, dtype=torch.int64, device=w.device)  # group of permuted column
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        E1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if static is not None:
                grp = int(perm[col]) // g
                scale, zero = static[grp]
            else:
                grp = col // g
                if col % g == 0:  # a new group: grid from the already-updated weights
                    scale, zero = find(W1[:, i:i + g], scheme)
            scale, zero = scale.double(), zero.double()
            scales[:, grp], zeros[:, grp], group_of[col] = scale, zero, grp
            q = torch.clamp(torch.round(W1[:, i] / scale) + zero, 0, scheme.qmax)
            Q[:, col] = q.to(torch.int32)
            err = (W1[:, i] - (q - zero) * scale) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    inv = torch.argsort(perm)
    g_idx = group_of[inv].to(torch.int32)
    return QuantizedWeight(Q[:, inv].to(torch.uint8), scales.to(scheme.scale_dtype).float(), zeros.to(torch.int32),
                           scheme.bits, scheme.group_size, scheme.sym, None if static is not None else g_idx)
