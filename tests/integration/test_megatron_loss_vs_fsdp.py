"""The Megatron and FSDP backends compute the same thing: on one fixed GRPO rollout (same weights,
same data, KL loss and entropy bonus on, two optimizer steps) the old log-probs, the reference
log-probs and every loss metric agree within 1e-4.

FSDP runs in the pytest process (no patch); Megatron in a spawned gloo worker with the CPU patch.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from support.megatron_actor import make_rollout
from support.megatron_cpu import requires_megatron_core, run_in_processes

from slime.utils.arguments import parse_args

pytestmark = requires_megatron_core

TOLERANCE = 1e-4
CAPTURED: dict[int, dict] = {}
COMPARED = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss", "grad_norm", "lr")


def capture(args, rollout_id, data):
    """--rollout-data-postprocess-path hook: what the trainer computed before its optimizer steps."""
    CAPTURED[rollout_id] = {key: data[key] for key in ("log_probs", "ref_log_probs", "advantages")}


def make_args(model_dir: str, backend: str):
    return parse_args(
        ["--train-backend", backend, "--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl",
         "--num-rollout", "4", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
         "--global-batch-size", "4", "--micro-batch-size", "3", "--lr", "5e-3", "--weight-decay", "0",
         "--clip-grad", "1.0", "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.5",
         "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.01",
         "--rollout-data-postprocess-path", f"{__name__}.capture"]
    )  # fmt: skip


def _megatron_worker(rank: int, world_size: int, model_dir: str, data: dict) -> dict:
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    actor = MegatronTrainRayActor(1, 0, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    actor.init(make_args(model_dir, "megatron"), "actor", with_ref=True)
    metrics = actor.train(0, data)
    return {"metrics": metrics, "captured": CAPTURED[0]}


def run_fsdp(model_dir: str, data: dict) -> dict:
    from slime.backends.fsdp_utils.actor import FSDPTrainRayActor

    try:
        actor = FSDPTrainRayActor(1, 0, None, None)
        actor.init(make_args(model_dir, "fsdp"), "actor", with_ref=True)
        metrics = actor.train(0, data)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"metrics": metrics, "captured": CAPTURED[0]}


@pytest.fixture(scope="module")
def results(tiny_model_dir):
    data = make_rollout(8, seed=3)
    data["num_steps"] = 2
    megatron = run_in_processes(_megatron_worker, 1, args=(str(tiny_model_dir), data))[0]
    fsdp = run_fsdp(str(tiny_model_dir), data)
    return megatron, fsdp


def test_old_and_ref_log_probs_equal(results):
    megatron, fsdp = results
    for key in ("log_probs", "ref_log_probs", "advantages"):
        pairs = zip(megatron["captured"][key], fsdp["captured"][key], strict=True)
        gap = max(float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max()) for a, b in pairs)
        print(f"{key}: max |megatron - fsdp| = {gap:.2e}")
        assert gap < TOLERANCE, key


def test_policy_loss_steps_equal(results):
    megatron, fsdp = results
    for name in COMPARED:
        a, b = megatron["metrics"][f"train/{name}"], fsdp["metrics"][f"train/{name}"]
        print(f"train/{name}: megatron {a:.6f} fsdp {b:.6f}")
        # Relative for large values (grad_norm ~ 11): float32 sums in a different order differ by ~1e-5 relative.
        assert abs(a - b) <= TOLERANCE * max(1.0, abs(b)), name
    # The second step ran on updated weights, so the KL terms are live, not trivially zero.
    assert fsdp["metrics"]["train/ppo_kl"] != 0.0 and fsdp["metrics"]["train/kl_loss"] > 0.0
    assert megatron["metrics"].keys() >= {f"train/{name}" for name in COMPARED}
