"""The Megatron PPO critic: same values and value loss as the FSDP critic, TP/PP-invariant, and resumable.

On the same tiny HF weights and fixed rollouts both critics run two `train` calls (one optimizer step,
then two, where the value clip is active) with `compute_values` before each and at the end. FSDP runs
in the pytest process; Megatron in spawned gloo workers with the CPU patch (tests/support/megatron_cpu.py),
once at TP=1 and, in one pair of workers, at TP=2 and at PP=2. Each
Megatron run then saves to `<save>/critic`, takes one more step, and a fresh critic resumed from the
checkpoint must give the saved values exactly and take the same step.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.megatron_actor import make_rollout
from support.megatron_cpu import requires_megatron_core, run_in_processes

from slime.utils.arguments import parse_args

pytestmark = requires_megatron_core

TOLERANCE = 1e-4
COMPARED = ("value_loss", "value_clipfrac", "grad_norm", "lr")
PARALLEL_RUNS = {
    "tp2": ("--tensor-model-parallel-size", "2"),
    "pp2": ("--pipeline-model-parallel-size", "2"),
}


def make_args(model_dir: str, backend: str, *extra: str):
    return parse_args(
        ["--train-backend", backend, "--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl",
         "--num-rollout", "4", "--rollout-batch-size", "8", "--n-samples-per-prompt", "1",
         "--global-batch-size", "8", "--micro-batch-size", "3", "--lr", "1e-2", "--weight-decay", "0",
         "--clip-grad", "1.0", "--advantage-estimator", "ppo", "--value-clip", "0.2", *extra]
    )  # fmt: skip


def rollouts() -> list[dict]:
    """Two shards: the first trained in one optimizer step, the second in two (value clip active)."""
    first = make_rollout(8, seed=5)
    second = make_rollout(8, seed=6) | {"num_steps": 2}
    return [first, second]


def run_critic(critic, data: list[dict]) -> dict:
    """compute_values then train on each shard, and the values after the last step."""
    result: dict = {"values": [], "metrics": []}
    for rollout_id, shard in enumerate(data):
        result["values"].append(critic.compute_values(shard))
        result["metrics"].append(critic.train(rollout_id, shard))
    result["values"].append(critic.compute_values(data[0]))
    return result


def _new_critic(rank: int, world_size: int, args):
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    critic = MegatronTrainRayActor(world_size, rank, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return critic, critic.init(args, "critic")


def _megatron_worker(rank: int, world_size: int, model_dir: str, save_root: str, data: list, runs: dict) -> dict:
    results = {}
    for name, extra in runs.items():
        save = str(Path(save_root) / name)
        critic, start = _new_critic(rank, world_size, make_args(model_dir, "megatron", "--save", save, *extra))
        result = run_critic(critic, data) | {"start": start}
        critic.save_model(len(data) - 1)
        critic.compute_values(data[0])
        result["after_save_metrics"] = critic.train(len(data), data[0])
        result["after_save_values"] = critic.compute_values(data[0])

        resumed, resumed_start = _new_critic(rank, world_size, make_args(model_dir, "megatron", "--load", save, *extra))
        result["resumed_start"] = resumed_start
        result["resumed_values"] = resumed.compute_values(data[0])
        result["resumed_metrics"] = resumed.train(len(data), data[0])
        result["resumed_after_values"] = resumed.compute_values(data[0])
        result["critic_dir_files"] = sorted(os.listdir(Path(save) / "critic"))
        result["save_root_files"] = sorted(os.listdir(save))
        results[name] = result
    return results


def run_fsdp(model_dir: str, data: list[dict]) -> dict:
    from slime.backends.fsdp_utils.actor import FSDPTrainRayActor

    try:
        critic = FSDPTrainRayActor(1, 0, None, None)
        critic.init(make_args(model_dir, "fsdp"), "critic")
        return run_critic(critic, data)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def values_gap(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory):
    data = rollouts()
    root = tmp_path_factory.mktemp("megatron_critic")
    tp1 = run_in_processes(_megatron_worker, 1, args=(str(tiny_model_dir), str(root), data, {"tp1": ()}))[0]["tp1"]
    parallel = run_in_processes(_megatron_worker, 2, args=(str(tiny_model_dir), str(root), data, PARALLEL_RUNS))
    fsdp = run_fsdp(str(tiny_model_dir), data)
    return data, tp1, parallel, fsdp


def test_values_and_value_loss_match_fsdp(results):
    data, tp1, _, fsdp = results
    # Zero-initialized value heads: both critics start at exactly 0 on every response token.
    assert tp1["values"][0] == fsdp["values"][0]
    assert all(v == 0.0 for sample in fsdp["values"][0] for v in sample)
    assert [len(v) for v in tp1["values"][0]] == data[0]["response_lengths"]
    for index in (1, 2):
        gap = values_gap(tp1["values"][index], fsdp["values"][index])
        print(f"values after train call {index}: max |megatron - fsdp| = {gap:.2e}")
        assert gap < TOLERANCE
    for call, (megatron_metrics, fsdp_metrics) in enumerate(zip(tp1["metrics"], fsdp["metrics"], strict=True)):
        for name in COMPARED:
            a, b = megatron_metrics[name], fsdp_metrics[name]
            print(f"train call {call} {name}: megatron {a:.6f} fsdp {b:.6f}")
            assert abs(a - b) <= TOLERANCE * max(1.0, abs(b)), name
    # Not trivially equal: the values moved, the loss fell, and the second call's second step clipped.
    assert values_gap(fsdp["values"][2], fsdp["values"][0]) > 1e-2
    assert fsdp["metrics"][0]["value_loss"] > 0 and fsdp["metrics"][0]["grad_norm"] > 0
    assert fsdp["metrics"][1]["value_clipfrac"] > 0


@pytest.mark.parametrize("name", sorted(PARALLEL_RUNS))
def test_model_parallel_matches_tp1(results, name):
    _, tp1, parallel, _ = results
    for rank, ranks_results in enumerate(parallel):
        result = ranks_results[name]
        for index in range(3):
            gap = values_gap(result["values"][index], tp1["values"][index])
            print(f"{name} rank {rank} values {index}: max |{name} - tp1| = {gap:.2e}")
            assert gap < TOLERANCE
        for call in range(2):
            for metric in COMPARED:
                a, b = result["metrics"][call][metric], tp1["metrics"][call][metric]
                assert abs(a - b) <= TOLERANCE * max(1.0, abs(b)), (call, metric)


def test_checkpoint_round_trip(results):
    _, tp1, parallel, _ = results
    for result in [tp1] + [ranks_results[name] for ranks_results in parallel for name in PARALLEL_RUNS]:
        assert result["start"] == 0 and result["resumed_start"] == 2
        # The critic's checkpoint lives in <save>/critic, leaving <save> to the actor's.
        assert "latest_checkpointed_iteration.txt" in result["critic_dir_files"]
        assert result["save_root_files"] == ["critic"]
        assert result["resumed_values"] == result["values"][-1]
        # Optimizer and LR-scheduler state came back too: the next step is the same step.
        assert values_gap(result["resumed_after_values"], result["after_save_values"]) < 1e-6
        for name in COMPARED:
            assert result["resumed_metrics"][name] == pytest.approx(result["after_save_metrics"][name], abs=1e-6)
