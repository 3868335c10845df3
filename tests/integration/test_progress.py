"""Rollout progress: the registry in the rollout process, and the bars the driver draws by polling a Ray actor."""

from __future__ import annotations

import io
import json
import re
import threading
import time

import pytest
import ray
from support.engines import cpu_engine_process

from slime.ray.placement_group import PlacementSlice
from slime.ray.progress import get_with_progress
from slime.ray.rollout import create_rollout_manager
from slime.rollout import fully_async_rollout, sglang_rollout
from slime.utils import progress
from slime.utils.arguments import parse_args
from slime.utils.misc import load_function
from slime.utils.progress import ProgressState


@pytest.fixture
def registry():
    """This process's registry with no finished bars left by other tests (rollouts run in-process elsewhere)."""
    progress.snapshot()
    yield progress
    progress.snapshot()


def mine(states, prefix):
    return {s.key: s for s in states if s.key.startswith(prefix)}


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------


def test_snapshots_during_concurrent_updates_see_every_advance(registry):
    threads, per_thread = 4, 3000
    total = threads * per_thread
    for key in ("t/a", "t/b"):
        registry.start(key, key, total, "step")
    go = threading.Barrier(threads + 2)

    def advance_both():
        go.wait()
        for _ in range(per_thread):
            registry.advance("t/a")
            registry.advance("t/b", 2)

    def churn():  # bars starting and finishing while snapshots copy the registry
        go.wait()
        for i in range(2000):
            registry.start(f"t/churn{i}", "churn", 1)
            registry.finish(f"t/churn{i}")

    workers = [threading.Thread(target=advance_both) for _ in range(threads)] + [threading.Thread(target=churn)]
    for w in workers:
        w.start()
    go.wait()
    seen = {"t/a": [], "t/b": []}
    while any(w.is_alive() for w in workers):
        states = mine(registry.snapshot(), "t/")
        for key in seen:
            seen[key].append(states[key].n)
    for w in workers:
        w.join()
    registry.finish("t/a")
    registry.finish("t/b")

    last = mine(registry.snapshot(), "t/")
    assert (last["t/a"].n, last["t/b"].n) == (total, 2 * total)
    assert last["t/a"].done and last["t/a"].total == total and last["t/a"].unit == "step"
    for values in seen.values():
        assert values == sorted(values)
    assert mine(registry.snapshot(), "t/") == {}  # finished bars are read once


def test_finished_bars_are_reported_once_and_capped(registry):
    registry.start("c/run", "running", None)
    registry.advance("c/run", 3)
    for i in range(progress.MAX_UNREAD_FINISHED + 6):
        registry.start(f"c/{i}", f"bar {i}", 1)
        registry.advance(f"c/{i}")
        registry.finish(f"c/{i}")
    registry.advance("c/0")  # finished: ignored
    registry.advance("c/never-started")

    states = list(mine(registry.snapshot(), "c/").values())
    assert [s.key for s in states] == ["c/run"] + [f"c/{i}" for i in range(6, progress.MAX_UNREAD_FINISHED + 6)]
    assert all(s.done and s.n == 1 for s in states[1:])
    assert (states[0].n, states[0].total, states[0].done) == (3, None, False)

    registry.start("c/run", "running again", 5)  # a bar of the same key starts over
    (again,) = mine(registry.snapshot(), "c/").values()
    assert (again.desc, again.n, again.total) == ("running again", 0, 5)

    # The cap drops the bars that finished earliest: a long bar that started first and finishes last is kept.
    for i in range(progress.MAX_UNREAD_FINISHED):
        registry.start(f"c/short{i}", "short", 1)
        registry.finish(f"c/short{i}")
    registry.finish("c/run")
    states = mine(registry.snapshot(), "c/")
    assert states["c/run"].done and "c/short0" not in states and len(states) == progress.MAX_UNREAD_FINISHED
    registry.finish("c/run")


