"""`unwrap_model`: the GPTModel inside Megatron's wrappers.

A module of its own so the converters and the checkpoint code can reach the GPTModel without
importing model.py, which imports them back (model.py builds the critic, critic.py loads checkpoints).
"""

from __future__ import annotations

from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / Float16Module wrappers (anything with a `.module`) down to the GPTModel."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model
