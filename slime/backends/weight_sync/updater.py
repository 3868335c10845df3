"""One weight update around any transport: pause, flush, push, resume; the weight version; the engine check."""

from __future__ import annotations

import contextlib
from argparse import Namespace
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from slime.backends.weight_sync.base import WeightTransport, call_engine, call_engines, resume_quietly
from slime.backends.weight_sync.broadcast import BroadcastTransport
from slime.backends.weight_sync.cuda_ipc import CudaIpcTransport
from slime.backends.weight_sync.disk import DiskTransport
from slime.backends.weight_sync.lora_adapter import LoraAdapterTransport
from slime.backends.weight_sync.shared_memory import SharedMemoryTransport
from slime.utils.engine_args import engine_api_key
from slime.utils.fp8 import quantize_named_tensors, rollout_fp8_block
from slime.utils.weight_sync import Bucket, weight_check_tolerance
from slime.utils.weight_transport import segment_tag, shared_memory_available

# Seconds a flush after the pause waits for the requests the pause aborted to leave the engine (SGLang ends them a
# scheduler step after the pause answers; upstream slime retries its flush for up to a minute).
FLUSH_WAIT_S = 60.0


def choose_transport(
    args: Namespace,
    device: torch.device,
    previous: WeightTransport | None = None,
    adapter_config: dict | None = None,
) -> WeightTransport:
    """The transport for this trainer's engines, from its flags (call it once per connection).

    - `--colocate`: tensors on this host; through sealed shared-memory segments when the trainer's tensors are on CPU
      (`SharedMemoryTransport`), as CUDA IPC handles otherwise or where there is no memfd (`CudaIpcTransport`).
    - `--lora-rank`: only the adapter (`LoraAdapterTransport`): through a shared-memory segment to a colocated CPU
      engine, as a PEFT folder with `--update-weight-transport disk`, in the request body otherwise.
    - `--update-weight-transport disk`: a HF folder the engines load (`DiskTransport`); with `--update-weight-mode
      delta`, after the first push, a folder of only the changes that the engines apply to their weights.
    - otherwise: a broadcast from training rank 0 over a group with every engine rank (`BroadcastTransport`).

    A transport of the full weights gets `fp8_block` when the engines run FP8 (`rollout_fp8_block`).

    Args:
        args: Needs `colocate`, `rollout_num_gpus_per_engine`, `rollout_backend`, `update_weight_transport`
            (disk: `update_weight_disk_dir`, `update_weight_disk_keep_files`, `hf_checkpoint`).
        device: The training device (where the buckets' tensors are).
        previous: The transport this rank used before (reconnecting to restarted engines): disk sync goes on
            deleting the folders pushed through it.
        adapter_config: The trained LoRA adapter's PEFT config (`--lora-rank`), None when the full weights train.
    """
    if adapter_config is not None:
        colocated_cpu = args.colocate and args.rollout_backend == "cpu" and shared_memory_available()
        tag = segment_tag(engine_api_key(args))
        disk = args.update_weight_transport == "disk" and not args.colocate
        return LoraAdapterTransport(
            adapter_config,
            args.rollout_backend,
            shared_memory=colocated_cpu,
            segment_tag=tag,
            disk_args=args if disk else None,
            disk_target=previous.target if disk and isinstance(previous, LoraAdapterTransport) else None,
        )
    transport = _full_weight_transport(args, device, previous)
    transport.fp8_block = rollout_fp8_block(args)
    return transport


def _full_weight_transport(args: Namespace, device: torch.device, previous: WeightTransport | None) -> WeightTransport:
    gpus_per_engine = args.rollout_num_gpus_per_engine
    if args.colocate:
        if device.type != "cuda" and shared_memory_available():
            return SharedMemoryTransport(gpus_per_engine, segment_tag(engine_api_key(args)))
        return CudaIpcTransport(gpus_per_engine)
    if args.update_weight_transport == "disk":
        return DiskTransport(args, target=previous.target if isinstance(previous, DiskTransport) else None)
    return BroadcastTransport(gpus_per_engine, args.rollout_backend)


