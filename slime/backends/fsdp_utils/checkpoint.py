"""Checkpoints of the FSDP trainer: resumable training state and HuggingFace exports.

Layout of `--save DIR` (the critic uses `DIR/critic`; see `slime.utils.run_dir`):

    DIR/latest_checkpointed_iteration.txt     the last complete step, e.g. "12" (written by the driver)
    DIR/iter_0000012/
        model/        torch.distributed.checkpoint (DCP) of the sharded weights (under --lora-rank: the adapter's)
        adapter/      under --lora-rank: the adapter as a PEFT folder (`peft.PeftModel.from_pretrained` loads it);
                      under --multi-lora-n-adapters one PEFT folder per adapter, adapter/slime-policy-<k>/
        optim/        DCP of the AdamW state (absent with --no-save-optim); one entry per adapter's optimizer
        scheduler.pt  LR scheduler state (a list of each adapter's)
        rng/rank_00000.pt ...   python / numpy / torch (/ CUDA) RNG state of each rank
        meta.json     {"rollout_id", "world_size", "role", "has_optimizer"}
        .slime-folder marker: slime wrote this folder, with the SHA-256 of model/ and optim/'s DCP indexes

DCP stores tensors with their global shapes, so a checkpoint loads at any world size (RNG states
are restored only for ranks that have one). Everything but DCP is read with `weights_only=True`; DCP's own
index (a pickle torch reads unrestricted) is checked first by `slime.utils.checkpoint_safety`.

Atomicity: every rank writes into `.iter_XXXXXXX.slime-tmp-<pid>` (`slime.utils.atomic_dir`); once all
are done rank 0 renames it to `iter_XXXXXXX`. The tracker is written last, by the driver once every
part of the step (critic, data source) is written too, or by `save_checkpoint(update_tracker=True)`
when the trainer is used on its own. A save killed at any point leaves the tracker on the previous
complete checkpoint; the next save removes the marked leftovers of killed saves, and nothing else.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from slime.backends.fsdp_utils import lora
from slime.backends.fsdp_utils.model import gather_full_state_dict, reshard, save_hf_folder
from slime.utils import atomic_dir, run_dir
from slime.utils.checkpoint_safety import check_checkpoint
from slime.utils.device import cuda_available
from slime.utils.lora import CHECKPOINT_ADAPTER_DIR, POLICY_ADAPTER, split_by_adapter
from slime.utils.lora_export import write_adapter_folder

logger = logging.getLogger(__name__)

TRACKER_FILE = run_dir.TRACKER_FILE


def iteration_dir(root: str, rollout_id: int) -> str:
    """`root/iter_XXXXXXX` for a rollout id."""
    return str(run_dir.iteration_dir(root, rollout_id))


def latest_iteration(root: str | None) -> int | None:
    """The rollout id the tracker of `root` names (`root/critic` follows `root`'s), or None without one."""
    if not root:
        return None
    tracker = run_dir.tracker_file(root)
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    try:
        return int(text)
    except ValueError as e:
        raise ValueError(f"{tracker} holds {text!r}, not a rollout id; fix or delete the file") from e


def write_tracker(root: str, rollout_id: int) -> None:
    """Point `root`'s tracker at `rollout_id` (one rename): the step becomes the one `--load` resumes."""
    run_dir.commit_step(root, rollout_id)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) generator states of this process, as plain values and tensors.

    numpy's key array is stored as a tensor so that the file loads with `torch.load(weights_only=True)`.
    """
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    numpy_state = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached_gaussian)]
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if cuda_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Inverse of `rng_state`."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and cuda_available():
        torch.cuda.set_rng_state_all(state["cuda"])


Optimizers = torch.optim.Optimizer | list[torch.optim.Optimizer]
Schedulers = torch.optim.lr_scheduler.LRScheduler | list[torch.optim.lr_scheduler.LRScheduler]


def save_checkpoint(
    root: str,
    rollout_id: int,
    model: nn.Module,
    optimizer: Optimizers,
    scheduler: Schedulers,
    save_optimizer: bool = True,
    role: str = "actor",
    update_tracker: bool = True,
    adapter_only: bool = False,
) -> str:
    """Write `root/iter_XXXXXXX` atomically (and point the tracker at it). A collective: every rank calls it.

    Args:
        root: `--save` (or its `critic` subfolder).
        rollout_id: The rollout just trained.
        model: The sharded model.
        optimizer: Its optimizer, or under --multi-lora-n-adapters each adapter's, in adapter order.
        scheduler: Its LR scheduler (each adapter's, likewise).
        save_optimizer: False with `--no-save-optim`.
        role: Recorded in meta.json.
        update_tracker: Write the tracker too. The driver passes False and writes it once every part
            of the step (actor, critic, data source) is on disk.
        adapter_only: `--lora-rank`: keep only the trained adapter (the frozen base is `--hf-checkpoint`), also as
            a PEFT folder `adapter/`.

    Returns:
        The checkpoint folder.

    Raises:
        FileExistsError: `root/iter_XXXXXXX` exists and slime did not write it.
    """
    rank = _rank()
    final_dir = iteration_dir(root, rollout_id)

    def stage() -> str:
        staging = atomic_dir.create_staging(final_dir, "checkpoint", "--save")
        os.makedirs(staging / "rng")
        return str(staging)

    tmp_dir = atomic_dir.on_rank0(stage)
    reshard(model)

    options = _model_state_options(adapter_only)
    dcp.save({"model": get_model_state_dict(model, options=options)}, checkpoint_id=os.path.join(tmp_dir, "model"))
    if adapter_only:
        adapters = split_by_adapter(list(lora.adapter_tensors(model)))  # a collective: every rank gathers
        if rank == 0:
            for adapter, tensors in adapters.items():
                # One adapter: adapter/ itself; several: adapter/<name>/ each (a PEFT folder per adapter).
                folder = os.path.join(tmp_dir, CHECKPOINT_ADAPTER_DIR, "" if adapter == POLICY_ADAPTER else adapter)
                config = lora.adapter_config(model, None if adapter == POLICY_ADAPTER else adapter)
                write_adapter_folder(folder, dict(tensors), config)
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
    if save_optimizer:
        state = {_optim_key(k, len(optimizers)): get_optimizer_state_dict(model, o) for k, o in enumerate(optimizers)}
        dcp.save(state, checkpoint_id=os.path.join(tmp_dir, "optim"))
    torch.save(rng_state(), os.path.join(tmp_dir, "rng", f"rank_{rank:05d}.pt"))
    if rank == 0:
        schedulers = [s.state_dict() for s in scheduler] if isinstance(scheduler, list) else scheduler.state_dict()
        torch.save(schedulers, os.path.join(tmp_dir, "scheduler.pt"))
        meta = {"rollout_id": rollout_id, "world_size": _world_size(), "role": role, "has_optimizer": save_optimizer}
        if isinstance(optimizer, list):
            meta["lora_adapters"] = len(optimizers)
        with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
    _barrier()
    if rank == 0:
        atomic_dir.publish(tmp_dir, final_dir, "checkpoint", "--save")
        if update_tracker:
            write_tracker(root, rollout_id)
    _barrier()
    return final_dir


def load_checkpoint(
    root: str,
    model: nn.Module,
    optimizer: Optimizers | None,
    scheduler: Schedulers | None,
    load_rng: bool = True,
    rollout_id: int | None = None,
    adapter_only: bool = False,
) -> int:
    """Restore the checkpoint the tracker of `root` names (or `rollout_id`). A collective.

    Args:
        root: `--load` (or its `critic` subfolder, which follows `--load`'s tracker).
        model: The sharded model to load into.
        optimizer: Loaded unless None (`--no-load-optim`, `--finetune`) or the checkpoint has none; a list under
            --multi-lora-n-adapters (each adapter's, in adapter order).
        scheduler: Loaded unless None (a list likewise).
        load_rng: Restore this rank's RNG state (`--no-load-rng` turns it off).
        rollout_id: Load this iteration instead of the tracker's.
        adapter_only: `--lora-rank`: the checkpoint holds the adapter only (`save_checkpoint(adapter_only=True)`).

    Returns:
        The rollout id of the checkpoint.

    Raises:
        UntrustedCheckpointError: the folder was not written by slime, or was changed since (checked before torch
            unpickles anything of it).
    """
    if rollout_id is None:
        rollout_id = latest_iteration(root)
        if rollout_id is None:
            raise ValueError(f"{root} has no {TRACKER_FILE}; it is not an FSDP checkpoint folder")
    folder = iteration_dir(root, rollout_id)
    if not os.path.isfile(os.path.join(folder, "meta.json")):
        raise FileNotFoundError(
            f"{folder} (rollout {rollout_id}, named by {run_dir.tracker_file(root)}) is missing or incomplete; "
            "point --load at a folder saved by slime's FSDP trainer"
        )
    check_checkpoint(folder, "--load")
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    # The model's own adapters, not its optimizers: --finetune and --no-load-optim load none of those.
    count = len(getattr(model, "peft_config", None) or [None]) if adapter_only else 1
    if meta.get("lora_adapters", 1) != count:
        raise ValueError(
            f"{folder} holds {meta.get('lora_adapters', 1)} LoRA adapter(s) with their optimizers, but this run trains "
            f"{count} (--multi-lora-n-adapters); resume with the adapter count it was saved with"
        )

    reshard(model)
    options = _model_state_options(adapter_only)
    model_state = {"model": get_model_state_dict(model, options=options)}
    dcp.load(model_state, checkpoint_id=os.path.join(folder, "model"))
    set_model_state_dict(model, model_state["model"], options=options)
    if optimizer is not None and meta["has_optimizer"]:
        optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
        keys = [_optim_key(k, len(optimizers)) for k in range(len(optimizers))]
        optim_state = {key: get_optimizer_state_dict(model, o) for key, o in zip(keys, optimizers, strict=True)}
        dcp.load(optim_state, checkpoint_id=os.path.join(folder, "optim"))
        for key, o in zip(keys, optimizers, strict=True):
            set_optimizer_state_dict(model, o, optim_state[key])
    if scheduler is not None:
        # LambdaLR's state is numbers (its lambda is a function, stored as None).
        saved = torch.load(os.path.join(folder, "scheduler.pt"), weights_only=True)
        schedulers, states = (scheduler, saved) if isinstance(scheduler, list) else ([scheduler], [saved])
        for one, state in zip(schedulers, states, strict=True):
            one.load_state_dict(state)
    rng_file = os.path.join(folder, "rng", f"rank_{_rank():05d}.pt")
    if load_rng and os.path.isfile(rng_file):
        try:
            state = torch.load(rng_file, weights_only=True)
        except pickle.UnpicklingError:
            # Saved by an older slime with numpy arrays inside; unpickling those could run code.
            logger.warning("%s is in an older format that needs full unpickling; RNG state not restored", rng_file)
        else:
            set_rng_state(state)
    elif load_rng:
        logger.warning("%s has no RNG state for rank %d (saved with %d ranks)", folder, _rank(), meta["world_size"])
    return rollout_id


def _optim_key(index: int, count: int) -> str:
    """The optimizer's entry in the optim/ DCP: "optim", or "optim_<k>" for adapter k of several."""
    return "optim" if count == 1 else f"optim_{index}"


def _model_state_options(adapter_only: bool) -> StateDictOptions | None:
    """Under LoRA the model's state is its trainable adapter; the frozen base is neither saved nor loaded."""
    return StateDictOptions(ignore_frozen_params=True, strict=False) if adapter_only else None


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
    folder = iteration_dir(root, rollout_id)
    check_checkpoint(folder, "--ref-load")
    reshard(model)
    template = {name: param.detach().clone() for name, param in model.named_parameters()}
    dcp.load({"model": template}, checkpoint_id=os.path.join(folder, "model"))
    return {name: (t.to_local() if isinstance(t, DTensor) else t).cpu() for name, t in template.items()}


def save_hf_checkpoint(
    model: nn.Module, path: str, tokenizer_path: str | None, trust_remote_code: bool = False
) -> None:
    """Write a HF folder loadable by `AutoModelForCausalLM.from_pretrained` (atomically). A collective.

    The folder is written beside `path` and renamed into place; an existing `path` is replaced only if
    it is an earlier slime export (it holds slime's marker).

    Args:
        model: The sharded actor.
        path: Output folder (`--save-hf` with `{rollout_id}` filled in).
        tokenizer_path: Folder of the tokenizer to copy in (`--hf-checkpoint`).
        trust_remote_code: `--trust-remote-code` (the model's classes may come from its folder).

    Raises:
        FileExistsError: `path` exists and slime did not write it (checked before any work).
    """
    path = os.path.abspath(path)
    atomic_dir.on_rank0(atomic_dir.check_replaceable, path, "--save-hf")
    full_state_dict = gather_full_state_dict(model)
    if _rank() == 0:
        staging = atomic_dir.create_staging(path, "hf-export", "--save-hf")
        save_hf_folder(model, full_state_dict, str(staging), tokenizer_path, trust_remote_code)
        atomic_dir.publish(staging, path, "hf-export", "--save-hf")
    _barrier()
