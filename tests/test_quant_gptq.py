"""GPTQ on one layer: its Hessian-weighted error tr((W-Q) H (W-Q)^T), the quantity GPTQ minimises,
must be lower than round-to-nearest's for every symmetry, act-order setting and grid choice."""
import pytest
import torch

from fitllm.quant.gptq import gptq_quantize
from fitllm.quant.rtn import fake_quant, mse_grid_params, rtn_quantize
from fitllm.quant.scheme import QuantScheme


def correlated_layer(seed: int, n: int = 48, k: int = 256, tokens: int = 2048):
    """Weights and the Hessian of inputs with correlated channels of uneven energy (as in real
    layers: a few channels carry most of the activation)."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k ** 0.5 + 0.3 * torch.eye(k)
    energy = torch.rand(k, generator=gen) * 3 + 0.1
    x = torch.randn(tokens, k, generator=gen) @ mix * energy
    h = (2 * x.T @ x / tokens).double()
    w = torch.randn(n, k, generator=gen) * 0.05
    return w, h


def hessian_error(w, q, h) -> float:
    d = (w - q).double()
    return float(torch.einsum("ik,kl,il->", d, h, d))


def rtn_dequant(w, scheme, mse: bool):
    """Round-to-nearest on the grid GPTQ starts from: min-max, or the MSE-searched clip."""
    if not mse:
        return rtn_quantize(w, scheme).dequantize()
    groups = w.reshape(-1, scheme.group_size)
    scale, zero = mse_grid_params(groups, scheme)
    return fake_quant(groups, scale, zero, scheme.qmax).reshape(w.shape)


CASES = [(sym, act, static, mse) for sym in (False, True) for act in (False, True) for static in (False, True)
         for mse in (False, True) if act or not static]


@pytest.mark.parametrize("sym,act_order,static_groups,mse", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_gptq_beats_rtn_on_hessian_error(sym, act_order, static_groups, mse, seed):
    w, h = correlated_layer(seed)
    scheme = QuantScheme("gptq", group_size=32, sym=sym, act_order=act_order, static_groups=static_groups,
                         extra={"mse_grid": mse})
    rtn = hessian_error(w, rtn_dequant(w, scheme, mse), h)
    qw = gptq_quantize(w, h, scheme)
    gptq = hessian_error(w, qw.dequantize(), h)
    assert gptq < 0.8 * rtn, (gptq, rtn)
    # integers stay on the grid and the groups are the ones the format will be told about
    assert int(qw.q.max()) <= scheme.qmax
    if static_groups or not act_order:
        assert qw.trivial_g_idx()