# ---------------------------------------------------------------------------------------------
# What the rollout functions report, against a real CPU engine
# ---------------------------------------------------------------------------------------------


def write_prompts(path, count):
    path.write_text(
        "".join(json.dumps({"input": f"what is {i} + {i}?", "label": str(2 * i)}) + "\n" for i in range(count))
    )
    return path


@pytest.mark.slow
def test_default_and_fully_async_rollouts_report_each_rollout_and_eval_set(tiny_model_dir, tmp_path, registry):
    args = parse_args([
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(write_prompts(tmp_path / "train.jsonl", 8)),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
        "--rm-type", "last_number", "--num-rollout", "2",
        "--eval-prompt-data", "held", str(write_prompts(tmp_path / "eval.jsonl", 3)), "--n-samples-per-eval-prompt", "2",
    ])  # fmt: skip
    seen: list[ProgressState] = []
    stop = threading.Event()

    def watch():  # what the driver would poll
        while not stop.is_set():
            seen.extend(registry.snapshot())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    sglang_rollout._STATE = None  # the default rollout keeps its tokenizer and hooks per process
    with cpu_engine_process(tiny_model_dir) as (_, url):
        host, port = url.removeprefix("http://").split(":")
        args.sglang_router_ip, args.sglang_router_port, args.rollout_engine_urls = host, int(port), [url]
        data_source = load_function(args.data_source_path)(args)
        watcher.start()
        try:
            sglang_rollout.generate_rollout(args, 3, data_source)
            sglang_rollout.generate_rollout(args, 3, data_source, evaluation=True)
            fully_async_rollout.generate_rollout_fully_async(args, 4, data_source)
        finally:
            stop.set()
            watcher.join()
            fully_async_rollout.stop_worker()
            sglang_rollout._STATE = None
    seen.extend(registry.snapshot())

    finished = [s for s in seen if s.done]
    assert finished == [
        ProgressState("rollout 3", "rollout 3", 2, 2, "group", done=True),
        ProgressState("eval 3 held", "eval held", 6, 6, "sample", done=True),  # 3 prompts x 2 samples
        ProgressState("rollout 4", "rollout 4", 2, 2, "group", done=True),
    ]
    for key in ("rollout 3", "eval 3 held", "rollout 4"):
        counts = [s.n for s in seen if s.key == key]
        assert counts == sorted(counts)


# ---------------------------------------------------------------------------------------------
# The driver side, against a real actor with the rollout manager's concurrency-group pattern
# ---------------------------------------------------------------------------------------------


@ray.remote(num_cpus=0, concurrency_groups={"progress": 1})
class Stepper:
    def run(self, steps: int, pause_s: float, fail_at: int | None = None) -> str:
        progress.start("job", "test job", steps, "step")
        try:
            for i in range(steps):
                if i == fail_at:
                    raise ValueError(f"step {i} failed")
                time.sleep(pause_s)
                progress.advance("job")
        finally:
            progress.finish("job")
        return "ran"

    def leave_open(self, n: int, total: int) -> None:
        progress.start("loop", "background", total, "group")
        progress.advance("loop", n)

    @ray.method(concurrency_group="progress")
    def progress(self) -> list[progress.ProgressState]:
        return progress.snapshot()


def drawn_counts(text: str, total: int) -> list[int]:
    return [int(n) for n in re.findall(rf"(\d+)/{total} ", text)]


def test_driver_draws_the_actor_bar_while_its_method_runs(ray_cluster):
    stepper = Stepper.remote()
    out = io.StringIO()
    assert get_with_progress(stepper, stepper.run.remote(10, 0.15), poll_s=0.05, file=out) == "ran"

    text = out.getvalue()
    counts = drawn_counts(text, 10)
    assert "test job" in text and "step" in text
    assert any(0 < n < 10 for n in counts), f"no intermediate progress drawn: {text!r}"
    assert counts == sorted(counts) and counts[-1] == 10
    assert re.search(r"test job: 100%.*10/10 [^\r]*\n$", text), text  # closed (leave=True ends the line) at total
    assert ray.get(stepper.progress.remote()) == []
    ray.kill(stepper)


