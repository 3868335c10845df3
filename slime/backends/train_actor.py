"""Backend-neutral base of a training rank: process-group setup and the interface the driver calls.

`RayTrainGroup` (slime/ray) creates one such actor per data-parallel rank. Backends (fsdp_utils,
megatron_utils) subclass it and implement `init`, `train`, `save_model`, `update_weights`, `sleep`
and `wake_up`. It lives beside the backends, not in slime/ray, because they build on it and the
layers only import downward (slime.ray -> slime.backends -> slime.utils).
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def get_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now on `host` (used for the rank-0 rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TrainRayActor:
    """One training rank. Construct through Ray; the driver then calls `init` on every rank at once.

    Args:
        world_size: Number of training ranks.
        rank: This rank.
        master_addr: Rendezvous host of rank 0 (None on rank 0 itself: it picks one and reports it).
        master_port: Rendezvous port of rank 0.
    """

    def __init__(self, world_size: int, rank: int, master_addr: str | None, master_port: int | None):
        self.world_size = world_size
        self.rank = rank
        if master_addr is None:
            master_addr = ray.util.get_node_ip_address() if torch.cuda.is_available() else "127.0.0.1"
            master_port = get_free_port(master_addr if master_addr != "127.0.0.1" else "127.0.0.1")
        self.master_addr, self.master_port = master_addr, master_port
        # critic: values from `compute_values`, kept for `train` on the same shard (`_remember_values`)
        self.cached_values: tuple[tuple, list[torch.Tensor]] | None = None
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            WORLD_SIZE=str(world_size),
            RANK=str(rank),
            LOCAL_RANK=str(self._local_rank()),
        )

    def _local_rank(self) -> int:
        gpu_ids = ray.get_gpu_ids() if torch.cuda.is_available() else []
        return int(gpu_ids[0]) if gpu_ids else 0

    def get_master_addr_and_port(self) -> tuple[str, int]:
        return self.master_addr, self.master_port

    def init_process_group(self, args) -> None:
        """Join the training process group (`--distributed-backend`: NCCL on GPU, gloo on CPU by default);
        set this rank's thread budget."""
        if torch.cuda.is_available():
            torch.cuda.set_device(self._local_rank())
        else:
            torch.set_num_threads(args.train_num_threads)
        backend = getattr(args, "distributed_backend", None) or ("nccl" if torch.cuda.is_available() else "gloo")
        if not dist.is_initialized():
            dist.init_process_group(
                backend=backend,
                world_size=self.world_size,
                rank=self.rank,
                timeout=timedelta(minutes=args.distributed_timeout_minutes),
            )

    def _values_for_this_rank(self, values: Any) -> list[torch.Tensor]:
        """The critic's values for this rank's shard: given as every rank's ObjectRefs, one ref, or the values."""
        if isinstance(values, list) and values and isinstance(values[0], ray.ObjectRef):
            values = values[self.rank]
        if isinstance(values, ray.ObjectRef):
            values = ray.get(values)
        return [torch.as_tensor(v, dtype=torch.float32) for v in values]

    # ---- per-rollout steps both backends share ------------------------------------------
    def _check_rollout_log_probs(self, data: dict) -> None:
        """Refuse `--use-rollout-logprobs` / `--use-tis` on data without the engines' log-probs."""
        if (self.args.use_rollout_logprobs or self.args.use_tis) and data.get("rollout_log_probs") is None:
            raise ValueError(
                "--use-rollout-logprobs / --use-tis need the engines' log-probs, but the rollout data has no "
                "rollout_log_probs; make the rollout function record them (return_logprob)"
            )

    def _old_log_probs_unused(self, has_reference: bool) -> bool:
        """Nothing reads the old log-probs: the SFT loss uses the current ones, and without a reference
        no KL term needs them either."""
        return self.args.loss_type == "sft_loss" and not has_reference

    def _remember_values(self, data: dict, values: list[torch.Tensor]) -> None:
        """Critic: keep `compute_values`' values for the `train` call on the same shard."""
        self.cached_values = (_shard_key(data), values)

    def _take_remembered_values(self, data: dict) -> list[torch.Tensor] | None:
        """Critic: the values `compute_values` kept for this shard (None if it was another one); forgets them."""
        cached, self.cached_values = self.cached_values, None
        return cached[1] if cached is not None and cached[0] == _shard_key(data) else None

    # ---- interface implemented by backends ----------------------------------------------
    def init(self, args, role: str, with_ref: bool = False) -> int:
        """Build model and optimizer (loading `--load` if set); return the rollout id to start from."""
        raise NotImplementedError

    def train(self, rollout_id: int, rollout_data_ref: Any) -> dict[str, float]:
        """Train on this rank's share of one rollout; return metrics (same on every rank)."""
        raise NotImplementedError

    def save_model(self, rollout_id: int, update_tracker: bool = True) -> None:
        """Write this role's part of checkpoint `rollout_id`; `update_tracker=False` leaves the tracker to the driver."""
        raise NotImplementedError

    def connect_rollout_engines(self, engines: list, engine_urls: list[str]) -> None:
        """Remember the engines to push weights to (and set up a broadcast group when disaggregated)."""
        raise NotImplementedError

    def update_weights(self) -> None:
        raise NotImplementedError

    def sleep(self) -> None:
        """Free training memory (colocate offload)."""
        raise NotImplementedError

    def wake_up(self) -> None:
        raise NotImplementedError


def _shard_key(data: dict) -> tuple:
    """Identifies a rollout shard: its sample indices and response lengths."""
    return tuple(data.get("sample_indices", [])), tuple(data["response_lengths"])
