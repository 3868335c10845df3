"""PEFT adapter folders of a LoRA run (`--lora-rank`), for both trainers: write one, export a checkpoint's.

A checkpoint of an adapter run holds `iter_XXXXXXX/adapter/` (adapter_config.json + adapter_model.safetensors, no
pickle), whichever trainer wrote it. `tools/convert_to_hf.py` hands such checkpoints here: their PEFT adapter folder,
or the base with the adapter merged in.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from slime.utils import atomic_dir, run_dir
from slime.utils.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, CHECKPOINT_ADAPTER_DIR
from slime.utils.misc import load_tokenizer


def write_adapter_folder(path: str | Path, tensors: Mapping[str, torch.Tensor], config: dict) -> None:
    """Write a PEFT adapter folder (`peft.PeftModel.from_pretrained` loads it).

    Args:
        path: The folder (created if absent).
        tensors: PEFT saved name -> full tensor (`base_model.model.<HF module>.lora_A.weight`, ...).
        config: The `adapter_config.json` contents.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.cpu().contiguous() for name, tensor in tensors.items()}, str(path / ADAPTER_WEIGHTS_FILE))
    (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2))


def save_adapter_export(
    path: str | Path,
    tensors: Callable[[], Mapping[str, torch.Tensor]],
    config: dict,
    tokenizer_path: str | None,
    trust_remote_code: bool = False,
) -> None:
    """`--save-hf` under `--lora-rank`: a PEFT adapter folder (and the tokenizer), atomically. A collective: every
    training rank calls it; rank 0 writes, and an error there is raised on every rank (`atomic_dir.on_rank0`).

    Args:
        path: The output folder: absent, or an earlier slime export (replaced whole).
        tensors: Gathers the whole adapter (a collective every rank joins; only rank 0's result is written).
        config: The `adapter_config.json` contents.
        tokenizer_path: The folder of the tokenizer to copy in (`--hf-checkpoint`), or None.
        trust_remote_code: `--trust-remote-code`.

    Raises:
        FileExistsError: `path` exists and slime did not write it (checked before any work).
    """
    path = Path(path).absolute()
    atomic_dir.on_rank0(atomic_dir.check_replaceable, path, "--save-hf")
    gathered = tensors()

    def write() -> None:
        staging = atomic_dir.create_staging(path, "hf-export", "--save-hf")
        write_adapter_folder(staging, gathered, config)
        if tokenizer_path is not None:
            load_tokenizer(tokenizer_path, trust_remote_code).save_pretrained(str(staging))
        atomic_dir.publish(staging, path, "hf-export", "--save-hf")

    atomic_dir.on_rank0(write)


def checkpoint_adapter(load: str | Path, step: int | None = None) -> Path | None:
    """The PEFT adapter folder of `load`'s checkpoint `step` (default: the committed one), None if it has none.

    Raises:
        ValueError: `load` has no committed step and none is given.
    """
    if step is None:
        step = run_dir.committed_step(load)
        if step is None:
            raise ValueError(f"--load {load} has no {run_dir.tracker_file(load).name}; pass --ckpt-step")
    adapter = run_dir.iteration_dir(load, step) / CHECKPOINT_ADAPTER_DIR
    return adapter if (adapter / ADAPTER_CONFIG_FILE).is_file() else None


def export_adapter(
    adapter: str | Path, output_dir: str | Path, hf_checkpoint: str | Path, merge: bool, dtype: str | None = None
) -> Path:
    """Write `adapter` to `output_dir` as a PEFT folder (`peft.PeftModel.from_pretrained(base, output_dir)` loads it),
    or with `merge` as a plain HF model: `--hf-checkpoint` with the adapter folded into its weights.

    The folder is written beside `output_dir` and renamed into place; an existing `output_dir` is replaced only if
    slime wrote it.

    Args:
        adapter: A PEFT adapter folder (`checkpoint_adapter`).
        output_dir: Where the export goes.
        hf_checkpoint: The base model the adapter was trained on (its config and tokenizer are copied).
        merge: Fold the adapter into the base weights (`--merge-lora`).
        dtype: Weight dtype of a merged export, e.g. "bfloat16" (default: float32).
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output_dir = Path(output_dir).absolute()
    atomic_dir.check_replaceable(output_dir, "--output-dir")
    staging = atomic_dir.create_staging(output_dir, "hf-export", "--output-dir")
    if merge:
        base = AutoModelForCausalLM.from_pretrained(hf_checkpoint, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
        if dtype is not None:
            merged = merged.to(getattr(torch, dtype))
        merged.save_pretrained(staging, safe_serialization=True)
    else:
        for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
            shutil.copyfile(Path(adapter) / name, staging / name)
    AutoTokenizer.from_pretrained(hf_checkpoint).save_pretrained(staging)
    return atomic_dir.publish(staging, output_dir, "hf-export", "--output-dir")
