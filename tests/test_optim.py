"""fused_adam: torch's fused Adam kernel where the device has one, the same update as the default."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gp.optim import fused_adam


def _trajectory(optimizer_for, steps: int = 25) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5)).double()
    optimizer = optimizer_for(net.parameters())
    x, y = torch.randn(32, 12, dtype=torch.float64), torch.randn(32, 5, dtype=torch.float64)
    for _ in range(steps):
        optimizer.zero_grad()
        (net(x) - y).pow(2).mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


def test_fused_adam_fuses_on_cpu_and_follows_the_default_adam_to_float_rounding():
    fused = _trajectory(lambda ps: fused_adam(ps, lr=1e-2, betas=(0.5, 0.999)))
    default = _trajectory(lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.5, 0.999)))
    for a, b in zip(fused, default):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert fused_adam([nn.Parameter(torch.zeros(3))], lr=1e-3).defaults["fused"] is True


def test_fused_adam_falls_back_to_the_default_where_the_device_has_no_fused_kernel():
    optimizer = fused_adam([nn.Parameter(torch.zeros(3, device="meta"))], lr=1e-3)
    assert isinstance(optimizer, torch.optim.Adam) and not optimizer.defaults["fused"]


def test_fused_adam_refuses_no_parameters_naming_the_argument():
    with pytest.raises(ValueError, match="parameters"):
        fused_adam(iter(()), lr=1e-3)
