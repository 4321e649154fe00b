"""named_tensors: unflatten_named's dtype= (a flat mask split back like float tensors)."""

import torch

from lightning_gp.named_tensors import flatten_named, unflatten_named


def test_unflatten_named_dtype_keeps_a_bool_mask_as_views() -> None:
    like = {"w": torch.randn(2, 3), "b": torch.randn(3)}
    mask = flatten_named(like) > 0
    parts = unflatten_named(mask, like, dtype=torch.bool)
    assert list(parts) == ["w", "b"]
    for name, part in parts.items():
        assert part.dtype == torch.bool and part.shape == like[name].shape
        assert torch.equal(part, like[name] > 0)
    parts["b"][0] = ~parts["b"][0]  # views of the flat mask
    assert bool(mask[6]) == bool(parts["b"][0])
    # without dtype each part takes its like tensor's dtype, as before
    assert all(p.dtype == torch.float32 for p in unflatten_named(mask, like).values())
