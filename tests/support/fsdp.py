"""In-process FSDP trainers for tests: arguments, random rollouts, an actor, a plain-HF log-prob reference."""

from __future__ import annotations

import random

import torch

from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
from slime.utils.arguments import parse_args

VOCAB = 320


CAPTURED: dict[int, dict] = {}


def capture_rollout_data(args, rollout_id, data):
    """--rollout-data-postprocess-path hook: keep what the trainer computed before its optimizer steps."""
    CAPTURED[rollout_id] = dict(data)


CAPTURE_HOOK = f"{__name__}.capture_rollout_data"


def make_args(model_dir, *extra: str, num_samples: int = 8, num_steps: int = 1):
    return parse_args(
        [
            "--hf-checkpoint",
            str(model_dir),
            "--prompt-data",
            "unused.jsonl",
            "--num-rollout",
            "4",
            "--rollout-batch-size",
            str(num_samples // 2),
            "--n-samples-per-prompt",
            "2",
            "--global-batch-size",
            str(num_samples // num_steps),
            *extra,
        ]
    )


def make_rollout(
    num_samples: int = 8, seed: int = 0, num_steps: int = 1, mask_holes: bool = False, group_size: int = 2
) -> dict:
    """A rollout shard with unequal prompt/response lengths, random tokens and rewards; consecutive
    samples come in groups of `group_size` with the same prompt (as GRPO's samples per prompt)."""
    rng = random.Random(seed)
    tokens, response_lengths, loss_masks = [], [], []
    for i in range(num_samples):
        if i % group_size == 0:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 7))]
        response = rng.randint(2, 11)
        tokens.append(prompt + [rng.randrange(VOCAB) for _ in range(response)])
        response_lengths.append(response)
        mask = [1] * response
        if mask_holes:
            mask[0] = 0  # e.g. a tool-output token inside a multi-turn response
        loss_masks.append(mask)
    rewards = [rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5) for _ in range(num_samples)]
    return {
        "tokens": tokens,
        "response_lengths": response_lengths,
        "rewards": rewards,
        "raw_reward": list(rewards),
        "truncated": [0] * num_samples,
        "loss_masks": loss_masks,
        "sample_indices": list(range(num_samples)),
        "num_steps": num_steps,
    }


def new_actor(args, role: str = "actor", with_ref: bool = False) -> FSDPTrainRayActor:
    actor = FSDPTrainRayActor(1, 0, None, None)
    actor.init(args, role, with_ref)
    return actor


def plain_response_log_probs(model, tokens: list[int], response_length: int, temperature: float = 1.0) -> torch.Tensor:
    """Reference: one unpacked sequence through a plain HF model, log_softmax(logits / T) of the response."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
    start = len(tokens) - response_length
    log_probs = torch.log_softmax(logits[start - 1 : len(tokens) - 1] / temperature, dim=-1)
    return log_probs.gather(-1, torch.tensor(tokens[start:]).unsqueeze(-1)).squeeze(-1)


def base_flags(model_dir) -> list[str]:
    return [
        "--hf-checkpoint",
        str(model_dir),
        "--prompt-data",
        "unused.jsonl",
        "--num-rollout",
        "10",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "4",
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-4",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "3",
    ]
