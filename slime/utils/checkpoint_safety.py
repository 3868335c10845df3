"""Load only checkpoints slime wrote, and read their index without running code.

torch.distributed.checkpoint (which FSDP checkpoints and Megatron's torch_dist format use) keeps each
checkpoint's index in a `.metadata` file that torch reads with plain `pickle.load`: a crafted one runs any code
the moment `--load` reaches it. So before torch opens a checkpoint folder, slime checks that

1. the folder holds slime's marker (`.slime-folder`, written when slime published the folder),
2. every `.metadata` in it has the SHA-256 the marker recorded then (a file changed or added since fails), and
3. each `.metadata` unpickles with nothing but DCP's own metadata classes (`DCP_METADATA_GLOBALS`), which
   construct plain records and call nothing else.

Check 3 alone is what stops code from running; 1 and 2 refuse folders slime did not write, with a message
saying how to get one it did.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from pathlib import Path

from slime.utils.atomic_dir import DCP_INDEX, MARKER, metadata_files

# (module, name) pairs a DCP `.metadata` pickle may name: the metadata records themselves and the small values
# inside them (shapes, dtypes, layouts, memory formats, paths). torch dtypes are allowed by type, below.
DCP_METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        # megatron-core's torch_dist checkpoints keep each rank's save plan in the index too
        ("torch.distributed.checkpoint.planner", "SavePlan"),
        ("torch.distributed.checkpoint.planner", "WriteItem"),
        ("torch.distributed.checkpoint.planner", "WriteItemType"),
        ("torch.distributed.checkpoint.planner", "TensorWriteData"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
        # Megatron's torch_dist checkpoints: an empty placeholder class it keeps for old checkpoints.
        ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),
    }
)


class UntrustedCheckpointError(ValueError):
    """A checkpoint folder slime did not write, or whose index names code."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS or _is_torch_dtype(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not one of torch.distributed.checkpoint's metadata classes")


def _is_torch_dtype(module: str, name: str) -> bool:
    import torch

    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def read_dcp_metadata(data: bytes):
    """Unpickle a DCP `.metadata` file's bytes, refusing any global outside `DCP_METADATA_GLOBALS` and torch dtypes.

    Raises:
        pickle.UnpicklingError: naming the first global that is not allowed (nothing it names is called).
    """
    return _MetadataUnpickler(io.BytesIO(data)).load()


def check_checkpoint(folder: str | Path, flag: str = "--load", require_marker: bool = True) -> None:
    """Raise UntrustedCheckpointError unless `folder` (one saved iteration) is a checkpoint slime wrote.

    Args:
        folder: The folder torch is about to load (`iter_XXXXXXX`).
        flag: The flag that named it, for the message.
        require_marker: False for the converter to HF, which is how a checkpoint from elsewhere gets in: its
            index must still unpickle with DCP's classes only.
    """
    folder = Path(folder)
    how_to = (
        f"slime loads only checkpoints it wrote itself, because torch unpickles a checkpoint's {DCP_INDEX} and a "
        f"crafted one runs code. Point {flag} at a HuggingFace folder instead (slime loads its safetensors); a Megatron "
        "torch_dist checkpoint from elsewhere converts to one with `python tools/convert_torch_dist_to_hf.py`, which "
        "reads only indexes made of DCP's own classes"
    )
    marker = folder / MARKER
    recorded = None
    if marker.is_file():
        try:
            recorded = json.loads(marker.read_text()).get("metadata_sha256")
        except (ValueError, AttributeError):
            raise UntrustedCheckpointError(f"{flag} {folder}: its {MARKER} is not slime's JSON. {how_to}") from None
    elif require_marker:
        raise UntrustedCheckpointError(f"{flag} {folder} has no {MARKER} marker, so slime did not write it. {how_to}")
    found = metadata_files(folder)  # read once: what is hashed is what is unpickled
    if recorded is not None:  # markers of slime before digests were recorded have none: check 3 still applies
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in found.items()}
        changed = sorted(name for name in digests.keys() | recorded.keys() if digests.get(name) != recorded.get(name))
        if changed:
            raise UntrustedCheckpointError(
                f"{flag} {folder}: {', '.join(changed)} differ from what slime wrote there (SHA-256 in {MARKER}), "
                f"so the checkpoint was changed after it was saved. {how_to}"
            )
    for name, data in found.items():
        try:
            read_dcp_metadata(data)
        except pickle.UnpicklingError as error:
            raise UntrustedCheckpointError(f"{flag} {folder}: {name} refused: {error}. {how_to}") from None
        except Exception as error:  # noqa: BLE001 - a truncated or garbled file; torch would fail on it too
            raise UntrustedCheckpointError(f"{flag} {folder}: {name} is not a readable DCP index ({error})") from None
