"""The tiny Qwen3-MoE of the routing-replay tests (the `moe_dir` fixture) and the HF reference routing."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from slime.utils.moe_routing import HFRouters

NUM_LAYERS, TOP_K = 2, 2  # the tiny MoE's layers and experts per token


def hf_routing(model_dir: str, tokens: list[int]) -> torch.Tensor:
    """The experts a float32 HF forward over the whole sequence routes every token to."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routers = HFRouters(model, NUM_LAYERS)
    with torch.no_grad():
        model(torch.tensor([tokens]))
    return routers.take()
