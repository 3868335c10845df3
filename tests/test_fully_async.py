"""The fully async rollout: staleness bound, exactly-once bookkeeping, the background loop against a real CPU
engine (weight pushes included), and two train_async.py runs checked from their dumped per-sample versions."""

from __future__ import annotations

import json
import time

import pytest
import torch
from e2e_runs import rollout_rows, run_driver_script, small_run_flags, write_addition_prompts
from engine_process import cpu_engine_process

from slime.rollout import fully_async_rollout, sglang_rollout
from slime.rollout.data_source import RolloutDataSource, RolloutDataSourceWithBuffer
from slime.rollout.fully_async_rollout import (
    FullyAsyncWorker,
    group_staleness,
    save_data_source,
    split_stale,
    staleness_metrics,
)
from slime.utils.arguments import ArgumentValidationError, parse_args
from slime.utils.types import Sample, Status

FULLY_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"


def group(*versions: list[str], index: int = 0) -> list[Sample]:
    """A group with one sample per entry of `versions` (each the sample's weight_versions)."""
    return [Sample(index=index * 10 + i, group_index=index, weight_versions=list(v)) for i, v in enumerate(versions)]


# ---------------------------------------------------------------------------------------------
# Staleness filter (pure)
# ---------------------------------------------------------------------------------------------


def test_group_staleness_counts_pushes_behind_the_oldest_token():
    # Trainer at version 3: the oldest token of [3] + [2, 3] (a partial rollout continued under 3) is from 2.
    assert group_staleness(group(["3"], ["2", "3"]), 3) == 1
    assert group_staleness(group(["1"], ["3"]), 3) == 2
    # A sample that finished after a push the rollout manager has not heard of yet is not behind.
    assert group_staleness(group(["4"]), 3) == 0


def test_split_stale_keeps_groups_within_the_bound_in_order():
    a, b, c = group(["3"], ["3"], index=0), group(["2"], ["3"], index=1), group(["1", "2"], ["3"], index=2)
    assert split_stale([a, b, c], 3, 0) == ([a], [b, c])
    assert split_stale([a, b, c], 3, 1) == ([a, b], [c])
    assert split_stale([c, b, a], 3, 2) == ([c, b, a], [])
    assert split_stale([a, b, c], None, None) == ([a, b, c], [])  # no bound: nothing to judge


def test_staleness_metrics_are_per_sample():
    # Samples 3-3=0, 3-3=0, 3-2=1, 3-3=0 pushes behind.
    metrics = staleness_metrics([group(["3"], ["3"]), group(["2"], ["3"])], 3)
    assert metrics == {"rollout/staleness_mean": 0.25, "rollout/staleness_max": 1.0}
    assert staleness_metrics([group(["default"])], 3) == {}  # not measurable: no metric, no error
    assert staleness_metrics([group(["3"])], None) == {}


@pytest.mark.reliability(
    "--max-weight-staleness with samples whose weight version is missing or not a push number",
    "the rollout fails naming the sample, its versions and meta_info['weight_version']",
)
def test_bound_needs_readable_versions_and_the_trainer_version():
    with pytest.raises(ValueError, match=r"sample 0 carries weight versions \['default'\].*meta_info"):
        split_stale([group(["default"])], 3, 1)
    with pytest.raises(ValueError, match="sample 0 recorded no weight version"):
        split_stale([group([])], 3, 1)
    with pytest.raises(ValueError, match="set_trainer_weight_version"):
        split_stale([group(["1"])], None, 1)


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


