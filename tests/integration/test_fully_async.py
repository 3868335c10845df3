"""The fully async rollout: staleness bound, exactly-once bookkeeping, the background loop against a real CPU
engine (weight pushes included), partial rollouts continued under new weights (checked against HF forward passes
of both weights), two train_async.py runs checked from their dumped per-sample versions, and a train_async.py run
killed with SIGKILL and resumed with --load."""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import json
import time

import pytest
import torch
from support.engines import cpu_engine_process
from support.tiny_model import build_tiny_model
from transformers import AutoModelForCausalLM

from slime.rollout import sglang_rollout
from slime.rollout.data_source import RolloutDataSource, RolloutDataSourceWithBuffer
from slime.rollout.fully_async_rollout import (
    FullyAsyncRollout,
    FullyAsyncWorker,
    group_staleness,
    save_data_source,
    split_stale,
    staleness_metrics,
)
from slime.utils.arguments import ArgumentValidationError, parse_args
from slime.utils.run_context import RunContext, expose_to_plugins
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
        FullyAsyncWorker(args, RolloutDataSource(args), sglang_rollout.RolloutState(args), RunContext())


# ---------------------------------------------------------------------------------------------
# The background loop against a real CPU engine, weight pushes included
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with cpu_engine_process(tiny_model_dir) as client_and_url:
        yield client_and_url


class LoopRun:
    """Arguments factory for rollouts talking to the engine directly (it speaks /generate itself), with the run
    context the rollout manager would give them; the test moves the trainer's weight version (`push`)."""

    def __init__(self, model_dir, prompt_file, tmp_path, url: str):
        self.model_dir, self.prompt_file, self.tmp_path = model_dir, prompt_file, tmp_path
        self.trainer_version = 1
        host, port = url.removeprefix("http://").split(":")
        self.context = RunContext(
            router_host=host, router_port=int(port), engine_urls_source=lambda: [url],
            weight_version_source=lambda: self.trainer_version,
        )  # fmt: skip
        self.rollouts: list[FullyAsyncRollout] = []

    def __call__(self, *extra: str):
        args = source_args(self.model_dir, self.prompt_file, self.tmp_path, "--over-sampling-batch-size", "4", *extra)
        expose_to_plugins(args, self.context)  # the generate helpers read the router as user functions do
        sglang_rollout.start_state(args, self.context)  # what the default rollout, called directly, then uses
        return args

    def fully_async(self, args, data_source) -> FullyAsyncRollout:
        """The fully async rollout as the rollout manager starts it (closed at the end of the test)."""
        rollout = FullyAsyncRollout(args, self.context, data_source)
        self.rollouts.append(rollout)
        return rollout

    def weights_updated(self, version: int) -> None:
        """What the rollout manager does after a push: the context gives the new version, the rollouts hear of it."""
        self.trainer_version = version
        for rollout in self.rollouts:
            rollout.on_weights_updated(version)


@pytest.fixture
def loop_args(tiny_model_dir, prompt_file, tmp_path, engine):
    client, url = engine
    idle(client)
    client.update_weights_from_disk(str(tiny_model_dir), weight_version="1")
    sglang_rollout._STATE = None  # the default rollout keeps its tokenizer and hooks per process
    run = LoopRun(tiny_model_dir, prompt_file, tmp_path, url)
    yield run
    for rollout in run.rollouts:
        rollout.close()
    sglang_rollout._STATE = None
    idle(client)


def idle(client) -> None:
    """Abort what the engine still runs for an earlier test, so that the next one sees only its own requests."""
    client.abort_request(abort_all=True)
    wait_for(lambda: client.get_server_info()["internal_states"][0]["num_total_reqs"] == 0)


def push(client, model_dir, version: int, run: LoopRun) -> None:
    """A weight push as the trainer does it: pause (aborting what is in flight), update, continue; then the
    rollout manager hears of the new version."""
    client.pause_generation()
    client.update_weights_from_disk(str(model_dir), weight_version=str(version))
    client.continue_generation()
    run.weights_updated(version)


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def hold_a_request_with_tokens(client, timeout: float = 60.0) -> None:
    """Pause the engine in place at a moment when a request in flight has sampled tokens, so that the push which
    follows aborts a partial response whatever the machine's speed (a request seen generating could otherwise
    finish, or the next one still be in prefill, before the push lands)."""

    def tokens_in_flight() -> int:
        return client.get_server_info()["internal_states"][0]["num_generated_tokens_in_flight"]

    deadline = time.monotonic() + timeout
    while True:
        wait_for(lambda: tokens_in_flight() > 0, timeout=max(deadline - time.monotonic(), 0.0))
        client.pause_generation(mode="in_place")
        if tokens_in_flight() > 0:
            return
        client.continue_generation()  # they finished in between: try again with the next ones


