"""Custom reward functions and trainer hooks for the end-to-end tests (imported by path in Ray workers)."""

from pathlib import Path

import torch


async def alternating_reward(args, sample) -> float:
    """1 for odd sample indices, 0 for even: every group of two gets one of each, so advantages are never 0."""
    return float(sample.index % 2)


def save_trainer_data(args, rollout_id, data) -> None:
    """--rollout-data-postprocess-path hook: keep what the policy trainer computed (advantages, values, returns,
    rewards) under `<--save>/trainer_data/rollout_<id>.pt`, for the test to check after the run."""
    if "advantages" not in data:  # the critic's pass
        return
    folder = Path(args.save) / "trainer_data"
    folder.mkdir(parents=True, exist_ok=True)
    kept = {key: data[key] for key in ("advantages", "values", "returns", "rewards", "response_lengths") if key in data}
    torch.save(kept, folder / f"rollout_{rollout_id}.pt")
