"""Flags that used to parse without effect, now doing what upstream's do: trainer recipe flags (FSDP),
rollout hooks and debug data (RolloutManager, default rollout), CI checks, --custom-config-path."""

from __future__ import annotations

import json
import random

import pytest
import ray
import torch
from support.engines import cpu_engine_process
from support.fsdp import make_rollout, plain_response_log_probs
from transformers import AutoModelForCausalLM

from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
from slime.backends.fsdp_utils.model import load_local_shards, snapshot_local_shards
from slime.ray import driver
from slime.ray.rollout import RolloutManager, pass_at_k, samples_to_train_data
from slime.rollout import sglang_rollout
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.utils.arguments import ArgumentValidationError, parse_args
from slime.utils.tracking import CICheckFailed, Tracker
from slime.utils.types import Sample, Status

MODULE = __name__
CAPTURED: dict[int, dict] = {}
CALLS: dict[str, list] = {}


pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


@pytest.fixture(autouse=True)
def _fresh_calls():
    CALLS.clear()
    CAPTURED.clear()
    sglang_rollout._STATE = None  # the default rollout keeps its tokenizer and hooks per process
    yield
    sglang_rollout._STATE = None


def capture(args, rollout_id, data):
    """--rollout-data-postprocess-path: keep what the trainer computed before its optimizer steps."""
    CAPTURED[rollout_id] = {key: list(value) if isinstance(value, list) else value for key, value in data.items()}


