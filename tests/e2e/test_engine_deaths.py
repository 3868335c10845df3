"""Engines and the router SIGKILLed at each moment of a step, with --use-fault-tolerance: the driver's own steps
(slime.ray.driver's weight push, the rollout manager's offload, onload, eval and generate) on one colocated run in
this process (two trainer ranks, each sharing its slot with a CPU engine, behind the real router, on the session's Ray
cluster; the weights go through shared memory). A whole run built by the driver's own `create_training_run`, killed
and recovered five times: the e2e tier, with the other fault-injection runs."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch

from slime.backends.sglang_utils.router import list_workers
from slime.ray.driver import create_training_run, update_weights
from slime.utils.arguments import parse_args
from slime.utils.types import Sample, Status


@pytest.fixture(scope="module")
def run(ray_cluster, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_deaths")
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a in range(1, 5) for b in range(1, 5)]
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:4]))
    args = parse_args(
        [
            "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(root / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rm-type", "last_number",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
            "--eval-prompt-data", "held_out", str(root / "eval.jsonl"), "--num-rollout", "8",
            "--save-debug-rollout-data", str(root / "dumps" / "rollout_{rollout_id}.pt"),
            "--colocate", "--actor-num-gpus-per-node", "2",  # two trainer ranks, each sharing its slot with an engine
            "--update-weight-buffer-size", str(64 * 1024),  # many buckets: a longer push
            "--use-fault-tolerance", "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "20",
        ]
    )  # fmt: skip
    args.server_log_dir = str(root / "logs")
    run = create_training_run(args)
    yield run
    ray.get(run.rollout_manager.dispose.remote())
    run.actor.dispose()


def engine_server(run, index: int) -> tuple[int, Path]:
    """(pid, log file) of engine `index`'s server process."""
    engine = ray.get(run.rollout_manager.get_engines.remote())[index]
    pid, log = ray.get(engine.__ray_call__.remote(lambda self: (self.process.pid, str(self.log_path))))
    return pid, Path(log)


def kill(pid: int) -> None:
    process = psutil.Process(pid)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(psutil.NoSuchProcess):
        while process.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        raise psutil.NoSuchProcess(pid)


def restarts(run) -> int:
    pool = ray.get(run.rollout_manager.__ray_call__.remote(lambda self: self.engine_pool.num_restarts))
    return int(pool)


def assert_serving_with_the_trainers_weights(run, metrics: dict) -> None:
    """Both engines in the router, the restarted one checked against the trainer, and a whole rollout from them."""
    assert metrics["rollout/restarted_engine_weight_gap"] <= 1e-4, metrics
    urls = ray.get(run.rollout_manager.get_engine_urls.remote())
    router_url = ray.get(run.rollout_manager.__ray_call__.remote(lambda self: self.engine_pool.router.url))
    assert sorted(w["url"] for w in list_workers(router_url)) == sorted(urls)
    batch = ray.get(run.rollout_manager.generate.remote(0, 1))
    assert batch.metrics["rollout/engine_restarts"] == restarts(run)
    data = ray.get(batch.data_refs[0])
    assert len(data["tokens"]) == 4  # 2 prompts x 2 samples: nothing lost, nothing doubled


@pytest.mark.reliability(
    "SIGKILL of an engine after a rollout's last request, before the weight push (--use-fault-tolerance)",
    "the push finds it dead, restarts it, pushes to every engine again, checks the restarted one against the "
    "trainer (<= 1e-4) and puts it back into the router",
)
def test_engine_killed_before_the_push_is_replaced_by_the_push(run):
    before = restarts(run)
    kill(engine_server(run, 0)[0])
    metrics = update_weights(run)
    assert restarts(run) == before + 1
    assert_serving_with_the_trainers_weights(run, metrics)


@pytest.mark.reliability(
    "SIGKILL of an engine during the weight push (--use-fault-tolerance)",
    "the push fails on it, it is restarted and the push is made again to every engine; checked against the trainer",
)
def test_engine_killed_during_the_push_is_replaced_and_pushed_to(run):
    before = restarts(run)
    pid, log = engine_server(run, 0)
    seen = log.stat().st_size
    killed = threading.Event()

    def kill_at_the_first_bucket() -> None:
        # The engine logs each control call: kill it once the trainer has started sending it buckets.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if "/update_weights_from_tensor" in log.read_text()[seen:]:
                kill(pid)
                killed.set()
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_at_the_first_bucket)
    killer.start()
    metrics = update_weights(run)
    killer.join()
    assert killed.is_set()
    tail = log.read_text()[seen:]
    assert "/pause_generation" in tail and "/continue_generation" not in tail  # it died inside the push
    assert restarts(run) == before + 1
    assert_serving_with_the_trainers_weights(run, metrics)


@pytest.mark.reliability(
    "SIGKILL of an engine while the engines' memory is released or resumed (offload/onload, --use-fault-tolerance)",
    "it is restarted and released (or resumed) like the others; the next push gives it the weights and checks it",
)
def test_engine_killed_around_offload_and_onload_is_replaced(run):
    before = restarts(run)
    kill(engine_server(run, 0)[0])
    offloaded = ray.get(run.rollout_manager.offload.remote())
    assert offloaded["perf/engine_weight_memory_offloaded_gb"] == 0  # the replacement was released too
    kill(engine_server(run, 1)[0])
    onloaded = ray.get(run.rollout_manager.onload.remote())
    assert onloaded["perf/engine_weight_memory_onloaded_gb"] > 0
    assert restarts(run) == before + 2
    assert_serving_with_the_trainers_weights(run, update_weights(run))


@pytest.mark.reliability(
    "SIGKILL of an engine during eval (--use-fault-tolerance)",
    "its requests are retried on the other engine, every eval prompt is scored; it is restarted meanwhile",
)
def test_engine_killed_during_eval_leaves_every_eval_prompt_scored(run):
    before = restarts(run)
    kill(engine_server(run, 1)[0])
    metrics = ray.get(run.rollout_manager.eval.remote(7))
    assert 0 <= metrics["eval/held_out"] <= 1
    dump = Path(run.args.save_debug_rollout_data.format(rollout_id=7))
    samples = [Sample.from_dict(d) for d in torch.load(dump.with_name(f"eval_held_out_{dump.name}"))["samples"]]
    assert len(samples) == 4 and all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in samples)
    assert restarts(run) == before + 1
    assert_serving_with_the_trainers_weights(run, update_weights(run))


@pytest.mark.reliability(
    "SIGKILL of the sglang-router (--use-fault-tolerance)",
    "it is launched again on its address with the serving engines (and their API key); requests in flight are "
    "retried; rollout/router_restarts counts it",
)
def test_killed_router_is_restarted_on_its_address(run):
    manager = run.rollout_manager
    router_pid, router_url = ray.get(
        manager.__ray_call__.remote(lambda self: (self.engine_pool.router.process.pid, self.engine_pool.router.url))
    )
    kill(router_pid)
    batch = ray.get(manager.generate.remote(0, 1))
    assert batch.metrics["rollout/router_restarts"] >= 1
    assert len(ray.get(batch.data_refs[0])["tokens"]) == 4
    new_pid, new_url = ray.get(
        manager.__ray_call__.remote(lambda self: (self.engine_pool.router.process.pid, self.engine_pool.router.url))
    )
    assert new_url == router_url and new_pid != router_pid
    assert sorted(w["url"] for w in list_workers(router_url)) == sorted(ray.get(manager.get_engine_urls.remote()))
