"""The trainer side of a weight update: push the trainer's HF-named weight buckets to the inference engines.

Shared by both training backends; each backend only says how it produces its full HF-named tensors
(FSDP: `DTensor.full_tensor()`; Megatron: tensor-parallel gather + `megatron_to_hf`) and may import this
package; it imports no backend. `choose_transport` picks one transport per connection from the flags, one
class per transport (`base.WeightTransport`: connect, stage, push, close):

- `SharedMemoryTransport` (`--colocate`, CPU tensors): sealed memory segments the engine's weights live in.
- `CudaIpcTransport` (`--colocate`, CUDA tensors or no memfd): CUDA IPC handles, one payload per engine TP rank.
- `BroadcastTransport` (disaggregated): training rank 0 broadcasts over a group with every engine rank.
- `DiskTransport` (`--update-weight-transport disk`): a HF folder under `--update-weight-disk-dir`.
- `LoraAdapterTransport` (`--lora-rank`): only the adapter, by value, to SGLang's LoRA endpoints.

`WeightUpdater` wraps any of them in the pause / flush / push / resume step, counts weight versions and
compares the engines with the trainer (`--check-weight-update-equal`). The pure parts stay in slime.utils:
bucketing (`slime.utils.weight_sync`) and the wire formats both sides share (`slime.utils.weight_transport`).
"""

from slime.backends.weight_sync.base import WeightTransport, call_engine, call_engines
from slime.backends.weight_sync.broadcast import BroadcastTransport
from slime.backends.weight_sync.cuda_ipc import CudaIpcTransport
from slime.backends.weight_sync.disk import DiskTransport
from slime.backends.weight_sync.lora_adapter import LoraAdapterTransport
from slime.backends.weight_sync.shared_memory import SharedMemoryTransport
from slime.backends.weight_sync.updater import (
    WeightUpdater,
    check_engines_match,
    choose_transport,
    engine_prompt_log_probs,
)

__all__ = [
    "BroadcastTransport",
    "CudaIpcTransport",
    "DiskTransport",
    "LoraAdapterTransport",
    "SharedMemoryTransport",
    "WeightTransport",
    "WeightUpdater",
    "call_engine",
    "call_engines",
    "check_engines_match",
    "choose_transport",
    "engine_prompt_log_probs",
]