def make_args(model_dir, *extra: str, num_samples: int = 8, num_steps: int = 1):
    return parse_args(
        ["--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl", "--num-rollout", "4",
         "--rollout-batch-size", str(num_samples // 2), "--n-samples-per-prompt", "2",
         "--global-batch-size", str(num_samples // num_steps), *extra]
    )  # fmt: skip


def new_actor(args, with_ref: bool = False) -> FSDPTrainRayActor:
    actor = FSDPTrainRayActor(1, 0, None, None)
    actor.init(args, "actor", with_ref)
    return actor


def changed(before: dict, after: dict) -> set[str]:
    return {name for name in before if not torch.equal(before[name], after[name])}


# ---------------------------------------------------------------------------------------------
# Trainer recipe (FSDP)
# ---------------------------------------------------------------------------------------------


def test_freeze_and_only_train_params_keep_the_other_weights(tiny_model_dir):
    data = make_rollout(8, seed=1)
    frozen = new_actor(make_args(tiny_model_dir, "--loss-type", "sft_loss", "--lr", "1e-2",
                                 "--freeze-params-name-list", "embed_tokens", r"layers\.1\."))  # fmt: skip
    before = snapshot_local_shards(frozen.model)
    frozen.train(0, data)
    moved = changed(before, snapshot_local_shards(frozen.model))
    assert moved and not any("embed_tokens" in n or "layers.1." in n for n in moved), moved
    assert any("layers.0." in n for n in moved)

    only = new_actor(make_args(tiny_model_dir, "--loss-type", "sft_loss", "--lr", "1e-2",
                               "--only-train-params-name-list", "self_attn"))  # fmt: skip
    before = snapshot_local_shards(only.model)
    only.train(0, data)
    moved = changed(before, snapshot_local_shards(only.model))
    assert moved and all("self_attn" in name for name in moved), moved


@pytest.mark.reliability("--freeze-params-name-list with a pattern no parameter matches", "init fails naming it")
def test_freeze_pattern_matching_nothing_is_an_error(tiny_model_dir):
    with pytest.raises(ValueError, match="no_such_module"):
        new_actor(make_args(tiny_model_dir, "--freeze-params-name-list", "no_such_module"))
    with pytest.raises(ArgumentValidationError, match="regular expression"):
        make_args(tiny_model_dir, "--only-train-params-name-list", "layers[")


def test_reset_optimizer_states_makes_each_rollout_a_fresh_adam(tiny_model_dir):
    extra = ("--loss-type", "sft_loss", "--lr", "1e-2")
    d0, d1 = make_rollout(8, seed=2), make_rollout(8, seed=3)
    reset = new_actor(make_args(tiny_model_dir, *extra, "--reset-optimizer-states"))
    reset.train(0, d0)
    states = [t for state in reset.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    assert states and all(not t.any() for t in states)
    after_first = snapshot_local_shards(reset.model)
    reset.train(1, d1)

    # A fresh optimizer started from the same weights takes the same step.
    fresh = new_actor(make_args(tiny_model_dir, *extra))
    load_local_shards(fresh.model, after_first)
    fresh.train(1, d1)
    expected, got = snapshot_local_shards(fresh.model), snapshot_local_shards(reset.model)
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-7), name
    kept = new_actor(make_args(tiny_model_dir, *extra))
    kept.train(0, d0)
    assert any(t.any() for state in kept.optimizer.state.values() for t in state.values())


@pytest.mark.parametrize("interval", [None, 1])
def test_ref_update_interval_refreshes_the_reference(tiny_model_dir, interval):
    extra = ["--lr", "1e-2", "--use-kl-loss", "--kl-loss-coef", "0.1"]
    extra += ["--ref-update-interval", str(interval)] if interval else []
    actor = new_actor(make_args(tiny_model_dir, *extra), with_ref=True)
    data = make_rollout(8, seed=4)
    assert actor.train(0, data)["train/kl_loss"] == 0.0  # the reference starts as the actor
    kl_after_a_step = actor.train(1, data)["train/kl_loss"]
    if interval:  # refreshed after rollout 0: reference == actor again
        assert kl_after_a_step == 0.0
    else:
        assert abs(kl_after_a_step) > 1e-6


@pytest.mark.reliability("--ref-update-interval without a KL term", "refused at parse time: nothing uses the reference")
def test_ref_update_interval_needs_a_reference(tiny_model_dir):
    with pytest.raises(ArgumentValidationError, match="--use-kl-loss or --kl-coef"):
        make_args(tiny_model_dir, "--ref-update-interval", "2")


def test_get_mismatch_metrics_measures_the_gap_under_rollout_logprobs(tiny_model_dir):
    data = make_rollout(8, seed=5)
    rng = random.Random(0)
    data["rollout_log_probs"] = [[-rng.uniform(0.5, 3.0) for _ in range(n)] for n in data["response_lengths"]]
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    trainer = [plain_response_log_probs(plain, t, n) for t, n in zip(data["tokens"], data["response_lengths"])]
    engine = [torch.tensor(lp) for lp in data["rollout_log_probs"]]
    diffs = torch.cat([(a - b).abs() for a, b in zip(trainer, engine)])
    log_ratio = torch.cat([a - b for a, b in zip(trainer, engine)]).double()
    expected_kl = float((log_ratio.exp() - 1 - log_ratio).mean())

    plain_run = new_actor(make_args(tiny_model_dir, "--use-rollout-logprobs")).train(0, data)
    assert "train/train_rollout_logprob_abs_diff" not in plain_run
    metrics = new_actor(make_args(tiny_model_dir, "--use-rollout-logprobs", "--get-mismatch-metrics")).train(0, data)
    assert metrics["train/train_rollout_logprob_abs_diff"] == pytest.approx(diffs.mean().item(), rel=1e-5)
    assert metrics["train/train_rollout_logprob_max_abs_diff"] == pytest.approx(diffs.max().item(), rel=1e-5)
    assert metrics["train/train_rollout_kl"] == pytest.approx(expected_kl, rel=1e-4)


@pytest.mark.reliability(
    "a NaN in the loss and gradients (default Megatron check on)", "the step raises, naming the fix"
)
def test_nan_gradient_stops_the_run_unless_the_check_is_off(tiny_model_dir):
    data = make_rollout(8, seed=6)
    for extra, stops in (((), True), (("--no-check-for-nan-in-loss-and-grad",), False)):
        actor = new_actor(make_args(tiny_model_dir, *extra))
        hook = actor.model.lm_head.register_forward_hook(lambda module, inputs, output: output * float("nan"))
        try:
            if stops:
                with pytest.raises(FloatingPointError, match="--no-check-for-nan-in-loss-and-grad"):
                    actor.train(0, data)
            else:
                assert actor.train(0, data)["train/skipped_steps"] == 1.0
        finally:
            hook.remove()


def test_megatron_recompute_and_attention_flags_mean_the_same_under_fsdp(tiny_model_dir):
    plain = new_actor(make_args(tiny_model_dir))
    assert not plain.model.model.layers[0].gradient_checkpointing and plain.attn_implementation == "sdpa"
    for extra in (["--recompute-activations"], ["--recompute-granularity", "full", "--recompute-method", "uniform"]):
        assert new_actor(make_args(tiny_model_dir, *extra)).model.model.layers[0].gradient_checkpointing
    assert new_actor(make_args(tiny_model_dir, "--attention-backend", "unfused")).attn_implementation == "eager"


def test_ckpt_step_loads_that_checkpoint(tiny_model_dir, tmp_path):
    save = str(tmp_path / "run")
    actor = new_actor(make_args(tiny_model_dir, "--loss-type", "sft_loss", "--lr", "1e-2", "--save", save))
    saved = {}
    for rollout_id in range(2):
        actor.train(rollout_id, make_rollout(8, seed=7 + rollout_id))
        actor.save_model(rollout_id)
        saved[rollout_id] = snapshot_local_shards(actor.model)
    # A data source of the user's own: its state is not part of the checkpoint check_resume verifies.
    args = make_args(tiny_model_dir, "--load", save, "--save", save, "--ckpt-step", "0",
                     "--data-source-path", f"{MODULE}.OwnDataSource")  # fmt: skip
    assert driver.check_resume(args) == 0
    resumed = FSDPTrainRayActor(1, 0, None, None)
    assert resumed.init(args, "actor") == 1
    assert not changed(saved[0], snapshot_local_shards(resumed.model))
    with pytest.raises(ArgumentValidationError, match="--load"):
        make_args(tiny_model_dir, "--ckpt-step", "0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.reliability("--distributed-backend nccl on a machine without CUDA", "refused at parse time, names gloo")
def test_distributed_backend_nccl_needs_cuda(tiny_model_dir):
    with pytest.raises(ArgumentValidationError, match="--distributed-backend gloo"):
        make_args(tiny_model_dir, "--distributed-backend", "nccl")


# ---------------------------------------------------------------------------------------------
# --keep-old-actor, against a real CPU engine
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with cpu_engine_process(tiny_model_dir) as client_and_url:
        yield client_and_url


def with_versions(data: dict, version: str) -> dict:
    return {**data, "weight_versions": [version] * len(data["tokens"])}


def test_keep_old_actor_takes_old_log_probs_from_the_generating_weights(tiny_model_dir, engine):
    client, url = engine
    extra = ("--lr", "1e-2", "--rollout-data-postprocess-path", f"{MODULE}.capture")
    data = make_rollout(8, seed=8)
    runs = {}
    for keep in (True, False):
        actor = new_actor(make_args(tiny_model_dir, *extra, *(["--keep-old-actor"] if keep else [])))
        actor.connect_rollout_engines([client], [url])
        actor.update_weights()  # version 1: the weights the engines generate rollout 0 and 1 with
        actor.train(0, with_versions(data, "1"))
        actor.update_weights()  # version 2
        # train_async.py: rollout 1 was generated before push 2, by version 1.
        actor.train(1, with_versions(data, "1"))
        runs[keep] = dict(CAPTURED)
    for old, new in zip(runs[True][0]["log_probs"], runs[True][1]["log_probs"]):
        assert torch.equal(old, new)  # both from version 1's weights
    assert any(not torch.equal(a, b) for a, b in zip(runs[False][0]["log_probs"], runs[False][1]["log_probs"]))

    samples = [Sample(tokens=[1, 2, 3], response_length=1, reward=1.0, weight_versions=["1", "2"])] * 2
    assert samples_to_train_data(make_args(tiny_model_dir, "--keep-old-actor"), samples)["weight_versions"] == ["2"] * 2


@pytest.mark.reliability("--keep-old-actor on rollout data without weight versions", "train fails naming the field")
def test_keep_old_actor_needs_weight_versions(tiny_model_dir):
    actor = new_actor(make_args(tiny_model_dir, "--keep-old-actor"))
    with pytest.raises(ValueError, match="weight_versions"):
        actor.train(0, make_rollout(8, seed=9))
    with pytest.raises(RuntimeError, match="weight version 5"):
        actor.train(0, with_versions(make_rollout(8, seed=9), "5"))


# ---------------------------------------------------------------------------------------------
# Default rollout hooks, against the same engine (no router: the engine speaks /generate itself)
# ---------------------------------------------------------------------------------------------


def tag_sample(args, sample, *, rollout_id, evaluation):
    sample.metadata = {**(sample.metadata or {}), "hooked": rollout_id}


async def replace_sample(args, sample, *, rollout_id, evaluation):
    CALLS.setdefault("replaced", []).append(sample.index)
    sample.metadata = {**sample.metadata, "replaced": True}
    return sample


async def reward_from_hooks(args, sample):
    CALLS.setdefault("rewarded", []).append(dict(sample.metadata))
    return float(sample.index % 2)


def drop_odd_groups(args, samples, **kwargs):
    return samples[0].group_index % 2 == 0


def remove_second_samples(args, groups):
    CALLS["filtered"] = [len(g) for g in groups]
    for group in groups:
        group[1].remove_sample = True


def record_all_samples(args, groups, data_source):
    CALLS["all"] = [g[0].group_index for g in groups]
    CALLS["data_source"] = data_source


def test_default_rollout_runs_sample_hooks_filter_and_all_samples_process(tiny_model_dir, engine, tmp_path):
    _, url = engine
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"what is {i} + {i}?", "label": "0"}) + "\n" for i in range(8)))
    args = parse_args(
        ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(prompts), "--num-rollout", "1",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--over-sampling-batch-size", "4",
         "--rollout-max-response-len", "3", "--custom-rm-path", f"{MODULE}.reward_from_hooks",
         "--rollout-sample-hook-path", f"{MODULE}.tag_sample", f"{MODULE}.replace_sample",
         "--dynamic-sampling-filter-path", f"{MODULE}.drop_odd_groups",
         "--rollout-sample-filter-path", f"{MODULE}.remove_second_samples",
         "--rollout-all-samples-process-path", f"{MODULE}.record_all_samples"]
    )  # fmt: skip
    host, port = url.removeprefix("http://").split(":")
    args.sglang_router_ip, args.sglang_router_port, args.rollout_engine_urls = host, int(port), [url]
    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    source = RolloutDataSourceWithBuffer(args)
    output = sglang_rollout.generate_rollout(args, 7, source)
    kept = output.samples
    assert [g[0].group_index % 2 for g in kept] == [0, 0]
    assert all(entry["hooked"] == 7 and entry["replaced"] for entry in CALLS["rewarded"])  # hooks ran before reward
    assert CALLS["filtered"] == [2, 2] and [[s.remove_sample for s in g] for g in kept] == [[False, True]] * 2
    assert CALLS["data_source"] is source
    assert len(CALLS["all"]) == 2 + output.metrics["rollout/dropped_groups"]
    assert {g[0].group_index for g in kept} <= set(CALLS["all"])