def group_indices(groups: list[list[Sample]]) -> list[int]:
    return [g[0].group_index for g in groups]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_loop_hands_out_only_fresh_groups_and_loses_none(tiny_model_dir, engine, loop_args, tmp_path, policy):
    client, _ = engine
    args = loop_args("--rollout-max-response-len", "4", "--max-weight-staleness", "0", "--staleness-policy", policy)
    source = RolloutDataSourceWithBuffer(args)
    rollout = loop_args.fully_async(args, source)
    first = rollout(args, 0, source)
    worker = rollout.worker
    # While the trainer trains, the loop fills its pipeline of 4 groups, all finished under version 1.
    wait_for(lambda: len(worker.finished) == 4)
    waiting = group_indices([g.prompts for g in worker.finished])
    push(client, tiny_model_dir, 2, loop_args)
    second = rollout(args, 1, source)

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


@pytest.fixture(scope="module")
def new_weights_dir(tmp_path_factory):
    """Other random weights of the tiny model's shape: what the pushes of the partial-rollout tests change to."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama_new_weights"), arch="llama", seed=1)


@functools.cache
def hf_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def forward_log_probs(model_dir, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for every i >= 1 by a plain HF forward pass (temperature 1, as sampled)."""
    with torch.no_grad():
        logits = hf_model(str(model_dir))(torch.tensor([tokens])).logits[0, :-1]
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def check_continued(sample: Sample, old_part: int, old_dir, new_dir, masked: bool) -> None:
    """A partial response of `old_part` tokens under weights "1" (`old_dir`) or "2" (`new_dir`) continued under "2":
    tokens are prompt + old + new part, the old part is masked iff `masked`, and each part's rollout log-probs are a
    forward pass of the weights that sampled it."""
    new_part = sample.response_length - old_part
    old_version = sample.weight_versions[0]
    assert new_part > 0 and sample.weight_versions in (["1", "2"], ["2", "2"]), (old_part, sample.weight_versions)
    assert len(sample.tokens) == sample.prompt_length + old_part + new_part
    assert sample.loss_mask == [0 if masked else 1] * old_part + [1] * new_part
    response = slice(sample.prompt_length - 1, None)  # the entries of forward_log_probs that score response tokens
    old = forward_log_probs(old_dir if old_version == "1" else new_dir, sample.tokens)[response]
    new = forward_log_probs(new_dir, sample.tokens)[response]
    rollout = torch.tensor(sample.rollout_log_probs)
    torch.testing.assert_close(rollout[:old_part], old[:old_part], atol=1e-4, rtol=0)
    torch.testing.assert_close(rollout[old_part:], new[old_part:], atol=1e-4, rtol=0)
    if old_version == "1":
        assert (old[old_part:] - new[old_part:]).abs().max() > 1e-2  # the two weights tell the parts apart


