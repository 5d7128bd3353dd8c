"""Helpers shared by the kernel tests: fresh random inputs every run, and the error measure."""
import os

import torch

GEN = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh inputs every run


def rel_err(y, ref):
    """||y - ref|| / ||ref||; fails if y holds NaN/inf (a NaN-poisoned output not fully written)."""
    assert torch.isfinite(y).all(), "output not fully written (NaN poison survived) or overflowed"
    return ((y.double() - ref).norm() / ref.norm()).item()
