"""Inputs for the linter's two runs: clones of the caller's inputs, and inputs of identical
shapes and dtypes whose values differ.

Steps mutate their inputs (KV cache writes, relay scatters), so each run gets fresh clones.
The other values stay plausible, so a correct step runs the same ops on them: integers stay
within the example's min..max (so index tensors stay in range), floats within the example's
range (a constant one is scaled, keeping its sign), and non-finite entries (e.g. -inf masks)
stay put.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map


def clone_inputs(inputs: Any) -> Any:
    """Tensors cloned (same strides), anything else passed through, containers rebuilt."""
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, inputs)


_MAX_SAMPLED_SPAN = 1 << 24


def _other_integers(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    flat = t.flatten().cpu()
    low, high = int(flat.min()), int(flat.max())
    if high - low >= _MAX_SAMPLED_SPAN:
        # Garbage from torch.empty (an out= buffer) or hashes; a shuffle stays in range.
        return flat[torch.randperm(flat.numel(), generator=generator)]
    # NOTE: not a shuffle: that would keep sums and counts, which steps branch on.
    return torch.randint(low, high + 1, (flat.numel(),), generator=generator)


def _other_floats(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    flat = t.flatten().cpu().float()
    finite = torch.isfinite(flat)
    if not finite.any():
        return flat
    low, high = float(flat[finite].min()), float(flat[finite].max())
    noise = torch.rand(flat.shape, generator=generator)
    if high > low:
        values = low + noise * (high - low)
    else:
        # A constant tensor: vary it but keep its sign (probabilities stay non-negative).
        values = low * (0.5 + noise) if low != 0 else noise
    return torch.where(finite, values, flat)


def _other_values(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if t.numel() == 0:
        return t.clone()
    if t.dtype == torch.bool:
        values = torch.randint(0, 2, (t.numel(),), generator=generator).bool()
    elif t.dtype.is_floating_point:
        values = _other_floats(t, generator)
    elif not t.dtype.is_complex:
        values = _other_integers(t, generator)
    else:
        values = torch.randn(t.shape, dtype=t.dtype, generator=generator)
    return torch.empty_like(t).copy_(values.reshape(t.shape).to(t.dtype))


def other_values(inputs: Any, seed: int = 0) -> Any:
    """Inputs with the structure, shapes and dtypes of `inputs` and different values."""
    generator = torch.Generator().manual_seed(seed)
    return tree_map(lambda x: _other_values(x, generator) if isinstance(x, torch.Tensor) else x, inputs)


def check_same_layout(example: Any, alternative: Any) -> None:
    """Raise ValueError unless both input sets have the same structure, shapes and dtypes."""
    def layout(inputs: Any) -> Any:
        return tree_map(lambda x: (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x), inputs)

    if layout(example) != layout(alternative):
        raise ValueError(
            "alt_inputs must match example_inputs in structure, shapes and dtypes "
            "(only the values may differ): the linter compares two runs of one captured shape"
        )