@pytest.mark.slow
@pytest.mark.parametrize("masked", [True, False], ids=["mask-offpolicy", "no-mask"])
def test_aborted_group_goes_back_with_its_partial_response_and_continues_under_new_weights(
    tiny_model_dir, new_weights_dir, engine, loop_args, masked
):
    """The default rollout with --partial-rollout: a push aborts the groups in flight; they go back to the data
    source with their partial responses (and into its checkpoint), and the next rollout continues them."""
    client, _ = engine
    mask = ["--mask-offpolicy-in-partial-rollout"] if masked else []
    args = loop_args("--rollout-max-response-len", "160", "--over-sampling-batch-size", "2", "--partial-rollout", *mask)
    source = RolloutDataSourceWithBuffer(args)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(sglang_rollout.generate_rollout, args, 0, source)
        # Abort once a token is out, not merely once a request is admitted: a request aborted before its first
        # token goes back with an empty response and proves nothing about continuing a partial one.
        hold_a_request_with_tokens(client)
        push(client, new_weights_dir, 2, loop_args)
        first = first.result(timeout=120)
    # The aborted groups went back, others took their places: every group drawn is in one place, none in two.
    back = group_indices(source.buffer)
    assert sorted(group_indices(first.samples) + back) == list(range(source.sample_group_index))
    partial = {s.index: copy.deepcopy(s) for g in source.buffer for s in g if s.response_length > 0}
    # The push aborted the held request's partial response under "1"; requests admitted after it and aborted when the
    # rollout had its groups come back with a partial response under "2".
    assert any(s.weight_versions == ["1"] for s in partial.values()), "the push aborted no partial response"
    for s in partial.values():
        assert (s.status, s.reward) == (Status.PENDING, None) and s.weight_versions in (["1"], ["2"])
        assert len(s.tokens) == s.prompt_length + s.response_length == s.prompt_length + len(s.rollout_log_probs)

    # The checkpoint holds the partial responses; a run resumed from it continues them.
    source.save(0)
    resumed = RolloutDataSourceWithBuffer(args)
    resumed.load(0)
    assert [[s.to_dict() for s in g] for g in resumed.buffer] == [[s.to_dict() for s in g] for g in source.buffer]
    second = sglang_rollout.generate_rollout(args, 1, resumed)
    assert set(back) <= set(group_indices(second.samples)) and resumed.buffer == []  # served first
    for sample in (s for g in second.samples for s in g):
        old = partial.get(sample.index)
        if old is None:  # finished, or aborted before its first token: generated again from the prompt
            assert sample.weight_versions[-1:] == ["2"] and sample.loss_mask == [1] * sample.response_length
            continue
        assert sample.tokens[: len(old.tokens)] == old.tokens  # prompt + old part, then the new part
        assert sample.rollout_log_probs[: old.response_length] == old.rollout_log_probs
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED) and sample.reward is not None
        assert sample.weight_versions[0] == old.weight_versions[0]
        check_continued(sample, old.response_length, tiny_model_dir, new_weights_dir, masked)


@pytest.mark.slow
def test_push_aborts_requests_which_continue_as_partial_rollouts(tiny_model_dir, new_weights_dir, engine, loop_args):
    """The fully async loop: a push aborts the requests in flight, which continue at once under the new weights."""
    client, _ = engine
    args = loop_args(
        "--rollout-max-response-len", "160", "--partial-rollout", "--mask-offpolicy-in-partial-rollout",
        "--max-weight-staleness", "1", "--staleness-policy", "regenerate",
    )  # fmt: skip
    source = RolloutDataSourceWithBuffer(args)
    rollout = loop_args.fully_async(args, source)
    rollout(args, 0, source)
    worker = rollout.worker
    hold_a_request_with_tokens(client)  # a request with tokens of the old weights when the push comes
    push(client, new_weights_dir, 2, loop_args)
    groups, aborted = [], 0.0

    def continued_samples() -> list[Sample]:
        return [s for g in groups for s in g if s.weight_versions == ["1", "2"]]

    # The held request's group comes out once all its samples are done: groups started after the push can finish
    # first, more so on a loaded machine, so the rollouts go on (at most 4) until it is out.
    for rollout_id in range(1, 5):
        output = rollout(args, rollout_id, source)
        groups += output.samples
        aborted += output.metrics["rollout/aborted_requests"]
        assert output.metrics["rollout/staleness_max"] <= 1
        if rollout_id >= 2 and any(s.loss_mask[0] == 0 for s in continued_samples()):
            break
    assert aborted >= 1
    continued = continued_samples()
    for sample in continued:
        assert sample.status != Status.ABORTED and sample.reward is not None
        # The tokens of the old weights are masked out (none when the push came before the first token).
        old_part = sample.loss_mask.index(1)
        check_continued(sample, old_part, tiny_model_dir, new_weights_dir, masked=True)
    assert any(s.loss_mask[0] == 0 for s in continued), "a request in flight during the push was continued"
    assert worker.error is None


# ---------------------------------------------------------------------------------------------
# train_async.py end to end: bound 0 (drop) and bound 1 (regenerate), checked from the dumped samples
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# kill -9 of the driver, then --load: every prompt trained exactly once
# ---------------------------------------------------------------------------------------------


# Ray's dashboard and runtime-env agents exit on their own once their GCS reconnect timeout (60 s) is over, idle
# meanwhile (checked by hand: gone 62 s after the kill); waiting for them would only make the test slower.
