"""HF -> Megatron weights: load an HF checkpoint (safetensors) into a megatron-core GPT model.

Each rank reads only the HF tensors its parameters need (lazily, from safetensors), converts them to
the full Megatron layout, and keeps its tensor-parallel shard and its experts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from slime.backends.megatron_utils.config import family_from_hf_config, resolve_family
from slime.backends.megatron_utils.megatron_to_hf import model_dims
from slime.backends.megatron_utils.parallel import (
    full_shape,
    global_param_name,
    is_adapter_weight,
    named_weights,
    shard_tensor_parallel,
)
from slime.backends.megatron_utils.weight_mapping import VOCAB, hf_names_for, merge_from_hf

logger = logging.getLogger(__name__)


class HFCheckpoint:
    """Tensors of an HF model folder, read one at a time from its safetensors files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.file_of = {
                name: self.path / file for name, file in json.loads(index.read_text())["weight_map"].items()
            }
        else:
            self.file_of = {}
            for file in sorted(self.path.glob("*.safetensors")):
                with safe_open(file, framework="pt") as handle:
                    self.file_of.update({name: file for name in handle.keys()})
        if not self.file_of:
            raise FileNotFoundError(
                f"no safetensors weights in {self.path}; save the HF model with "
                "model.save_pretrained(path, safe_serialization=True)"
            )

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def keys(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape without reading its data."""
        with safe_open(self.file_of[name], framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise KeyError(f"{name} is not in the HF checkpoint {self.path}")
        with safe_open(self.file_of[name], framework="pt") as handle:
            return handle.get_tensor(name)


def load_hf_weights(
    model: nn.Module | list[nn.Module],
    hf_dir_or_state_dict: str | Path | Mapping[str, torch.Tensor],
    family: str | None = None,
    progress: bool = False,
    exclude: Collection[str] = (),
) -> set[str]:
    """Copy HF weights into a megatron-core GPT model (every rank its own shard and experts).

    Args:
        model: the model chunks (or one chunk), wrapped or not, built with matching flags.
        hf_dir_or_state_dict: an HF model folder (safetensors) or a {HF name: tensor} dict.
        family: model family; default: the `model_type` of the folder's config.json.
        progress: show a progress bar (on the first rank).
        exclude: global Megatron parameter names to leave as they are (e.g. a critic's value head). LoRA
            adapters (lora.py) are always left as they are.

    Returns:
        the HF names that were read (with pipeline/expert parallelism a rank reads only part).

    Raises:
        ValueError: unknown family, a parameter the family does not map, or a shape mismatch.
        KeyError: an HF tensor the model needs is missing from the checkpoint.
    """
    if isinstance(hf_dir_or_state_dict, Mapping):
        source = hf_dir_or_state_dict
        if family is None:
            raise ValueError("pass family= (e.g. 'qwen3') when loading from a state dict")
    else:
        source = HFCheckpoint(hf_dir_or_state_dict)
        family = family or family_from_hf_config(hf_dir_or_state_dict)
    family = resolve_family(family)
    chunks = model if isinstance(model, list) else [model]
    embedding = "model.embed_tokens.weight"
    vocab_rows = source.shape(embedding)[0] if isinstance(source, HFCheckpoint) else source[embedding].shape[0]
    dims = model_dims(chunks, family, vocab_size=vocab_rows)

    used: set[str] = set()

    def fetch(hf_name: str) -> torch.Tensor:
        used.add(hf_name)
        return source[hf_name]

    weights = [(chunk, name, tensor) for chunk in chunks for name, tensor in named_weights(chunk)]
    show = progress and (not dist.is_initialized() or dist.get_rank() == 0)
    for chunk, name, tensor in tqdm(weights, desc="HF -> Megatron", disable=not show):
        global_name = global_param_name(name, chunk)
        if global_name in exclude or is_adapter_weight(name):  # LoRA adapters are not in an HF model
            continue
        hf_names, kind = hf_names_for(global_name, dims)
        padded_rows = full_shape(name, tensor)[0] if kind == VOCAB else None
        full = merge_from_hf([fetch(n) for n in hf_names], kind, dims, rows=padded_rows)
        shard = shard_tensor_parallel(name, full, tensor, chunk)
        with torch.no_grad():
            tensor.copy_(shard.to(dtype=tensor.dtype, device=tensor.device))
    return used


def unused_hf_weights(hf_dir_or_state_dict: str | Path | Mapping[str, torch.Tensor], used: set[str]) -> list[str]:
    """HF tensors nothing was loaded from (e.g. MTP layers of a model built without them)."""
    names = (
        hf_dir_or_state_dict.keys()
        if isinstance(hf_dir_or_state_dict, Mapping)
        else HFCheckpoint(hf_dir_or_state_dict).keys()
    )
    return sorted(set(names) - used)
