"""Megatron actors for tests (in spawned gloo workers with the CPU patch): arguments, random rollouts, an actor."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

VOCAB = 320  # the tiny model's vocabulary (support/tiny_model.py)


def make_rollout(num_samples: int = 8, seed: int = 0) -> dict:
    """A shard with unequal prompt/response lengths, random tokens and +-1 rewards."""
    rng = random.Random(seed)
    tokens, response_lengths = [], []
    for _ in range(num_samples):
        prompt, response = rng.randint(2, 7), rng.randint(2, 9)
        tokens.append([rng.randrange(VOCAB) for _ in range(prompt + response)])
        response_lengths.append(response)
    rewards = [rng.choice([-1.0, 1.0]) for _ in range(num_samples)]
    return {
        "tokens": tokens,
        "response_lengths": response_lengths,
        "rewards": rewards,
        "raw_reward": list(rewards),
        "truncated": [0] * num_samples,
        "loss_masks": [[1] * r for r in response_lengths],
        "sample_indices": list(range(num_samples)),
        "num_steps": 1,
    }


def make_args(model_dir: str, *extra: str):
    from slime.utils.arguments import parse_args

    return parse_args(
        ["--train-backend", "megatron", "--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl",
         "--num-rollout", "4", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
         "--global-batch-size", "8", "--micro-batch-size", "3", "--lr", "1e-2", "--weight-decay", "0", *extra]
    )  # fmt: skip


def new_megatron_actor(rank: int, world_size: int, args):
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    actor = MegatronTrainRayActor(world_size, rank, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return actor, actor.init(args, "actor")


def hf_model_with(model_dir, state: dict[str, torch.Tensor]):
    """The HF model of `model_dir` with `state` (HF checkpoint names) as its weights, loaded the way transformers
    loads a checkpoint: it fuses per-expert MoE tensors itself, so the reference does not share slime's mapping."""
    with tempfile.TemporaryDirectory() as folder:
        shutil.copy(Path(model_dir) / "config.json", folder)
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, f"{folder}/model.safetensors")
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert all("rotary" in name for name in info["missing_keys"]), info["missing_keys"]
    return model.eval()