# ---------------------------------------------------------------------------------------------
# RolloutManager: conversion, logging functions, debug data (no engines: --debug-train-only)
# ---------------------------------------------------------------------------------------------


def fixed_rollout(args, rollout_id, data_source, evaluation=False):
    """Two prompt groups of two samples, rewards [1, 0] and [0, 0]; topics a, b."""
    samples = [
        Sample(index=i, group_index=i // 2, tokens=[5, 6, 7, 8 + i], response_length=2 + i % 2, reward=r,
               status=Status.COMPLETED, metadata={"topic": "ab"[i // 2]}, rollout_id=rollout_id)
        for i, r in enumerate([1.0, 0.0, 0.0, 0.0])
    ]  # fmt: skip
    if evaluation:
        return RolloutFnEvalOutput(data={"toy": {"rewards": [1.0, 0.0, 0.0, 0.0], "truncated": [0] * 4,
                                                 "samples": samples}})  # fmt: skip
    return RolloutFnTrainOutput(samples=[samples[:2], samples[2:]], metrics={"rollout/custom": 3.0})


def convert_with_marker(args, samples):
    data = samples_to_train_data(args, samples)
    data["marker"] = [f"s{s.index}" for s in samples]
    return data


def log_and_skip(rollout_id, args, samples, extra_metrics, rollout_time):
    CALLS["log"] = (rollout_id, len(samples), dict(extra_metrics), rollout_time)
    return True


def log_eval_and_skip(rollout_id, args, data, extra_metrics):
    CALLS["eval_log"] = (rollout_id, sorted(data))
    return True


def manager_args(model_dir, *extra: str):
    return parse_args(
        ["--hf-checkpoint", str(model_dir), "--disable-rollout-global-dataset", "--num-rollout", "1",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--debug-train-only",
         "--rollout-function-path", f"{MODULE}.fixed_rollout", *extra]
    )  # fmt: skip


def test_pass_at_k_is_the_unbiased_estimate():
    # Group 1: 4 samples, 1 pass. pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@3 = 1 - C(3,3)/C(4,3) = 3/4,
    # pass@4 = 1. Group 2: none passes.
    assert pass_at_k([[1, 0, 0, 0], [0, 0, 0, 0]]) == {1: 0.125, 2: 0.25, 3: 0.375, 4: 0.5}
    # 5 samples, 2 pass: pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10; pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10; pass@4 = 1.
    assert pass_at_k([[1, 0, 1, 0, 0]]) == pytest.approx({1: 0.4, 2: 0.7, 3: 0.9, 4: 1.0, 5: 1.0})
    assert pass_at_k([[1, 1], [0.5, 1]]) == {1: 0.75, 2: 1.0}


def test_manager_converts_logs_and_saves_train_data(tiny_model_dir, ray_cluster, tmp_path):
    template = str(tmp_path / "train_{rollout_id}_{rank}.pt")
    args = manager_args(tiny_model_dir, "--log-passrate", "--log-reward-category", "topic", "--log-correct-samples",
                        "--custom-convert-samples-to-train-data-path", f"{MODULE}.convert_with_marker",
                        "--save-debug-train-data", template)  # fmt: skip
    manager = RolloutManager(args, None)
    batch = manager.generate(3, dp_size=2)
    metrics = batch.metrics
    assert metrics["rollout/pass@1"] == 0.25 and metrics["rollout/pass@2"] == 0.5
    assert (metrics["rollout/reward/a"], metrics["rollout/reward/b"]) == (0.5, 0.0)
    assert metrics["rollout/correct_response_length"] == 2.0 and metrics["rollout/incorrect_response_length"] == 8 / 3
    assert metrics["rollout/custom"] == 3.0 and metrics["rollout/reward"] == 0.25
    for rank, ref in enumerate(batch.data_refs):
        shard = ray.get(ref)
        saved = torch.load(template.format(rollout_id=3, rank=rank), weights_only=True)
        assert saved == {"rollout_id": 3, "rank": rank, "data": shard}
        assert shard["marker"] == [f"s{i}" for i in shard["sample_indices"]]


@pytest.mark.reliability("a custom convert function that leaves out loss_masks", "the rollout fails naming the key")
def test_custom_convert_must_return_what_the_trainers_need(tiny_model_dir, ray_cluster):
    args = manager_args(tiny_model_dir, "--custom-convert-samples-to-train-data-path", f"{MODULE}.convert_bad")
    with pytest.raises(ValueError, match="loss_masks"):
        RolloutManager(args, None).generate(0)


def convert_bad(args, samples):
    data = samples_to_train_data(args, samples)
    del data["loss_masks"]
    return data


def test_custom_log_functions_replace_the_default_figures(tiny_model_dir, ray_cluster, tmp_path):
    args = manager_args(tiny_model_dir, "--custom-rollout-log-function-path", f"{MODULE}.log_and_skip",
                        "--custom-eval-rollout-log-function-path", f"{MODULE}.log_eval_and_skip",
                        "--eval-prompt-data", "toy", "unused.jsonl")  # fmt: skip
    manager = RolloutManager(args, None)
    metrics = manager.generate(2).metrics
    rollout_id, count, extra, elapsed = CALLS["log"]
    assert (rollout_id, count, extra) == (2, 4, {"rollout/custom": 3.0}) and elapsed >= 0
    assert "rollout/reward" not in metrics and metrics["rollout/custom"] == 3.0
    assert manager.eval(2) == {} and CALLS["eval_log"] == (2, ["toy"])
    # Without them, the default figures are there (eval pass@k over n_samples_per_eval_prompt = 2), and the eval
    # samples are dumped beside the rollout dumps.
    plain = RolloutManager(manager_args(tiny_model_dir, "--eval-prompt-data", "toy", "unused.jsonl", "--log-passrate",
                                        "--n-samples-per-eval-prompt", "2", "--save-debug-rollout-data",
                                        str(tmp_path / "dumps" / "rollout_{rollout_id}.pt")), None)  # fmt: skip
    assert plain.generate(2).metrics["rollout/reward"] == 0.25
    assert plain.eval(2) == {
        "eval/toy": 0.25,
        "eval/toy/truncated": 0.0,
        "eval/toy/pass@1": 0.25,
        "eval/toy/pass@2": 0.5,
    }
    dumped = torch.load(tmp_path / "dumps" / "eval_toy_rollout_2.pt", weights_only=False)
    assert (dumped["rollout_id"], dumped["eval_set"]) == (2, "toy")
    rewards = [Sample.from_dict(d).reward for d in dumped["samples"]]
    assert rewards == [1.0, 0.0, 0.0, 0.0]  # fixed_rollout's eval samples


def test_load_debug_rollout_data_subsample_keeps_whole_batches(tiny_model_dir, ray_cluster, tmp_path):
    path = tmp_path / "rollout_0.pt"
    samples = [Sample(index=i, group_index=i // 2, tokens=[1, 2, 3 + i], response_length=1, reward=float(i % 2),
                      status=Status.COMPLETED) for i in range(8)]  # fmt: skip
    torch.save({"rollout_id": 0, "samples": [s.to_dict() for s in samples]}, path)
    base = ["--hf-checkpoint", str(tiny_model_dir), "--num-rollout", "1", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2", "--global-batch-size", "2",
            "--load-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt")]  # fmt: skip
    full = RolloutManager(parse_args(base), None).generate(0)
    assert len(ray.get(full.data_refs[0])["tokens"]) == 8
    half = RolloutManager(parse_args(base + ["--load-debug-rollout-data-subsample", "0.6"]), None).generate(0)
    assert ray.get(half.data_refs[0])["sample_indices"] == [0, 1, 2, 3]  # 4.8 samples -> 2 whole groups
    with pytest.raises(ValueError, match="raise it"):
        RolloutManager(parse_args(base + ["--load-debug-rollout-data-subsample", "0.1"]), None).generate(0)


# ---------------------------------------------------------------------------------------------
# --ci-test checks
# ---------------------------------------------------------------------------------------------


def ci_tracker(model_dir, *extra: str) -> Tracker:
    return Tracker(make_args(model_dir, "--ci-test", *extra))


@pytest.mark.reliability("--ci-test run whose first-step ppo_kl is not 0", "the run fails naming the metric")
def test_ci_kl_and_logprob_checks(tiny_model_dir):
    ci_tracker(tiny_model_dir).log(0, {"train/ppo_kl": 0.0, "train/kl_loss": 0.0})
    with pytest.raises(CICheckFailed, match="train/ppo_kl"):
        ci_tracker(tiny_model_dir).log(0, {"train/ppo_kl": 1e-3})
    ci_tracker(tiny_model_dir, "--ci-disable-kl-checker").log(0, {"train/ppo_kl": 1e-3})
    with pytest.raises(CICheckFailed, match="train_rollout_logprob_abs_diff"):
        ci_tracker(tiny_model_dir).log(1, {"train/train_rollout_logprob_abs_diff": 0.2})
    with pytest.raises(ArgumentValidationError, match="--ci-test"):
        make_args(tiny_model_dir, "--ci-metric-checker-key", "eval/toy", "--ci-metric-checker-threshold", "0.5")


@pytest.mark.reliability("--ci-test metric that never reaches its threshold", "the run fails at its end")
def test_ci_metric_checker_needs_one_value_at_the_threshold(tiny_model_dir):
    extra = ("--ci-metric-checker-key", "eval/toy", "--ci-metric-checker-threshold", "0.4")
    passing = ci_tracker(tiny_model_dir, *extra)
    passing.log(0, {"eval/toy": 0.3})
    passing.log(1, {"eval/toy": 0.5})
    passing.finish()
    failing = ci_tracker(tiny_model_dir, *extra)
    failing.log(0, {"eval/toy": 0.3})
    with pytest.raises(CICheckFailed, match="never reached"):
        failing.finish()
    with pytest.raises(CICheckFailed, match="never logged"):
        ci_tracker(tiny_model_dir, *extra).finish()


def test_ci_grad_norm_save_and_compare(tiny_model_dir, tmp_path):
    template = str(tmp_path / "grad_{rollout_id}.json")
    ci_tracker(tiny_model_dir, "--ci-save-grad-norm", template).log(0, {"train/grad_norm": 1.25})
    assert json.loads((tmp_path / "grad_0.json").read_text())["grad_norm"] == 1.25
    ci_tracker(tiny_model_dir, "--ci-load-grad-norm", template).log(0, {"train/grad_norm": 1.2501})
    with pytest.raises(CICheckFailed, match="differs"):
        ci_tracker(tiny_model_dir, "--ci-load-grad-norm", template).log(0, {"train/grad_norm": 1.5})


# ---------------------------------------------------------------------------------------------
# --custom-config-path
# ---------------------------------------------------------------------------------------------


def config_args(tmp_path, text: str, *extra: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return parse_args(
        ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--rollout-batch-size", "4", "--n-samples-per-prompt",
         "2", "--num-rollout", "1", "--lr", "0.5", "--custom-config-path", str(path), *extra]
    )  # fmt: skip


def test_custom_config_sets_flags_by_dest_or_name(tmp_path):
    args = config_args(
        tmp_path,
        "lr: 1.0e-3\n--n-samples-per-prompt: 4\nuse_kl_loss: true\n--rollout-shuffle: true\nkl-loss-coef: '0.25'\n"
        "eval_prompt_data: {toy: /e.jsonl}\nrollout_stop: '###'\ntis_level: token\n",
    )
    assert (args.lr, args.n_samples_per_prompt, args.use_kl_loss, args.rollout_shuffle) == (1e-3, 4, True, True)
    assert args.kl_loss_coef == 0.25 and args.eval_prompt_data == [("toy", "/e.jsonl")]
    assert args.rollout_stop == ["###"] and args.tis_level == "token"  # not a flag: kept for custom functions
    assert args.global_batch_size == 16  # validation saw the YAML's values


@pytest.mark.reliability("--custom-config-path with a misspelt key, a bad choice, a refused flag", "parse-time error")
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("use_kl_los: true\n", "did you mean use_kl_loss"),
        ("kl_loss_type: k9\n", "not one of"),
        ("use_opd: true\n", "on-policy distillation"),
        ("- lr\n", "must hold a mapping"),
        ("lr: [\n", "not valid YAML"),
        ("train_backend: megatron\n", "command line"),
    ],
)
def test_custom_config_errors_name_the_key(tmp_path, text, message):
    with pytest.raises(ArgumentValidationError, match=message):
        config_args(tmp_path, text)
