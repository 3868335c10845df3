"""A router that dies under the rollout manager is named as such, not reported as a bare ConnectionError."""

from __future__ import annotations

import json
import os
import signal

import pytest
import ray

from slime.ray.placement_group import create_placement_groups
from slime.ray.rollout import create_rollout_manager
from slime.utils.arguments import parse_args


@pytest.mark.reliability(
    "SIGKILL of the sglang-router process before a rollout",
    "the rollout fails with 'the router at <url> died (exit code -9; log: <file>)' and --load to resume",
)
def test_dead_router_is_named(ray_cluster, tiny_model_dir, tmp_path):
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a} + 1 =", "label": str(a + 1)}) + "\n" for a in range(4)))
    args = parse_args(
        [
            "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(prompts),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "math",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "1", "--rollout-max-response-len", "4",
            "--num-rollout", "1", "--debug-rollout-only",
        ]
    )  # fmt: skip
    args.server_log_dir = str(tmp_path / "logs")
    slices = create_placement_groups(args)
    manager = create_rollout_manager(args, slices["rollout"])
    try:
        router_pid, router_url = ray.get(
            manager.__ray_call__.remote(lambda self: (self.router.process.pid, self.router.url))
        )
        os.kill(router_pid, signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayTaskError) as raised:
            ray.get(manager.generate.remote(0, 1))
        message = str(raised.value.cause)
        assert f"rollout 0: the router at {router_url} died (exit code -9; log: {tmp_path / 'logs'}" in message
        assert "--load" in message
    finally:
        ray.get(manager.dispose.remote())
        ray.util.remove_placement_group(slices["rollout"].pg)