def flags(*extra: str) -> list[str]:
    return ["--hf-checkpoint", "/models/tiny", "--prompt-data", "/data/train.jsonl", "--num-rollout", "2",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", *extra]  # fmt: skip


def test_flags_parse_with_the_fully_async_rollout():
    args = parse_args(flags("--rollout-function-path", FULLY_ASYNC, "--max-weight-staleness", "1",
                            "--staleness-policy", "regenerate"))  # fmt: skip
    assert (args.max_weight_staleness, args.staleness_policy) == (1, "regenerate")
    assert parse_args(flags()).max_weight_staleness is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-weight-staleness", "1"], "bounds the fully async rollout"),
        (["--rollout-function-path", FULLY_ASYNC, "--max-weight-staleness", "-1"], "at least 0"),
        (["--rollout-function-path", FULLY_ASYNC, "--staleness-policy", "regenerate"], "needs --max-weight-stal"),
        (["--rollout-function-path", FULLY_ASYNC, "--colocate"], "drop --colocate"),
        (["--rollout-function-path", FULLY_ASYNC, "--keep-old-actor"], "needs --max-weight-staleness 0 or 1"),
    ],
)
@pytest.mark.reliability("a staleness flag that would do nothing, or fully async with --colocate", "parse error")
def test_bad_staleness_flags_fail_at_parse_time(extra, message):
    with pytest.raises(ArgumentValidationError, match=message):
        parse_args(flags(*extra))


# ---------------------------------------------------------------------------------------------
# Exactly-once bookkeeping of saves
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": f"what is {i} + {i}?", "label": str(2 * i)}) + "\n" for i in range(8)))
    return path


def source_args(model_dir, prompt_file, tmp_path, *extra: str):
    return parse_args(
        ["--hf-checkpoint", str(model_dir), "--prompt-data", str(prompt_file), "--num-rollout", "4",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rm-type", "last_number",
         "--rollout-function-path", FULLY_ASYNC, "--save", str(tmp_path / "save"), "--load", str(tmp_path / "save"),
         *extra]
    )  # fmt: skip


def test_save_puts_untrained_groups_into_the_checkpoint_only(tiny_model_dir, prompt_file, tmp_path):
    args = source_args(tiny_model_dir, prompt_file, tmp_path)
    live = RolloutDataSourceWithBuffer(args)
    trained, *untrained = live.get_samples(3)  # group 0 was trained; groups 1 and 2 are still in the pipeline
    save_data_source(live, 5, untrained)
    # The live data source is as it was: the loop still owns groups 1 and 2.
    assert live.buffer == [] and live.sample_group_index == 3
    resumed = RolloutDataSourceWithBuffer(args)
    resumed.load(5)
    assert [g[0].group_index for g in resumed.buffer] == [1, 2]
    # A resumed run draws 1 and 2 again, then goes on with 3: no prompt lost, none twice.
    redrawn = resumed.get_samples(3)
    assert [[s.index for s in g] for g in redrawn] == [[2, 3], [4, 5], [6, 7]]
    assert [g[0].prompt for g in redrawn[:2]] == [g[0].prompt for g in untrained]
    assert trained[0].group_index not in {g[0].group_index for g in redrawn}


@pytest.mark.reliability(
    "the fully async rollout on a data source without a buffer", "fails naming RolloutDataSourceWithBuffer"
)
def test_worker_refuses_a_data_source_without_buffer(tiny_model_dir, prompt_file, tmp_path):
    args = source_args(tiny_model_dir, prompt_file, tmp_path)
    with pytest.raises(ValueError, match="RolloutDataSourceWithBuffer"):
        FullyAsyncWorker(args, RolloutDataSource(args))


# ---------------------------------------------------------------------------------------------
# The background loop against a real CPU engine, weight pushes included
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with cpu_engine_process(tiny_model_dir) as client_and_url:
        yield client_and_url


@pytest.fixture
def loop_args(tiny_model_dir, prompt_file, tmp_path, engine):
    """Arguments factory for a worker talking to the engine directly (the engine speaks /generate itself)."""
    client, url = engine
    client.update_weights_from_disk(str(tiny_model_dir), weight_version="1")
    sglang_rollout._STATE = None  # the default rollout keeps its tokenizer and hooks per process

    def make(*extra: str):
        args = source_args(tiny_model_dir, prompt_file, tmp_path, "--over-sampling-batch-size", "4", *extra)
        host, port = url.removeprefix("http://").split(":")
        args.sglang_router_ip, args.sglang_router_port, args.rollout_engine_urls = host, int(port), [url]
        fully_async_rollout.set_trainer_weight_version(args, 1)
        return args

    yield make
    fully_async_rollout.stop_worker()
    sglang_rollout._STATE = None


