"""Two CPU engines behind the real sglang-router on a local Ray cluster, driven by the RolloutManager."""

import json
import os
import signal
import time
from argparse import Namespace
from pathlib import Path

import pytest
import ray
import torch

from slime.ray.placement_group import PlacementSlice, create_placement_groups
from slime.ray.rollout import RolloutManager, create_rollout_manager
from slime.utils.arguments import parse_args
from slime.utils.engine_args import ENGINE_API_KEY_ENV, engine_api_key
from slime.utils.http_utils import HTTPRequestError, bearer_headers, get_json, post_json
from slime.utils.types import Sample

PROMPTS = [f"What is {a} + {b}?" for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (4, 4), (6, 6), (8, 8)]]


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_data")
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": p, "label": str(eval(p[8:-1]))}) + "\n" for p in PROMPTS))
    held_out = root / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": p, "label": "0"}) + "\n" for p in PROMPTS[:3]))
    return train, held_out


def rollout_args(model_dir, train_file, eval_file, *extra):
    return parse_args(
        [
            "--hf-checkpoint", str(model_dir),
            "--prompt-data", str(train_file), "--input-key", "prompt", "--label-key", "label",
            "--apply-chat-template", "--rm-type", "math",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2",
            "--rollout-max-response-len", "8",
            "--eval-prompt-data", "held_out", str(eval_file),
            "--debug-rollout-only",
            *extra,
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def manager(ray_cluster, tiny_model_dir, data_files):
    args = rollout_args(tiny_model_dir, *data_files, "--rollout-num-gpus", "2")
    slices = create_placement_groups(args)
    manager = create_rollout_manager(args, slices["rollout"])
    yield manager
    ray.get(manager.dispose.remote())
    ray.util.remove_placement_group(slices["rollout"].pg)


def test_two_engines_registered_behind_the_router(manager):
    urls = ray.get(manager.get_engine_urls.remote())
    assert len(urls) == 2 and len(set(urls)) == 2
    assert ray.get(manager.get_num_rollout.remote()) == (2, 4)


@pytest.mark.reliability(
    "a local user reaching the engines of a job started without --sglang-api-key",
    "401: slime starts its engines with a random per-job key, passed by the environment (not in /proc/<pid>/cmdline)",
)
def test_engines_slime_starts_require_the_jobs_own_key(manager):
    urls = ray.get(manager.get_engine_urls.remote())
    headers = engine_headers(manager)
    key = headers["Authorization"].removeprefix("Bearer ")
    assert len(key) >= 32
    for url in urls:
        with pytest.raises(HTTPRequestError) as refused:
            get_json(f"{url}/get_model_info", max_retries=0)
        assert refused.value.status == 401
        assert get_json(f"{url}/get_model_info", headers=headers)["is_generation"] is True
    engines = ray.get(manager.get_engines.remote())
    for pid in ray.get([engine.__ray_call__.remote(lambda self: self.process.pid) for engine in engines]):
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            assert key.encode() not in cmdline.read()  # every local user can read this file
        with open(f"/proc/{pid}/environ", "rb") as environ:
            assert f"{ENGINE_API_KEY_ENV}={key}".encode() in environ.read().split(b"\0")


def test_rollout_returns_well_formed_train_data(manager):
    batch = ray.get(manager.generate.remote(0, 1))
    assert batch.data_refs == []  # --debug-rollout-only: no trainer, no shards
    assert 0.0 <= batch.metrics["rollout/reward"] <= 1.0
    assert batch.metrics["rollout/response_length"] > 0

    # Same rollout converted for a 2-rank trainer.
    args = ray.get(manager.__ray_call__.remote(lambda self: self.args))
    args.debug_rollout_only = False
    ray.get(manager.__ray_call__.remote(lambda self: setattr(self.args, "debug_rollout_only", False)))
    try:
        batch = ray.get(manager.generate.remote(1, 2))
    finally:
        ray.get(manager.__ray_call__.remote(lambda self: setattr(self.args, "debug_rollout_only", True)))
    shards = ray.get(batch.data_refs)
    assert len(shards) == 2
    for shard in shards:
        assert len(shard["tokens"]) == 2  # global batch 4 over 2 ranks
        for tokens, length, mask, log_probs in zip(
            shard["tokens"], shard["response_lengths"], shard["loss_masks"], shard["rollout_log_probs"], strict=True
        ):
            assert 0 < length <= 8 and len(tokens) > length
            assert len(mask) == length and len(log_probs) == length
            assert all(lp <= 0.0 for lp in log_probs)
    indices = sorted(i for shard in shards for i in shard["sample_indices"])
    assert len(indices) == 4 and len(set(indices)) == 4
    # GRPO rewards are centred within each prompt group.
    rewards = {i: r for shard in shards for i, r in zip(shard["sample_indices"], shard["rewards"], strict=True)}
    for first in indices[::2]:
        assert rewards[first] + rewards[first + 1] == pytest.approx(0.0, abs=1e-5)


def test_eval_reports_each_named_set(manager):
    metrics = ray.get(manager.eval.remote(0))
    assert set(metrics) == {"eval/held_out", "eval/held_out/truncated"}
    assert metrics["eval/held_out"] == 0.0  # labels are "0": no sum here is 0


# Before any test that kills one of the shared engines.
def test_eval_config_gives_each_dataset_its_own_settings(manager, data_files, tmp_path):
    _, held_out = data_files
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"eval:\n  datasets:\n"
        f"    - {{name: one, path: {held_out}, n_samples_per_eval_prompt: 1, max_response_len: 2}}\n"
        f"    - {{name: three, path: {held_out}, n_samples_per_eval_prompt: 3, metadata_overrides: {{tag: x}},\n"
        f"       custom_rm_path: support.rewards.alternating_reward}}\n"
    )

    tests_dir = str(Path(__file__).resolve().parents[1])

    def run_eval(self):
        import sys

        sys.path.insert(0, tests_dir)  # the set's reward is the tests' support.rewards, as a user's PYTHONPATH has it
        self.args.eval_config = str(config)
        try:
            output = self.eval_fn(self.args, 0, self.data_source, evaluation=True)
            return {
                name: [(s.response_length, s.metadata.get("tag"), s.index, s.reward) for s in r["samples"]]
                for name, r in output.data.items()
            }
        finally:
            self.args.eval_config = None

    samples = ray.get(manager.__ray_call__.remote(run_eval))
    assert len(samples["one"]) == 3 and all(length <= 2 and tag is None for length, tag, _, _ in samples["one"])
    assert len(samples["three"]) == 9 and all(tag == "x" for _, tag, _, _ in samples["three"])
    # The set's own custom_rm_path scored it; the other set kept the run's reward (labels "0": no sum here is 0).
    assert all(reward == float(index % 2) for _, _, index, reward in samples["three"])
    assert all(reward == 0.0 for _, _, _, reward in samples["one"])


def test_saved_rollout_can_be_read_back(manager, tmp_path):
    path = str(tmp_path / "rollout_{rollout_id}.pt")
    ray.get(manager.__ray_call__.remote(lambda self: setattr(self.args, "save_debug_rollout_data", path)))
    try:
        ray.get(manager.generate.remote(5, 1))
    finally:
        ray.get(manager.__ray_call__.remote(lambda self: setattr(self.args, "save_debug_rollout_data", None)))
    saved = torch.load(path.format(rollout_id=5), weights_only=False)
    samples = [Sample.from_dict(d) for d in saved["samples"]]
    assert len(samples) == 4 and all(s.rollout_id == 5 for s in samples)


def engine_headers(manager) -> dict[str, str]:
    """The Authorization header of the key the manager's engines were started with (a fresh one per job).

    Ask before the manager is busy: the call queues behind a running `generate`, which waits on paused engines.
    """
    return bearer_headers(engine_api_key(ray.get(manager.__ray_call__.remote(lambda self: self.args))))


def engines_paused(urls, headers):
    """Pause the engines in place (requests queue, nothing runs) until the block ends."""

    class Paused:
        def __enter__(self):
            for url in urls:
                post_json(f"{url}/pause_generation", {"mode": "in_place"}, headers=headers)

        def __exit__(self, *exc):
            for url in urls:
                post_json(f"{url}/continue_generation", {}, headers=headers)

    return Paused()


def num_waiting(urls, headers) -> int:
    infos = [get_json(f"{url}/get_server_info", headers=headers) for url in urls]
    return sum(info["internal_states"][0]["num_waiting_reqs"] for info in infos)


def abort_all(urls, headers) -> None:
    for url in urls:
        post_json(f"{url}/abort_request", {"abort_all": True}, headers=headers)


@pytest.mark.reliability(
    "the engines abort a rollout's requests on their own", "those groups go back to the data source; others fill in"
)
def test_groups_the_engines_abort_go_back_and_others_take_their_place(manager, tmp_path):
    urls, headers = ray.get(manager.get_engine_urls.remote()), engine_headers(manager)
    path = str(tmp_path / "rollout_{rollout_id}.pt")
    ray.get(manager.__ray_call__.remote(lambda self: setattr(self.args, "save_debug_rollout_data", path)))
    try:
        with engines_paused(urls, headers):
            batch_ref = manager.generate.remote(7, 1)
            deadline = time.time() + 60
            while num_waiting(urls, headers) < 4:  # the first 2 groups x 2 samples, queued on the paused engines
                assert time.time() < deadline, "the rollout's requests never reached the engines"
                time.sleep(0.05)
            abort_all(urls, headers)
        metrics = ray.get(batch_ref).metrics
    finally:
        ray.get(manager.__ray_call__.remote(lambda self: setattr(self.args, "save_debug_rollout_data", None)))
    assert metrics["rollout/aborted_groups"] >= 2
    samples = [Sample.from_dict(d) for d in torch.load(path.format(rollout_id=7), weights_only=False)["samples"]]
    assert len(samples) == 4
    assert all(s.status.value != "aborted" and s.reward is not None and s.response_length > 0 for s in samples)
    assert metrics["rollout/unfinished"] == 0.0
    buffer = ray.get(manager.__ray_call__.remote(lambda self: self.data_source.buffer))
    assert len(buffer) == metrics["rollout/returned_groups"] >= metrics["rollout/aborted_groups"]
    assert all(s.status.value == "pending" and s.response_length == 0 for group in buffer for s in group)


@pytest.mark.reliability(
    "the engines abort every request of a rollout", "RuntimeError after 4 x --over-sampling-batch-size groups"
)
def test_engines_that_abort_everything_stop_the_rollout(manager):
    urls, headers = ray.get(manager.get_engine_urls.remote()), engine_headers(manager)
    with engines_paused(urls, headers):
        batch_ref = manager.generate.remote(8, 1)
        # Nothing can finish while paused; keep aborting what queues until the rollout gives up.
        ready = []
        deadline = time.time() + 120
        while not ready:
            assert time.time() < deadline, "the rollout kept drawing groups"
            abort_all(urls, headers)
            ready, _ = ray.wait([batch_ref], timeout=0.05)
    with pytest.raises(ray.exceptions.RayTaskError, match=r"rollout 8: the engines aborted 9 prompt groups"):
        ray.get(batch_ref)
    # Every group drawn went back to the data source: none is lost.
    buffer = ray.get(manager.__ray_call__.remote(lambda self: self.data_source.buffer))
    assert len(buffer) >= 9


@pytest.fixture
def filtering_manager(manager, tiny_model_dir, data_files):
    """A second rollout manager, in this process, that over-samples, filters groups and continues partial ones, on
    one of `manager`'s engines (as external engines, with their key: it starts none of its own)."""
    url = ray.get(manager.get_engine_urls.remote())[1]
    key = engine_api_key(ray.get(manager.__ray_call__.remote(lambda self: self.args)))
    args = rollout_args(
        tiny_model_dir, *data_files,
        "--rm-type", "random", "--over-sampling-batch-size", "4", "--partial-rollout",
        "--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
        "--rollout-external-engine-addrs", url, "--sglang-api-key", key,
    )  # fmt: skip
    filtering = RolloutManager(args, PlacementSlice(None))
    yield filtering
    filtering.dispose()


def test_over_sampling_keeps_only_groups_that_pass_the_filter(filtering_manager, tmp_path):
    path = str(tmp_path / "rollout_{rollout_id}.pt")
    filtering_manager.args.save_debug_rollout_data = path
    metrics = filtering_manager.generate(0, 1).metrics
    samples = [Sample.from_dict(d) for d in torch.load(path.format(rollout_id=0), weights_only=False)["samples"]]
    assert len(samples) == 4  # rollout batch 2 groups x 2 samples
    for first, second in zip(samples[::2], samples[1::2], strict=True):
        assert first.group_index == second.group_index and first.reward != second.reward
    # Every drawn group is accounted for: kept, dropped by the filter, or handed back to the data source.
    assert (
        metrics["rollout/submitted_groups"]
        == 2 + metrics["rollout/dropped_groups"] + metrics["rollout/returned_groups"]
    )
    buffer = filtering_manager.data_source.buffer
    assert len(buffer) == metrics["rollout/returned_groups"]
    for group in buffer:
        for s in group:
            assert s.reward is None and s.status.value == "pending"
            assert s.response_length == 0 or len(s.tokens) > s.response_length  # fresh, or a partial to continue


@pytest.mark.reliability(
    "an engine dead at a step of the driver (generation, eval, weight push, offload, onload) without "
    "--use-fault-tolerance",
    "the step fails with one line naming the engine, its URL and --use-fault-tolerance",
)
def test_killed_engine_is_reported_by_url_at_every_step(manager):
    """Last but one in the module: it kills one engine."""
    engines = ray.get(manager.get_engines.remote())
    urls = ray.get(manager.get_engine_urls.remote())
    ray.get(engines[0].shutdown.remote())
    ray.get(manager.__ray_call__.remote(lambda self: setattr(self.args, "rollout_batch_size", 4)))
    named = f"inference engine 0 ({urls[0]}) died; pass --use-fault-tolerance"
    for step in (lambda: manager.generate.remote(6, 1), lambda: manager.eval.remote(6)):
        with pytest.raises(ray.exceptions.RayTaskError) as excinfo:
            ray.get(step())
        assert named in str(excinfo.value)
    # What the driver asks after a weight push failed, and the engines' memory release and resume.
    for step in (
        lambda: manager.replace_dead_engines.remote("updating the engines' weights"),
        lambda: manager.offload.remote(),
        lambda: manager.onload.remote(),
    ):
        with pytest.raises(ray.exceptions.RayTaskError) as excinfo:
            ray.get(step())
        message = str(excinfo.value.cause)
        assert named in message and len(message.splitlines()) == 1, message


@pytest.mark.reliability(
    "SIGKILL of the sglang-router process, without --use-fault-tolerance",
    "the rollout fails with 'the router at <url> died (exit code -9; log: <file>)', --use-fault-tolerance and "
    "--load to go on",
)
def test_dead_router_is_named(manager):
    """Last in the module: it kills the router."""
    router_pid, router_url, log = ray.get(
        manager.__ray_call__.remote(
            lambda self: (
                self.engine_pool.router.process.pid,
                self.engine_pool.router.url,
                self.engine_pool.router.log_path,
            )
        )
    )
    os.kill(router_pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        ray.get(manager.generate.remote(7, 1))
    message = str(raised.value.cause)
    assert f"the router at {router_url} died (exit code -9; log: {log})" in message
    assert "--use-fault-tolerance" in message and "--load" in message


def test_unused_groups_go_back_fresh_or_partial():
    from slime.rollout.sglang_rollout import _return_to_data_source
    from slime.utils.types import Status

    class Collector:
        def add_samples(self, groups):
            self.groups = groups

    aborted = Sample(index=0, prompt="p", tokens=[1, 2, 3], response="x", response_length=1, status=Status.ABORTED)
    finished = Sample(index=1, prompt="p", tokens=[1, 2, 4], response="y", response_length=1, reward=1.0,
                      status=Status.COMPLETED)  # fmt: skip
    for partial, expected_lengths in ((True, [1, 0]), (False, [0, 0])):
        collector = Collector()
        groups = [[Sample.from_dict(aborted.to_dict()), Sample.from_dict(finished.to_dict())]]
        assert (
            _return_to_data_source(Namespace(partial_rollout=partial, n_samples_per_prompt=2), groups, collector) == 1
        )
        returned = collector.groups[0]
        assert [s.response_length for s in returned] == expected_lengths
        assert all(s.status == Status.PENDING and s.reward is None for s in returned)
        assert returned[1].tokens == [] and returned[1].prompt == "p"
