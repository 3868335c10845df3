"""Checkpoints of the FSDP trainer: resumable training state and HuggingFace exports.

Layout of `--save DIR` (the critic uses `DIR/critic`):

    DIR/latest_checkpointed_iteration.txt     the last complete rollout id, e.g. "12"
    DIR/iter_0000012/
        model/        torch.distributed.checkpoint (DCP) of the sharded weights
        optim/        DCP of the AdamW state (absent with --no-save-optim)
        scheduler.pt  LR scheduler state
        rng/rank_00000.pt ...   python / numpy / torch (/ CUDA) RNG state of each rank
        meta.json     {"rollout_id", "world_size", "role", "has_optimizer"}

DCP stores tensors with their global shapes, so a checkpoint loads at any world size (RNG states
are restored only for ranks that have one).

Atomicity: every rank writes into `iter_XXXXXXX.tmp-<pid>`; once all are done rank 0 renames it
to `iter_XXXXXXX` (`os.replace`) and only then rewrites the tracker file (tmp + `os.replace`).
A save killed at any point leaves the tracker on the previous complete checkpoint; leftover
`.tmp-` folders are removed by the next save.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from slime.backends.fsdp_utils.model import gather_full_state_dict, reshard, save_hf_folder

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, rollout_id: int) -> str:
    """`root/iter_XXXXXXX` for a rollout id."""
    return os.path.join(root, f"iter_{rollout_id:07d}")


def latest_iteration(root: str | None) -> int | None:
    """The rollout id in `root`'s tracker file, or None when there is no tracker."""
    if not root:
        return None
    tracker = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError as e:
        raise ValueError(f"{tracker} holds {text!r}, not a rollout id; fix or delete the file") from e


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_from_rank0(value):
    """`value` as rank 0 has it, on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_leftovers(root: str) -> None:
    """Folders of interrupted saves (`.tmp-<pid>`) and of replaced checkpoints (`.old-<pid>`)."""
    for name in os.listdir(root):
        if ".tmp-" in name or ".old-" in name:
            path = os.path.join(root, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)


def _publish(tmp_dir: str, final_dir: str) -> None:
    """Move a finished `tmp_dir` to `final_dir`, replacing an older folder of the same name."""
    old = None
    if os.path.exists(final_dir):
        old = f"{final_dir}.old-{os.getpid()}"
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) generator states of this process."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Inverse of `rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: str,
    rollout_id: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    save_optimizer: bool = True,
    role: str = "actor",
) -> str:
    """Write `root/iter_XXXXXXX` atomically and point the tracker at it. A collective: every rank calls it.

    Args:
        root: `--save` (or its `critic` subfolder).
        rollout_id: The rollout just trained.
        model: The sharded model.
        optimizer: Its optimizer.
        scheduler: Its LR scheduler.
        save_optimizer: False with `--no-save-optim`.
        role: Recorded in meta.json.

    Returns:
        The checkpoint folder.
    """
    rank = _rank()
    final_dir = iteration_dir(root, rollout_id)
    tmp_dir = None
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        _remove_leftovers(root)
        tmp_dir = f"{final_dir}.tmp-{os.getpid()}"
        os.makedirs(os.path.join(tmp_dir, "rng"))
    tmp_dir = _broadcast_from_rank0(tmp_dir)
    _barrier()
    reshard(model)

    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(tmp_dir, "model"))
    if save_optimizer:
        dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=os.path.join(tmp_dir, "optim"))
    torch.save(rng_state(), os.path.join(tmp_dir, "rng", f"rank_{rank:05d}.pt"))
    if rank == 0:
        torch.save(scheduler.state_dict(), os.path.join(tmp_dir, "scheduler.pt"))
        meta = {"rollout_id": rollout_id, "world_size": _world_size(), "role": role, "has_optimizer": save_optimizer}
        with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
    _barrier()
    if rank == 0:
        _publish(tmp_dir, final_dir)
        _atomic_write_text(os.path.join(root, TRACKER_FILE), str(rollout_id))
    _barrier()
    return final_dir


def load_checkpoint(
    root: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    load_rng: bool = True,
    rollout_id: int | None = None,
) -> int:
    """Restore the checkpoint the tracker of `root` names (or `rollout_id`). A collective.

    Args:
        root: `--load` (or its `critic` subfolder).
        model: The sharded model to load into.
        optimizer: Loaded unless None (`--no-load-optim`, `--finetune`) or the checkpoint has none.
        scheduler: Loaded unless None.
        load_rng: Restore this rank's RNG state (`--no-load-rng` turns it off).
        rollout_id: Load this iteration instead of the tracker's.

    Returns:
        The rollout id of the checkpoint.
    """
    if rollout_id is None:
        rollout_id = latest_iteration(root)
        if rollout_id is None:
            raise ValueError(f"{root} has no {TRACKER_FILE}; it is not an FSDP checkpoint folder")
    folder = iteration_dir(root, rollout_id)
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)

    reshard(model)
    model_state = {"model": get_model_state_dict(model)}
    dcp.load(model_state, checkpoint_id=os.path.join(folder, "model"))
    set_model_state_dict(model, model_state["model"])
    if optimizer is not None and meta["has_optimizer"]:
        optim_state = {"optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(optim_state, checkpoint_id=os.path.join(folder, "optim"))
        set_optimizer_state_dict(model, optimizer, optim_state["optim"])
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(os.path.join(folder, "scheduler.pt"), weights_only=False))
    rng_file = os.path.join(folder, "rng", f"rank_{_rank():05d}.pt")
    if load_rng and os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    elif load_rng:
        logger.warning("%s has no RNG state for rank %d (saved with %d ranks)", folder, _rank(), meta["world_size"])
    return rollout_id


def read_checkpoint_shards(root: str, model: nn.Module, rollout_id: int | None = None) -> dict[str, torch.Tensor]:
    """This rank's CPU shard of every parameter stored in a checkpoint, without touching the model.

    Used for `--ref-load` pointing at an FSDP checkpoint folder. A collective.

    Args:
        root: Checkpoint root with a tracker file.
        model: The sharded model, giving names, shapes and sharding.
        rollout_id: Iteration to read (default: the tracker's).

    Returns:
        name -> local shard, as `model.local_shards` names them.
    """
    if rollout_id is None:
        rollout_id = latest_iteration(root)
        if rollout_id is None:
            raise ValueError(f"{root} has no {TRACKER_FILE}; point --ref-load at a HF folder or an FSDP checkpoint")
    reshard(model)
    template = {name: param.detach().clone() for name, param in model.named_parameters()}
    dcp.load({"model": template}, checkpoint_id=os.path.join(iteration_dir(root, rollout_id), "model"))
    return {name: (t.to_local() if isinstance(t, DTensor) else t).cpu() for name, t in template.items()}


def save_hf_checkpoint(model: nn.Module, path: str, tokenizer_path: str | None) -> None:
    """Write a HF folder loadable by `AutoModelForCausalLM.from_pretrained` (atomically). A collective.

    Args:
        model: The sharded actor.
        path: Output folder (`--save-hf` with `{rollout_id}` filled in).
        tokenizer_path: Folder of the tokenizer to copy in (`--hf-checkpoint`).
    """
    full_state_dict = gather_full_state_dict(model)
    if _rank() == 0:
        path = os.path.abspath(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp_dir = f"{path}.tmp-{os.getpid()}"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        save_hf_folder(model, full_state_dict, tmp_dir, tokenizer_path)
        _publish(tmp_dir, path)
    _barrier()