def push(client, model_dir, version: int, args) -> None:
    """A weight push as the trainer does it: pause (aborting what is in flight), update, continue; then the
    rollout manager hears of the new version."""
    client.pause_generation()
    client.update_weights_from_disk(str(model_dir), weight_version=str(version))
    client.continue_generation()
    fully_async_rollout.set_trainer_weight_version(args, version)


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def group_indices(groups: list[list[Sample]]) -> list[int]:
    return [g[0].group_index for g in groups]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_loop_hands_out_only_fresh_groups_and_loses_none(tiny_model_dir, engine, loop_args, tmp_path, policy):
    client, _ = engine
    args = loop_args("--rollout-max-response-len", "4", "--max-weight-staleness", "0", "--staleness-policy", policy)
    source = RolloutDataSourceWithBuffer(args)
    first = fully_async_rollout.generate_rollout_fully_async(args, 0, source)
    worker = fully_async_rollout.current_worker()
    # While the trainer trains, the loop fills its pipeline of 4 groups, all finished under version 1.
    wait_for(lambda: len(worker.finished) == 4)
    waiting = group_indices([g.prompts for g in worker.finished])
    push(client, tiny_model_dir, 2, args)
    second = fully_async_rollout.generate_rollout_fully_async(args, 1, source)

    assert all(s.weight_versions == ["1"] for g in first.samples for s in g)
    assert all(s.weight_versions == ["2"] for g in second.samples for s in g)  # bound 0: on-policy
    assert second.metrics["rollout/stale_groups"] == 4  # the whole pipeline, all of it from version 1
    assert second.metrics["rollout/staleness_max"] == 0.0
    assert [s.rollout_id for g in second.samples for s in g] == [1] * 4
    # The stale groups were generated again (dropped: put back and drawn again, buffer first), not lost.
    assert set(group_indices(second.samples)) <= set(waiting)

    # Exactly once: what was trained, plus what the checkpoint holds, is every prompt drawn, none twice.
    with worker.held_draws() as untrained:
        save_data_source(source, 1, untrained)
    saved = torch.load(tmp_path / "save" / "rollout" / "data_source_1.pt", weights_only=True)
    in_checkpoint = [g[0]["group_index"] for g in saved["buffer"]]
    trained = group_indices(first.samples) + group_indices(second.samples)
    assert sorted(trained + in_checkpoint) == list(range(saved["sample_group_index"]))
    assert all(d["response_length"] == 0 and d["status"] == "pending" for g in saved["buffer"] for d in g)


@pytest.mark.slow
def test_push_aborts_requests_which_continue_as_partial_rollouts(tiny_model_dir, engine, loop_args):
    client, _ = engine
    args = loop_args(
        "--rollout-max-response-len", "160", "--partial-rollout", "--mask-offpolicy-in-partial-rollout",
        "--max-weight-staleness", "1", "--staleness-policy", "regenerate",
    )  # fmt: skip
    source = RolloutDataSourceWithBuffer(args)
    fully_async_rollout.generate_rollout_fully_async(args, 0, source)
    worker = fully_async_rollout.current_worker()
    wait_for(lambda: client.get_server_info()["internal_states"][0]["num_running_reqs"] > 0)
    push(client, tiny_model_dir, 2, args)
    groups, aborted = [], 0.0
    for rollout_id in (1, 2):
        output = fully_async_rollout.generate_rollout_fully_async(args, rollout_id, source)
        groups += output.samples
        aborted += output.metrics["rollout/aborted_requests"]
        assert output.metrics["rollout/staleness_max"] <= 1
    assert aborted >= 1
    continued = [s for g in groups for s in g if s.weight_versions == ["1", "2"]]
    assert continued, "a request in flight during the push was continued under the new weights"
    for sample in continued:
        assert sample.status != Status.ABORTED and sample.reward is not None
        assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
        assert len(sample.tokens) == sample.prompt_length + sample.response_length
        # The tokens of the old weights are masked out; the ones of the new weights train.
        old = sample.loss_mask.index(1) if 1 in sample.loss_mask else sample.response_length
        assert sample.loss_mask == [0] * old + [1] * (sample.response_length - old)
    assert worker.error is None