class WeightUpdater:
    """What one training rank keeps to update the engines: the engines, one transport, the weight version.

    Every training rank calls `connect` and `push` at once.

    Args:
        rank: This training rank.
        check_first_push: `--check-weight-update-equal`: the trainer compares the engines with itself
            (`check`) after the first push.
    """

    def __init__(self, rank: int, check_first_push: bool = False):
        self.rank = rank
        self.check_first_push = check_first_push
        self.engines: list = []
        self.transport: WeightTransport | None = None
        self.version = 0  # of the last push; the engines report it as a string

    @property
    def every_rank_sends(self) -> bool:
        """Whether every rank needs the whole model's buckets (see `WeightTransport.every_rank_sends`)."""
        return self.transport is not None and self.transport.every_rank_sends

    def connect(self, transport: WeightTransport, engines: list, engine_urls: list[str]) -> None:
        """Connect `transport` (from `choose_transport`) to `engines`; may be called again for restarted engines.

        The transport of an earlier connection is left as it is: its engines may be gone, and a group whose
        peers are gone may not close cleanly.

        Args:
            transport: An unconnected transport.
            engines: Engine handles (RolloutEngine Ray actors, or clients with the same methods).
            engine_urls: Their base URLs.

        Raises:
            ValueError: disk, on rank 0: `--update-weight-disk-dir` is not writable or `--hf-checkpoint` not a folder.
        """
        transport.connect(engines, engine_urls, self.rank, dist.get_world_size())
        self.engines, self.transport = list(engines), transport

    def push(self, buckets: Iterable[Bucket]) -> int:
        """Send the buckets to every engine under the next weight version, the engines paused meanwhile.

        Rank 0 pauses and flushes the engines and resumes them afterwards (after a failure too, every engine
        that still answers). A streaming transport sends while the buckets are produced: every rank waits for
        the pause before it sends and for the others after. A staged one (disk) first writes them out while the
        engines still serve; rank 0 then pauses them only to load, and an error is raised after the other
        ranks have caught up.

        Args:
            buckets: HF-named tensor buckets of the current weights (lazy: produced while sending); quantized to
                FP8 here, before any transport sees them, when the engines run FP8 (`WeightTransport.fp8_block`).

        Returns:
            The new weight version.
        """
        version = str(self.version + 1)
        block = self.transport.fp8_block
        if block is not None:
            buckets = (quantize_named_tensors(bucket, block) for bucket in buckets)
        if self.transport.staged:
            error = None
            try:
                staged = self.transport.stage(buckets, version)
                if self.rank == 0:
                    with self._engines_paused():
                        self.transport.push(staged, version)
            except Exception as e:  # noqa: BLE001 - raised after the barrier, which the other ranks wait in
                error = e
            dist.barrier()
            if error is not None:
                raise error
        else:
            self._stream(iter(buckets), version)
        self.version += 1
        return self.version

    def _stream(self, buckets: Iterator[Bucket], version: str) -> None:
        """Rank 0 pauses the engines, every rank sends (or only produces) the buckets, rank 0 resumes them.

        A failure on rank 0 (an engine that died before or during the push) is raised only after every rank has
        produced the rest of the buckets and met the closing barrier: the buckets are collectives of all ranks, so a
        rank that stopped early would leave the others blocked in one.
        """
        error: BaseException | None = None
        if self.rank == 0:
            try:
                call_engines(self.engines, "pause_generation")
                call_engines(self.engines, "flush_cache", wait=FLUSH_WAIT_S)
            except Exception as e:  # noqa: BLE001 - raised after the closing barrier
                error = e
        dist.barrier()
        try:
            if error is None:
                self.transport.push(buckets, version)
        except Exception as e:  # noqa: BLE001 - raised after the closing barrier
            error = e
        for _ in buckets:  # what a failed push left unproduced
            pass
        dist.barrier()
        if self.rank == 0:
            if error is None:
                call_engines(self.engines, "continue_generation")
            else:
                resume_quietly(self.engines)
        if error is not None:
            raise error

    @contextlib.contextmanager
    def _engines_paused(self) -> Iterator[None]:
        try:
            call_engines(self.engines, "pause_generation")
            call_engines(self.engines, "flush_cache", wait=FLUSH_WAIT_S)
            yield
        except BaseException:
            resume_quietly(self.engines)
            raise
        call_engines(self.engines, "continue_generation")

    def check(self, probe: list[int], trainer_log_probs: torch.Tensor) -> float:
        """Largest gap between each engine's log-probs of `probe` and the trainer's (`check_engines_match`), under
        the adapter the transport pushes, if any."""
        adapter = self.transport.adapter if self.transport is not None else None
        return check_engines_match(self.engines, probe, trainer_log_probs, self.version, adapter)

    def close(self) -> None:
        """Close the transport; a later `push` needs a new `connect`."""
        if self.transport is not None:
            self.transport.close()
        self.engines, self.transport = [], None


def engine_prompt_log_probs(engine: Any, input_ids: list[int], lora_path: str | None = None) -> list[float]:
    """Log-probs the engine assigns to `input_ids[1:]` given their prefixes (temperature 1, no generation), under
    the loaded adapter `lora_path` if given."""
    payload = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if lora_path is not None:
        payload["lora_path"] = lora_path
    response = call_engine(engine, "generate", payload=payload)
    entries = response["meta_info"]["input_token_logprobs"]
    return [entry[0] for entry in entries[1:]]


def check_engines_match(
    engines: list, probe: list[int], trainer_log_probs: torch.Tensor, weight_version: Any, lora_path: str | None = None
) -> float:
    """Largest gap between each engine's log-probs of `probe` and the trainer's.

    Raises:
        RuntimeError: when the gap exceeds `weight_check_tolerance()`, naming the update.
    """
    tolerance = weight_check_tolerance()
    gap = 0.0
    for engine in engines:
        engine_log_probs = torch.tensor(engine_prompt_log_probs(engine, probe, lora_path), dtype=torch.float32)
        gap = max(gap, float((engine_log_probs - trainer_log_probs).abs().max()))
    if gap > tolerance:
        raise RuntimeError(
            f"engine weights differ from the trainer's after update {weight_version}: probe log-probs "
            f"differ by up to {gap:.3g} (tolerance {tolerance}); check parameter names and dtypes"
        )
    return gap
