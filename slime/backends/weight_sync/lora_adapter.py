"""`--lora-rank`: each update sends only the LoRA adapter, which the engines serve with SGLang's LoRA API.

The adapter is small (rank x (in + out) per targeted layer), so it goes by value in the request body, whatever the
layout: training rank 0 posts it to every engine's `/load_lora_adapter_from_tensors` under `POLICY_ADAPTER` (after
`/unload_lora_adapter` of the previous one), then sets the engines' weight version (`/update_weight_version`), the
label rollouts record and staleness counts. The base weights the engines loaded at start never change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from slime.backends.weight_sync.base import WeightTransport, call_engine
from slime.utils.lora import POLICY_ADAPTER
from slime.utils.weight_sync import Bucket
from slime.utils.weight_transport import serialize_named_tensors


class LoraAdapterTransport(WeightTransport):
    """Rank 0 replaces the engines' `POLICY_ADAPTER` with the adapter's tensors (PEFT saved names).

    Args:
        config: The adapter's `adapter_config.json` contents (rank, alpha, target modules).
    """

    adapter = POLICY_ADAPTER

    def __init__(self, config: dict):
        self.config = config

    def push(self, buckets: Iterable[Bucket], version: str) -> None:
        tensors = [(name, tensor.cpu()) for bucket in buckets for name, tensor in bucket]  # every rank: a collective
        if self.rank != 0:
            return
        payload = serialize_named_tensors(tensors, as_dict=True)  # the {name: tensor} dict SGLang reads

        def replace(engine) -> None:
            # Not loaded yet on a new (or restarted) engine: the unload is refused and the load goes on.
            with contextlib.suppress(Exception):
                call_engine(engine, "unload_lora_adapter", lora_name=self.adapter)
            call_engine(
                engine,
                "load_lora_adapter_from_tensors",
                lora_name=self.adapter,
                config_dict=self.config,
                serialized_tensors=payload,
            )
            call_engine(engine, "update_weight_version", new_version=version)

        with ThreadPoolExecutor(max_workers=max(len(self.engines), 1)) as pool:
            for future in [pool.submit(replace, engine) for engine in self.engines]:
                future.result()