def test_bars_left_open_by_the_call_are_closed_and_drawn_again_later(ray_cluster):
    stepper = Stepper.remote()
    out = io.StringIO()
    get_with_progress(stepper, stepper.leave_open.remote(3, 5), poll_s=0.05, file=out)
    assert set(drawn_counts(out.getvalue(), 5)) == {3} and out.getvalue().endswith("\n")

    (state,) = ray.get(stepper.progress.remote())
    assert (state.key, state.n, state.done) == ("loop", 3, False)  # still running in the actor
    again = io.StringIO()
    get_with_progress(stepper, stepper.leave_open.remote(4, 5), poll_s=0.05, file=again)
    assert "background" in again.getvalue() and drawn_counts(again.getvalue(), 5)[-1] == 4
    ray.kill(stepper)


@pytest.mark.reliability(
    "the rollout raises while the driver draws its progress bar",
    "the driver re-raises the rollout's exception (as ray.get would); the bar is closed where it stopped",
)
def test_exception_of_the_remote_method_propagates(ray_cluster):
    stepper = Stepper.remote()
    out = io.StringIO()
    with pytest.raises(ValueError, match="step 4 failed"):
        get_with_progress(stepper, stepper.run.remote(10, 0.05, fail_at=4), poll_s=0.05, file=out)
    assert drawn_counts(out.getvalue(), 10)[-1] == 4 and out.getvalue().endswith("\n")
    ray.kill(stepper)


@pytest.mark.reliability(
    "the rollout manager actor dies while the driver polls its progress",
    "the driver raises Ray's actor-died error from the call instead of waiting forever",
)
def test_dead_actor_fails_the_call(ray_cluster):
    stepper = Stepper.remote()
    ref = stepper.run.remote(100, 0.1)
    threading.Timer(1.0, ray.kill, args=(stepper,)).start()
    started = time.monotonic()
    with pytest.raises(ray.exceptions.RayActorError):
        get_with_progress(stepper, ref, poll_s=0.05, file=io.StringIO())
    assert time.monotonic() - started < 30


# ---------------------------------------------------------------------------------------------
# The real RolloutManager
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_rollout_manager_answers_progress_while_busy_and_reports_the_sft_rollout(ray_cluster, tiny_model_dir, tmp_path):
    conversation = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"}]
    data = tmp_path / "sft.jsonl"
    data.write_text(2 * (json.dumps({"messages": conversation}) + "\n"))
    args = parse_args([
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--input-key", "messages",
        "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
        "--rollout-batch-size", "2", "--num-rollout", "1", "--loss-type", "sft_loss",
        "--disable-compute-advantages-and-returns", "--debug-train-only",
    ])  # fmt: skip
    manager = create_rollout_manager(args, PlacementSlice(None))
    try:
        marker, release = tmp_path / "busy", tmp_path / "release"

        def busy(self):  # busy until the test has its answer (at most 30 s)
            marker.write_text("started")
            deadline = time.monotonic() + 30
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.05)

        busy_ref = manager.__ray_call__.remote(busy)
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists()
        # `progress` has its own concurrency group: it answers while the serialized methods are busy.
        assert ray.get(manager.progress.remote(), timeout=3) == []
        assert not ray.wait([busy_ref], timeout=0)[0]
        release.write_text("done")
        ray.get(busy_ref)

        out = io.StringIO()
        batch = get_with_progress(manager, manager.generate.remote(0, 1), poll_s=0.05, file=out)
        (shard,) = ray.get(batch.data_refs)
        assert len(shard["tokens"]) == 2
        assert "sft rollout 0" in out.getvalue() and drawn_counts(out.getvalue(), 2)[-1] == 2
        assert ray.get(manager.progress.remote()) == []  # read once, by the call that drew it
    finally:
        ray.get(manager.dispose.remote())
        ray.kill(manager)