# ---------------------------------------------------------------------------------------------
# train_async.py end to end: bound 0 (drop) and bound 1 (regenerate), checked from the dumped samples
# ---------------------------------------------------------------------------------------------


def dumped_groups(save_dir, rollout_id: int) -> list[Sample]:
    saved = torch.load(save_dir / "rollouts" / f"rollout_{rollout_id}.pt", weights_only=False)
    return [Sample.from_dict(d) for d in saved["samples"]]


def run_fully_async(model_dir, save_dir, *extra: str) -> list[dict]:
    prompt_file = write_addition_prompts(save_dir.parent / f"{save_dir.name}.jsonl")
    result = run_driver_script(
        "train_async.py", *small_run_flags(model_dir, prompt_file, save_dir), "--num-rollout", "3",
        "--rollout-function-path", FULLY_ASYNC, "--over-sampling-batch-size", "4", *extra,
    )  # fmt: skip
    assert result.returncode == 0, f"train_async.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return rollout_rows(save_dir)


def check_bound_and_exactly_once(save_dir, bound: int) -> list[int]:
    """No trained sample is more than `bound` pushes behind the trainer, no prompt group is trained twice."""
    trained = []
    for rollout_id in range(3):
        samples = dumped_groups(save_dir, rollout_id)
        trainer_version = rollout_id + 1  # the first push is version 1, then one push after every step
        for sample in samples:
            assert trainer_version - min(int(v) for v in sample.weight_versions) <= bound, (rollout_id, sample.index)
        trained += sorted({s.group_index for s in samples})
    assert len(trained) == len(set(trained)) == 6
    return trained


@pytest.mark.slow
def test_train_async_bound_0_trains_on_policy(tiny_model_dir, tmp_path):
    rows = run_fully_async(tiny_model_dir, tmp_path / "run", "--max-weight-staleness", "0")
    check_bound_and_exactly_once(tmp_path / "run", 0)
    for rollout_id in range(3):  # bound 0: every token of step k comes from the weights trained at step k
        assert {v for s in dumped_groups(tmp_path / "run", rollout_id) for v in s.weight_versions} == {
            str(rollout_id + 1)
        }
    assert [row["rollout_id"] for row in rows] == [0, 1, 2]
    assert all(row["rollout/staleness_max"] == 0 and "perf/trainer_wait_time" in row for row in rows)
    # What the loop generated while the trainer trained was stale after the push, and was dropped.
    assert sum(row["rollout/stale_groups"] for row in rows) >= 1


@pytest.mark.slow
def test_train_async_bound_1_regenerates_saves_and_evaluates(tiny_model_dir, tmp_path):
    save_dir = tmp_path / "run"
    eval_file = write_addition_prompts(tmp_path / "eval.jsonl", operands=range(1, 3))
    rows = run_fully_async(
        tiny_model_dir, save_dir, "--max-weight-staleness", "1", "--staleness-policy", "regenerate",
        "--partial-rollout", "--save-interval", "3",
        "--eval-prompt-data", "add", str(eval_file), "--eval-interval", "3", "--skip-eval-before-train",
    )  # fmt: skip
    trained = check_bound_and_exactly_once(save_dir, 1)
    assert all(row["rollout/staleness_max"] <= 1 for row in rows)
    assert "eval/add" in rows[-1]  # eval ran beside the generation loop
    # The checkpoint of step 2 holds, put back as fresh prompts, every group drawn but not trained.
    saved = torch.load(save_dir / "rollout" / "data_source_2.pt", weights_only=True)
    in_checkpoint = [g[0]["group_index"] for g in saved["buffer"]]
    assert sorted(trained + in_checkpoint) == list(range(saved["sample_group_index"]))
