"""Tiny HF models and Megatron forwards for the Megatron model tests; MODEL_ARGS read from scripts/models/*.sh."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config


def build_tiny_hf(path, config) -> str:
    """Save a random model for `config` with the same non-trivial init as tests/support/tiny_model.py."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return str(path)


def tiny_qwen2(path, vocab_size: int = 300) -> str:
    """A tiny random Qwen2 (GQA: 4 query heads, 2 KV heads) saved at `path`, with non-zero q/k/v biases so a layout
    error in Megatron's fused QKV bias shows."""
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, rope_theta=10000.0,
        pad_token_id=0,
    )  # fmt: skip
    path = build_tiny_hf(path, config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


def hf_logits(path: str, input_ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


def megatron_logits(model, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        logits = model(input_ids, positions, None)
    return gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]


MINIMAL_SLIME_FLAGS = ["--train-backend", "megatron", "--hf-checkpoint", "/models/x", "--prompt-data", "p.jsonl",
                       "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1"]  # fmt: skip


def model_args_of(script: Path) -> list[str]:
    command = f'source "{script}"; printf "%s\\n" "${{MODEL_ARGS[@]}}"'
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True)
    return result.stdout.splitlines()
