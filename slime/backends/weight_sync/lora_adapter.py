"""`--lora-rank`: each update sends only the LoRA adapter, which the engines serve with SGLang's LoRA API.

The adapter is small (rank x (in + out) per targeted layer), so it goes by value in the request body, colocated or
not: training rank 0 posts it to every engine's `/load_lora_adapter_from_tensors` under `POLICY_ADAPTER` (after
`/unload_lora_adapter` of the previous one), then sets the engines' weight version (`/update_weight_version`), the
label rollouts record and staleness counts. The base weights the engines loaded at start never change.
Under `--multi-lora-n-adapters` the tensors name their adapter (`slime.utils.lora.qualified_name`) and each adapter
is replaced under its own name (`slime-policy-<k>`), all before the one version update.

The tensors travel in the form the engine reads: to a colocated CPU engine through a shared-memory segment the
trainer keeps (`stage_named_tensors`; the engine copies the adapter out, so the same segment serves every push);
with `--update-weight-transport disk`, as a PEFT folder under `--update-weight-disk-dir` that each engine loads by
path (`/load_lora_adapter`), the older pushes' folders deleted once the engines hold the new one; otherwise pickled,
in slime's by-value form for the CPU engine (its restricted unpickler, `serialize_named_tensors`) or in torch's own
by-value pickling for SGLang, whose restricted unpickler admits torch's globals only.

There is no broadcast form: SGLang loads adapters only from a path or from tensors in the request, so engines that
take the full weights by broadcast (the default `--update-weight-transport`) get the adapter in the request body.
"""

from __future__ import annotations

import base64
import contextlib
import pickle
import shutil
import uuid
from argparse import Namespace
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from slime.backends.weight_sync.base import WeightTransport, call_engine
from slime.backends.weight_sync.disk import (
    DISK_FLAG,
    FOLDER_KIND,
    DiskTarget,
    drop_older_pushes,
    prepare_disk_target,
)
from slime.utils import atomic_dir
from slime.utils.engine_args import CPU_ENGINE_CONTROL_MAX_BODY_BYTES
from slime.utils.lora import POLICY_ADAPTER, split_by_adapter
from slime.utils.lora_export import write_adapter_folder
from slime.utils.weight_sync import Bucket
from slime.utils.weight_transport import SHARED_MEMORY_FORMAT, serialize_named_tensors, stage_named_tensors

# The segment chunk index of the (first) adapter: its own, beside those of full-weight pushes; adapter k takes -1 - k.
_ADAPTER_CHUNK = -1


