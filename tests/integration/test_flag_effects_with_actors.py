"""Flags shown at work on a real trainer, engine, router or rollout manager: micro-batching, gradient clipping,
the seed, the process-group timeout, checkpoint contents, weight-sync buckets and checks, engine start-up and
router timeouts, the evaluation function. slime/utils/arguments/flag_tests.py names these tests for their flags."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import ray
import torch
import torch.distributed as dist
from support.engines import cpu_engine_process
from support.fsdp import make_args, make_rollout, new_actor

from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
from slime.backends.fsdp_utils.model import snapshot_local_shards
from slime.backends.sglang_utils.router import start_router
from slime.ray.actor_group import RayTrainGroup
from slime.ray.driver import TrainingRun, train_one_rollout
from slime.ray.placement_group import PlacementSlice
from slime.ray.rollout import RolloutManager
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.utils.arguments import parse_args
from slime.utils.http_utils import find_free_port
from slime.utils.tracking import Tracker
from slime.utils.types import Sample, Status

MODULE = __name__
SFT = ("--loss-type", "sft_loss", "--lr", "1e-2")


pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


# ---- the trainer ------------------------------------------------------------------------------------------------


def test_distributed_timeout_is_the_process_group_timeout(tiny_model_dir):
    if dist.is_initialized():
        dist.destroy_process_group()  # the first trainer of a process sets the group up
    new_actor(make_args(tiny_model_dir, "--distributed-timeout-minutes", "3"))
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert backend.options._timeout.total_seconds() == 180


def test_seed_seeds_the_trainer(tiny_model_dir):
    draws = {}
    for seed in ("3", "3", "4"):
        new_actor(make_args(tiny_model_dir, "--seed", seed))
        draws.setdefault(seed, []).append(torch.rand(4))
    assert torch.equal(draws["3"][0], draws["3"][1]) and not torch.equal(draws["3"][0], draws["4"][0])


def test_micro_batch_flags_split_each_step(tiny_model_dir):
    data = make_rollout(8, seed=12)

    def layout(*extra: str) -> list[list[int]]:
        actor = new_actor(make_args(tiny_model_dir, *extra))
        (step,) = actor._micro_batches(actor._prepare(data))
        return [micro_batch.sample_indices for micro_batch in step]

    assert layout() == [[i] for i in range(8)]  # --micro-batch-size 1
    assert [len(indices) for indices in layout("--micro-batch-size", "3")] == [3, 3, 2]
    # A token budget instead: whole prompt groups (a prompt counted once) up to 40 tokens per micro-batch.
    budget = 40
    dynamic = layout("--micro-batch-size", "3", "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(budget))
    assert sorted(i for indices in dynamic for i in indices) == list(range(8))
    prompt_of = [tuple(t[: len(t) - r]) for t, r in zip(data["tokens"], data["response_lengths"])]
    for indices in dynamic:
        prompts = {prompt_of[i] for i in indices}
        assert sum(map(len, prompts)) + sum(data["response_lengths"][i] for i in indices) <= budget
    assert [len(indices) for indices in dynamic] != [3, 3, 2]


def test_clip_grad_bounds_the_update(tiny_model_dir):
    data = make_rollout(8, seed=11)

    def largest_change(*extra: str) -> float:
        actor = new_actor(make_args(tiny_model_dir, *SFT, "--weight-decay", "0", *extra))
        before = snapshot_local_shards(actor.model)
        actor.train(0, data)
        after = snapshot_local_shards(actor.model)
        return max((after[name] - before[name]).abs().max().item() for name in before)

    # Adam's first step is about lr x sign(grad); a gradient clipped far below --adam-eps barely moves a weight.
    free, clipped = largest_change("--clip-grad", "0"), largest_change("--clip-grad", "1e-9")
    assert free > 5e-3 and clipped < 1e-2 * free, (free, clipped)


def test_peak_tflops_is_the_mfu_denominator(tiny_model_dir):
    metrics = new_actor(make_args(tiny_model_dir, *SFT, "--peak-tflops", "0.5")).train(0, make_rollout(8, seed=13))
    assert metrics["perf/actor_train_tflops"] > 0
    assert metrics["perf/actor_train_mfu"] == pytest.approx(metrics["perf/actor_train_tflops"] / 0.5)


def test_checkpoint_flags_choose_what_is_saved_and_loaded(tiny_model_dir, tmp_path):
    root = tmp_path / "run"
    actor = new_actor(make_args(tiny_model_dir, *SFT, "--save", str(root)))
    saved = []
    for rollout_id in range(2):
        actor.train(rollout_id, make_rollout(8, seed=20 + rollout_id))
        torch.rand(100)  # a run draws random numbers (sampling, dropout): the saved RNG state is not a fresh one
        actor.save_model(rollout_id)
        saved.append(snapshot_local_shards(actor.model))
    saved_rng = torch.load(root / "iter_0000001" / "rng" / "rank_00000.pt", weights_only=True)["torch"]

    def resumed(*extra: str, with_ref: bool = False) -> tuple[FSDPTrainRayActor, int]:
        trainer = FSDPTrainRayActor(1, 0, None, None)
        start = trainer.init(make_args(tiny_model_dir, *SFT, *extra), "actor", with_ref)
        return trainer, start

    def has_adam_state(trainer: FSDPTrainRayActor) -> bool:
        return any(state for state in trainer.optimizer.state.values())

    loaded, start = resumed("--load", str(root))
    assert start == 2 and same_weights(snapshot_local_shards(loaded.model), saved[1]) and has_adam_state(loaded)
    assert torch.equal(torch.get_rng_state(), saved_rng)
    no_optim, start = resumed("--load", str(root), "--no-load-optim")
    assert start == 2 and same_weights(snapshot_local_shards(no_optim.model), saved[1]) and not has_adam_state(no_optim)
    resumed("--load", str(root), "--no-load-rng")
    assert not torch.equal(torch.get_rng_state(), saved_rng)
    finetune, start = resumed("--load", str(root), "--finetune")
    assert start == 0 and same_weights(snapshot_local_shards(finetune.model), saved[1]) and not has_adam_state(finetune)

    # The reference: the latest checkpoint of --ref-load, or the one --ref-ckpt-step names.
    latest, _ = resumed("--ref-load", str(root), "--use-kl-loss", with_ref=True)
    assert same_weights(latest.ref_weights, saved[1])
    first, _ = resumed("--ref-load", str(root), "--ref-ckpt-step", "0", "--use-kl-loss", with_ref=True)
    assert same_weights(first.ref_weights, saved[0])

    lean_root = tmp_path / "lean"
    lean = new_actor(make_args(tiny_model_dir, *SFT, "--save", str(lean_root), "--no-save-optim"))
    lean.train(0, make_rollout(8, seed=22))
    lean.save_model(0)
    folder = lean_root / "iter_0000000"
    assert not (folder / "optim").exists() and not json.loads((folder / "meta.json").read_text())["has_optimizer"]
    assert (root / "iter_0000000" / "optim").is_dir()
    without_adam, start = resumed("--load", str(lean_root))
    assert start == 1 and not has_adam_state(without_adam)


def test_update_weight_buffer_size_sizes_the_buckets(tiny_model_dir):
    def buckets(size: int) -> list[list[tuple[str, int]]]:
        actor = new_actor(make_args(tiny_model_dir, "--update-weight-buffer-size", str(size)))
        return [
            [(name, t.numel() * t.element_size()) for name, t in bucket] for bucket in actor._hf_weight_buckets(None)
        ]

    (everything,) = buckets(1 << 30)
    small = buckets(40_000)
    assert len(small) > 3
    assert [entry for bucket in small for entry in bucket] == everything  # the same tensors, in order
    for bucket in small:  # at most the buffer, unless one tensor alone is larger
        assert len(bucket) == 1 or sum(size for _, size in bucket) <= 40_000


def stage_marker_model(pre_process: bool, post_process: bool, vp_stage: int | None) -> torch.nn.Module:
    """--custom-model-provider-path: a stand-in model that records the pipeline stage it was built for."""
    model = torch.nn.Linear(2, 2)
    model.stage = (pre_process, post_process, vp_stage)
    return model


def _build_megatron_chunks(rank: int, world_size: int, model_dir: str) -> tuple:
    from slime.backends.megatron_utils.config import config_from_hf
    from slime.backends.megatron_utils.model import build_model, initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=1)
    args = config_from_hf(model_dir)
    (default,) = build_model(args, wrap_with_ddp=False)
    args.custom_model_provider_path = f"{MODULE}.stage_marker_model"
    (custom,) = build_model(args, wrap_with_ddp=False)
    return type(default).__name__, type(custom).__name__, custom.stage


def test_custom_model_provider_builds_the_megatron_model(tiny_model_dir):
    pytest.importorskip("megatron.core")
    from support.megatron_cpu import run_in_processes

    (result,) = run_in_processes(_build_megatron_chunks, world_size=1, args=(str(tiny_model_dir),))
    assert result == ("GPTModel", "Linear", (True, True, None))


# ---- against a CPU engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with cpu_engine_process(tiny_model_dir) as client_and_url:
        yield client_and_url


def test_check_weight_update_equal_checks_the_first_push(tiny_model_dir, engine, caplog):
    client, url = engine
    for check in (False, True):
        actor = new_actor(make_args(tiny_model_dir, *SFT, *(["--check-weight-update-equal"] if check else [])))
        actor.connect_rollout_engines([client], [url])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="slime.backends.train_actor"):
            actor.train(0, make_rollout(8, seed=30))
            actor.update_weights()
            actor.update_weights()  # the check runs on the first push only
        assert caplog.text.count("weight check passed") == (1 if check else 0), caplog.text


# ---- Ray training groups ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ppo_groups(tiny_model_dir, ray_cluster):
    """An actor and a critic group of one rank each (PPO), the critic alone for the first rollout."""
    args = make_args(tiny_model_dir, "--advantage-estimator", "ppo", "--lr", "1e-2", "--num-critic-only-steps", "1",
                     "--train-env-vars", json.dumps({"SLIME_FLAG_PROBE": "on"}), "--train-num-threads", "1")  # fmt: skip
    groups = [
        RayTrainGroup(args, PlacementSlice(None, [rank]), role=role) for rank, role in enumerate(("actor", "critic"))
    ]
    try:
        for group, refs in [(group, group.async_init()) for group in groups]:  # both build at once, as train.py's do
            group.wait(refs, "init")
        yield args, *groups
    finally:
        for group in groups:
            for actor in group.actors:
                ray.kill(actor)


def test_train_env_vars_reach_the_trainer_processes(ppo_groups):
    _, actor, critic = ppo_groups
    probe = ("SLIME_FLAG_PROBE", "OMP_NUM_THREADS")
    for group in (actor, critic):
        environment = ray.get(group.actors[0].__ray_call__.remote(lambda self: [os.environ.get(k) for k in probe]))
        assert environment == ["on", "1"]  # --train-env-vars, and --train-num-threads as the thread variables


def test_num_critic_only_steps_holds_the_actor_back(ppo_groups):
    args, actor, critic = ppo_groups
    run = TrainingRun(args, None, actor, critic, None, start_rollout_id=0, num_rollout=2, num_rollout_per_epoch=2)
    data_refs = [ray.put(make_rollout(8, seed=40))]
    first = train_one_rollout(run, 0, data_refs)
    assert "critic/value_loss" in first and not [name for name in first if name.startswith("train/")]
    second = train_one_rollout(run, 1, data_refs)
    assert "critic/value_loss" in second and "train/pg_loss" in second


# ---- trackers ---------------------------------------------------------------------------------------------------


def test_wandb_host_and_key_are_the_wandb_login(tiny_model_dir, tmp_path):
    key = "flagtestkey" + "0" * 29  # wandb's 40 characters
    tracker = Tracker(make_args(tiny_model_dir, "--use-wandb", "--wandb-mode", "offline", "--wandb-dir", str(tmp_path),
                                "--wandb-host", "http://127.0.0.1:9", "--wandb-key", key))  # fmt: skip
    try:
        assert (tracker.wandb.settings.base_url, tracker.wandb.settings.api_key) == ("http://127.0.0.1:9", key)
    finally:
        tracker.finish()


# ---- router and rollout manager ---------------------------------------------------------------------------------


def manager_flags(model_dir, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(model_dir), "--disable-rollout-global-dataset", "--num-rollout", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", *extra]  # fmt: skip


def test_router_request_timeout_reaches_the_router(tiny_model_dir, tmp_path):
    args = parse_args(manager_flags(tiny_model_dir, "--sglang-router-request-timeout-secs", "77"))
    args.server_log_dir = str(tmp_path)
    handle = start_router(args)
    try:
        command = handle.log_path.read_text().splitlines()[0].split()
        assert command[command.index("--request-timeout-secs") + 1] == "77"
    finally:
        handle.stop()


@pytest.mark.reliability(
    "an external engine that never answers, with --rollout-engine-start-timeout 2",
    "the rollout manager gives up after about 2 s, naming the address",
)
def test_rollout_engine_start_timeout_bounds_the_wait(tiny_model_dir):
    url = f"127.0.0.1:{find_free_port()}"
    args = parse_args(manager_flags(tiny_model_dir, "--rollout-external-engine-addrs", url,
                                    "--rollout-engine-start-timeout", "2"))  # fmt: skip
    started = time.monotonic()
    manager = RolloutManager(args, PlacementSlice(None))
    try:
        with pytest.raises(TimeoutError, match=f"engine http://{url} did not answer"):
            manager.wait_for_engines()
    finally:
        manager.dispose()
    assert time.monotonic() - started < 30


def answered(rewards: list[float]) -> list[Sample]:
    return [
        Sample(index=i, group_index=i // 2, tokens=[5, 6, 7], response_length=1, reward=r, status=Status.COMPLETED)
        for i, r in enumerate(rewards)
    ]


def rollout_scoring_zero(args, rollout_id, data_source, evaluation=False):
    samples = answered([0.0] * 4)
    if evaluation:
        return RolloutFnEvalOutput(data={"toy": {"rewards": [0.0] * 4, "truncated": [0] * 4, "samples": samples}})
    return RolloutFnTrainOutput(samples=[samples[:2], samples[2:]])


def eval_scoring_one(args, rollout_id, data_source, evaluation=False):
    samples = answered([1.0] * 4)
    return RolloutFnEvalOutput(data={"toy": {"rewards": [1.0] * 4, "truncated": [0] * 4, "samples": samples}})


def test_eval_function_path_runs_the_evaluation(tiny_model_dir, ray_cluster):
    flags = manager_flags(tiny_model_dir, "--debug-train-only", "--rollout-function-path",
                          f"{MODULE}.rollout_scoring_zero", "--eval-prompt-data", "toy", "unused.jsonl")  # fmt: skip
    assert RolloutManager(parse_args(flags), None).eval(0)["eval/toy"] == 0.0  # the rollout function, by default
    own = RolloutManager(parse_args([*flags, "--eval-function-path", f"{MODULE}.eval_scoring_one"]), None)
    assert own.eval(0)["eval/toy"] == 1.0