class LoraAdapterTransport(WeightTransport):
    """Rank 0 replaces the engines' `POLICY_ADAPTER` with the adapter's tensors (PEFT saved names), or each adapter
    the tensors name under its own name.

    Args:
        config: The adapter's `adapter_config.json` contents (rank, alpha, target modules).
        rollout_backend: "cpu" (slime's CPU engine) or "sglang": how the tensors are pickled.
        shared_memory: Send through a shared-memory segment (a colocated CPU engine) instead of a pickle.
        segment_tag: The job's `segment_tag` for that segment's name (from the engines' API key).
        disk_args: The flags of `--update-weight-transport disk` (`update_weight_disk_dir`, `hf_checkpoint`, ...):
            push PEFT folders there instead.
        disk_target: The target of an earlier connection (reconnecting): go on deleting the folders it pushed.
    """

    adapter = POLICY_ADAPTER

    def __init__(
        self,
        config: dict,
        rollout_backend: str = "cpu",
        shared_memory: bool = False,
        segment_tag: str | None = None,
        disk_args: Namespace | None = None,
        disk_target: DiskTarget | None = None,
    ):
        self.config = config
        self.rollout_backend = rollout_backend
        self.shared_memory = shared_memory
        self.segment_tag = segment_tag
        self.disk_args = disk_args
        self.target = disk_target

    def connect(self, engines: list, engine_urls: list[str], rank: int, world_size: int) -> None:
        """On rank 0 with disk pushes, check `--update-weight-disk-dir` (ValueError naming the flag)."""
        super().connect(engines, engine_urls, rank, world_size)
        if rank == 0 and self.disk_args is not None and self.target is None:
            self.target = prepare_disk_target(self.disk_args)

    def push(self, buckets: Iterable[Bucket], version: str) -> None:
        tensors = [(name, tensor.cpu()) for bucket in buckets for name, tensor in bucket]  # every rank: a collective
        if self.rank != 0:
            return
        if self.target is not None:
            self._push_folders(split_by_adapter(tensors), version)
            return
        payloads = []  # (adapter, payload, load format)
        for k, (adapter, named) in enumerate(split_by_adapter(tensors).items()):
            if self.shared_memory:
                staged = stage_named_tensors(named, _ADAPTER_CHUNK - k, tag=self.segment_tag)
                payloads.append((adapter, staged, SHARED_MEMORY_FORMAT))
            else:
                payloads.append((adapter, self._payload(named), None))

        def replace(engine) -> None:
            for adapter, payload, load_format in payloads:
                # Not loaded yet on a new (or restarted) engine: the unload is refused and the load goes on.
                with contextlib.suppress(Exception):
                    call_engine(engine, "unload_lora_adapter", lora_name=adapter)
                call_engine(
                    engine,
                    "load_lora_adapter_from_tensors",
                    lora_name=adapter,
                    config_dict=self.config,
                    serialized_tensors=payload,
                    load_format=load_format,
                )
            call_engine(engine, "update_weight_version", new_version=version)

        self._on_every_engine(replace)

    def _on_every_engine(self, replace) -> None:
        """`replace(engine)` on every engine at once; raises the first error."""
        with ThreadPoolExecutor(max_workers=max(len(self.engines), 1)) as pool:
            for future in [pool.submit(replace, engine) for engine in self.engines]:
                future.result()

    def _push_folders(self, adapters: dict[str, list], version: str) -> None:
        """Write each adapter as a PEFT folder (staged, then renamed into place), have every engine load it by path,
        then delete the folders of earlier pushes (`drop_older_pushes`)."""
        target = self.target
        folders = {}
        for adapter, named in adapters.items():
            final = target.root / f"weights-v{version}-{adapter}-{uuid.uuid4().hex[:8]}"
            staging = atomic_dir.create_staging(final, FOLDER_KIND, DISK_FLAG)
            try:
                write_adapter_folder(staging, dict(named), self.config)
                folders[adapter] = atomic_dir.publish(staging, final, FOLDER_KIND, DISK_FLAG)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            target.pushed.append(folders[adapter])
        if target.post_write is not None:
            for folder in folders.values():
                target.post_write(str(folder), self.engines)

        def replace(engine) -> None:
            for adapter, folder in folders.items():
                with contextlib.suppress(Exception):  # as in `push`: a new engine has none to unload
                    call_engine(engine, "unload_lora_adapter", lora_name=adapter)
                call_engine(engine, "load_lora_adapter", lora_name=adapter, lora_path=str(folder))
            call_engine(engine, "update_weight_version", new_version=version)

        self._on_every_engine(replace)
        drop_older_pushes(target, list(folders.values()))

    def _payload(self, tensors: list) -> str:
        """`serialized_tensors`: a base64 pickle of the {name: tensor} dict SGLang's endpoint reads."""
        if self.rollout_backend == "sglang":
            return base64.b64encode(pickle.dumps(dict(tensors), protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
        payload = serialize_named_tensors(tensors, as_dict=True)
        if len(payload) > CPU_ENGINE_CONTROL_MAX_BODY_BYTES * 0.99:  # the JSON around it takes a few bytes more
            nbytes = sum(tensor.numel() * tensor.element_size() for _, tensor in tensors)
            raise ValueError(
                f"the LoRA adapter is {nbytes / 2**20:.0f} MiB ({len(payload) / 2**20:.0f} MiB as a request body) "
                f"and the CPU engine takes at most {CPU_ENGINE_CONTROL_MAX_BODY_BYTES / 2**20:.0f} MiB per request: "
                "lower --lora-rank, target fewer modules (--target-modules, --exclude-modules), or push bf16 (--bf16)"
            )
        return payload
