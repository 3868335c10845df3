"""Megatron checkpoints (dist_checkpointing, torch_dist format) and HF folders, for --load/--ref-load/--save.

Layout (Megatron-LM's convention, so Megatron-LM tools read it):

    ROOT/latest_checkpointed_iteration.txt    the last complete iteration, e.g. "12" (or "release")
    ROOT/iter_0000012/                        torch_dist files: .metadata, *.distcp, common.pt, ...

The state dict is {"model": ...} ("model0", "model1", ... with virtual pipelining), plus "optimizer",
"opt_param_scheduler", "iteration", "checkpoint_version" and any `extra_state` given. Weights are
stored by their global, layer-stacked keys, so they load under any TP/PP/EP layout; the distributed
optimizer's state reloads under another data-parallel size but needs the same TP/PP.

LoRA (`--lora-rank`, lora.py): the frozen base is `--hf-checkpoint` and is not saved. The state dict holds
{"adapter": ...} instead of the model, keyed by PEFT saved names (`lora.adapter_sharded_state_dict`), and the
optimizer state of the adapter; beside it, `iter_XXXXXXX/adapter/` is the adapter as a PEFT folder (what
`tools/convert_to_hf.py` exports and `--lora-adapter-path` warm-starts from).

Atomicity: all ranks write `.iter_XXXXXXX.slime-tmp-<pid>` (`slime.utils.atomic_dir`); then rank 0 renames
it to `iter_XXXXXXX`, replacing an earlier one only if slime wrote it, and only after that rewrites the
tracker file. In a training run the driver writes the tracker once every part of the step (critic, data
source) is written; `DIR/critic` follows `DIR`'s tracker. A crash leaves the previous checkpoint in use.
HF folders (`save_hf_checkpoint`) are written the same way, so an earlier export never leaves stale
shards behind.

`load_checkpoint` also takes an HF model folder (one with config.json and no tracker): its weights are
converted on the fly (`hf_to_megatron.load_hf_weights`) and the iteration is 0.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from slime.backends.megatron_utils import lora
from slime.backends.megatron_utils.config import load_hf_config
from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights
from slime.backends.megatron_utils.megatron_to_hf import megatron_state_to_hf
from slime.backends.megatron_utils.unwrap import unwrap_model
from slime.utils import atomic_dir, run_dir
from slime.utils.checkpoint_safety import check_checkpoint
from slime.utils.lora import ADAPTER_CONFIG_FILE, CHECKPOINT_ADAPTER_DIR
from slime.utils.lora_export import write_adapter_folder

logger = logging.getLogger(__name__)

TRACKER_FILE = run_dir.TRACKER_FILE
CHECKPOINT_VERSION = 3.0
_ITER_DIR = re.compile(r"iter_(\d{7})")
_MODEL_KEY = re.compile(r"model\d*")
_ADAPTER_KEY = "adapter"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
# Distributed-optimizer state as Megatron-LM saves it by default: it reloads under another DP size but
# the same TP/PP (weights reload under any layout). megatron-core 0.16 cannot load its
# "fully_reshardable" format without TE/Apex (it drops Adam's `step`).
_SHARDING_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def checkpoint_dir(root: str | Path, iteration: int | str) -> Path:
    """`root/iter_XXXXXXX` (or `root/release` for the iteration "release")."""
    return Path(root) / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")


def read_tracker(root: str | Path) -> int | str | None:
    """The iteration in `root/latest_checkpointed_iteration.txt`: an int, "release", or None without one.

    `DIR/critic` follows `DIR`'s tracker (actor and critic of a run load the same step).
    """
    tracker = run_dir.tracker_file(root)
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == "release":
        return text
    if not text.isdigit():
        raise ValueError(f"{tracker} holds {text!r}; expected an iteration number or 'release'")
    return int(text)


def is_hf_checkpoint(path: str | Path) -> bool:
    """An HF model folder: config.json, and none of Megatron's tracker file or torch_dist metadata."""
    path = Path(path)
    return (
        (path / "config.json").is_file()
        and not (path / TRACKER_FILE).is_file()
        and not (path / atomic_dir.DCP_INDEX).exists()
    )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _chunks(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    return model if isinstance(model, list) else [model]


def _model_state_key(index: int, count: int) -> str:
    return "model" if count == 1 else f"model{index}"


def _sharded_state_dict(
    model: list[nn.Module], optimizer=None, is_loading: bool = False, adapter_only: bool = False
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if adapter_only:  # LoRA: the adapters, each with its own TP split (Megatron's own dict gets them wrong)
        state[_ADAPTER_KEY] = lora.adapter_sharded_state_dict(model)
    else:
        for index, chunk in enumerate(model):
            state[_model_state_key(index, len(model))] = unwrap_model(chunk).sharded_state_dict()
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=_SHARDING_METADATA)
    return state


def _ensure_optimizer_state(optimizer) -> None:
    """Give a never-stepped distributed optimizer its Adam state before loading into it.

    Without TE/Apex, megatron-core reads Adam's `step` from the existing state while building the
    state dict to load into, and a fresh optimizer has none; Megatron's own zero-gradient dummy step
    creates it (the loaded checkpoint then overwrites weights and state).
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(inner, "_init_optimizer_states_with_dummy_values") and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer) -> None:
    """Give each parameter its own Adam `step` tensor again after a load, holding the saved step.

    Without TE/Apex, megatron-core's distributed optimizer loads one `step` tensor into the state of
    every parameter; torch's Adam then increments that shared tensor once per parameter per step and
    the bias correction goes wrong from the first step after resuming. Its parameter-state load then
    copies over that tensor the step of the state it loads into (`_ensure_optimizer_state`'s dummy
    step), so the saved step is taken from the param groups, where megatron-core keeps it.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        for group in getattr(torch_optimizer, "param_groups", []):
            saved = group.get("step")
            for param in group["params"]:
                state = torch_optimizer.state.get(param, {})
                if torch.is_tensor(state.get("step")):
                    step = state["step"] if saved is None else torch.tensor(float(saved))
                    state["step"] = step.to(state["step"]).clone()


def write_tracker(root: str | Path, iteration: int) -> None:
    """Point `root`'s tracker at `iteration` (one rename): the step becomes the one `--load` resumes."""
    run_dir.commit_step(root, iteration)


def save_checkpoint(
    root: str | Path,
    iteration: int,
    model: nn.Module | list[nn.Module],
    optimizer=None,
    opt_param_scheduler=None,
    extra_state: dict[str, Any] | None = None,
    update_tracker: bool = True,
    adapter_config: dict | None = None,
    adapter_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save a torch_dist checkpoint to `root/iter_XXXXXXX` atomically (and update the tracker file).

    A collective: every rank calls it (each writes its own shards).

    Args:
        root: the checkpoint directory (--save).
        iteration: the step number the checkpoint is for (slime: the rollout id).
        model: the model chunks (or one chunk), wrapped or not.
        optimizer: a Megatron optimizer whose state is saved too, or None for weights only.
        opt_param_scheduler: an object with `state_dict()`, or None.
        extra_state: more picklable, rank-independent items (e.g. data-loader state) for common.pt.
        update_tracker: write the tracker too; the driver passes False and writes it once every part of
            the step is written.
        adapter_config: LoRA (`--lora-rank`): save only the adapters (and their optimizer state), not the frozen
            base, and the PEFT folder `adapter/` with this `adapter_config.json`.
        adapter_tensors: with `adapter_config`: the whole adapter (PEFT saved names, full tensors) on rank 0, which
            writes the folder (`update_weight.adapter_buckets` gathers it).

    Returns:
        the final checkpoint directory.

    Raises:
        FileExistsError: `root/iter_XXXXXXX` exists and slime did not write it.
    """
    from megatron.core import dist_checkpointing

    final_dir = checkpoint_dir(root, iteration)
    # dist_checkpointing wants an empty folder: the marker goes in when the folder is published.
    tmp_dir = atomic_dir.on_rank0(atomic_dir.create_staging, final_dir, "checkpoint", "--save", False)
    _barrier()

    adapter_only = adapter_config is not None
    state = _sharded_state_dict(_chunks(model), optimizer, adapter_only=adapter_only)
    state.update(iteration=iteration, checkpoint_version=CHECKPOINT_VERSION, **(extra_state or {}))
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    _keep_write_results_in_process()
    dist_checkpointing.save(state, str(tmp_dir))
    if adapter_only and _rank() == 0:
        write_adapter_folder(tmp_dir / CHECKPOINT_ADAPTER_DIR, adapter_tensors, adapter_config)
    _barrier()

    if _rank() == 0:
        atomic_dir.publish(tmp_dir, final_dir, "checkpoint", "--save")
        if update_tracker:
            write_tracker(root, iteration)
    _barrier()
    return final_dir


def _keep_write_results_in_process() -> None:
    """Collect the shard writers' results in a plain queue instead of megatron-core's default, a Manager process
    started with `spawn` in every rank that saves (1-2 s of a core to start, ~280 MB, and it outlives a rank that
    ends with `os._exit`). slime saves synchronously (`--async-save` is refused), so the results are put and read
    in this process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def has_checkpoint(path: str | Path | None) -> bool:
    """Whether `load_checkpoint(path, ...)` has something to load (e.g. whether --load can resume).

    A trainer typically starts from `--load` when this is true, else from `--ref-load` (or the HF folder).
    """
    if not path:
        return False
    path = Path(path)
    return read_tracker(path) is not None or (path / atomic_dir.DCP_INDEX).exists() or is_hf_checkpoint(path)


def resolve_checkpoint(path: str | Path, iteration: int | None = None) -> tuple[Path, int]:
    """The torch_dist directory to load and its iteration.

    Args:
        path: a root with a tracker file, or an `iter_XXXXXXX` / other torch_dist directory itself.
        iteration: a specific iteration under the root (default: the tracker's).

    Raises:
        FileNotFoundError: naming the path and what was expected there.
    """
    path = Path(path)
    tracked = read_tracker(path)
    if tracked is not None or iteration is not None:
        chosen = tracked if iteration is None else iteration
        directory = checkpoint_dir(path, chosen)
        if not directory.is_dir():
            raise FileNotFoundError(f"checkpoint {directory} does not exist (iteration {chosen} of {path})")
        return directory, 0 if chosen == "release" else int(chosen)
    if (path / atomic_dir.DCP_INDEX).exists():
        match = _ITER_DIR.fullmatch(path.name)
        return path, int(match.group(1)) if match else 0
    raise FileNotFoundError(
        f"{path} is neither a Megatron checkpoint (with {TRACKER_FILE}, or a torch_dist iter_XXXXXXX directory) "
        "nor an HF model folder (with config.json). Check --load / --ref-load."
    )


def load_checkpoint(
    path: str | Path,
    model: nn.Module | list[nn.Module],
    optimizer=None,
    opt_param_scheduler=None,
    iteration: int | None = None,
    family: str | None = None,
    flag: str = "--load",
    require_marker: bool = True,
    adapter_only: bool = False,
) -> tuple[int, dict[str, Any]]:
    """Load weights (and optimizer state if saved) from a torch_dist checkpoint or an HF folder.

    A collective. `--ref-load` uses the same function to fill the model with the reference weights.

    Args:
        path: checkpoint root, iter directory, or HF model folder.
        model: the model chunks (or one chunk), built with flags matching the checkpoint.
        optimizer: restored when the checkpoint has optimizer state; otherwise left as is (logged).
        opt_param_scheduler: restored when saved.
        iteration: a specific saved iteration under the root (default: the tracker's).
        family: model family for an HF folder (default: its config's model_type).
        flag, require_marker: for `checkpoint_safety.check_checkpoint`, run on a torch_dist folder before
            torch unpickles its index.
        adapter_only: LoRA: the checkpoint of a `--lora-rank` run (`save_checkpoint(adapter_config=...)`); its
            adapters (and optimizer state) load into the model's, the base is left as it is.

    Returns:
        (iteration, the remaining common state: `extra_state` given at save time), (0, {}) for an HF folder.
    """
    from megatron.core import dist_checkpointing

    chunks = _chunks(model)
    if is_hf_checkpoint(path):
        logger.info("loading HF weights from %s into the Megatron model", path)
        load_hf_weights(chunks, path, family)
        return 0, {}

    directory, found_iteration = resolve_checkpoint(path, iteration)
    check_checkpoint(directory, flag, require_marker)
    _check_adapter_only(directory, adapter_only, flag)
    common = dist_checkpointing.load_common_state_dict(str(directory))
    if optimizer is not None and "optimizer" not in common:
        logger.info("%s has no optimizer state; the optimizer starts fresh", directory)
        optimizer = None
    if optimizer is not None:
        _ensure_optimizer_state(optimizer)
    state = _sharded_state_dict(chunks, optimizer, is_loading=True, adapter_only=adapter_only)
    loaded = dist_checkpointing.load(state, str(directory))
    if adapter_only:
        lora.load_adapter_shards(chunks, loaded[_ADAPTER_KEY])
    else:
        for index, chunk in enumerate(chunks):
            unwrap_model(chunk).load_state_dict(loaded[_model_state_key(index, len(chunks))])
    if optimizer is not None:
        with torch.no_grad():  # fp32 models: the optimizer's main params are views of the parameters
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer)
    if opt_param_scheduler is not None and "opt_param_scheduler" in loaded:
        opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])
    reserved = {"optimizer", "opt_param_scheduler", "iteration", "checkpoint_version", _ADAPTER_KEY}
    extra = {k: v for k, v in common.items() if k not in reserved and not _MODEL_KEY.fullmatch(k)}
    return int(common.get("iteration", found_iteration)), extra


def _check_adapter_only(directory: Path, adapter_only: bool, flag: str) -> None:
    """A LoRA run's checkpoint holds its adapter only: refuse to load one where the other kind is expected."""
    is_adapter = (directory / CHECKPOINT_ADAPTER_DIR / ADAPTER_CONFIG_FILE).is_file()
    if adapter_only and not is_adapter:
        raise ValueError(
            f"{flag} {directory} holds a full model, not a LoRA adapter (no {CHECKPOINT_ADAPTER_DIR}/): with "
            "--lora-rank the base is --hf-checkpoint; start a new adapter (drop --load), or warm-start one with "
            "--lora-adapter-path."
        )
    if is_adapter and not adapter_only:
        raise ValueError(
            f"{flag} {directory} holds only a LoRA adapter (saved with --lora-rank): resume it with the same "
            "--lora-rank flags, or merge it into the base with tools/convert_to_hf.py --merge-lora."
        )


def copy_hf_metadata(origin_hf_dir: str | Path, output_dir: str | Path) -> None:
    """Copy config, tokenizer, chat template and other non-weight files of an HF folder."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for file in Path(origin_hf_dir).iterdir():
        if file.is_file() and not file.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(file, output_dir / file.name)


def save_hf_checkpoint(
    model: nn.Module | list[nn.Module],
    output_dir: str | Path,
    origin_hf_dir: str | Path,
    family: str | None = None,
    dtype: torch.dtype | None = None,
    progress: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    flag: str = "--save-hf",
) -> Path | None:
    """Export the model as an HF folder: safetensors weights + config/tokenizer copied from `origin_hf_dir`.

    A collective over all ranks. Each pipeline stage converts its layers (gathering TP and experts);
    the first rank of the world writes everything, beside `output_dir`, then renames it into place.

    Args:
        model: the model chunks (or one chunk).
        output_dir: where to write: absent, or an earlier slime export (replaced whole).
        origin_hf_dir: the HF folder the model came from (config, tokenizer, vocabulary size, family).
        family: model family (default: the origin config's model_type).
        dtype: cast weights to this (default: the origin config's dtype, else keep the parameters').
        progress: show a progress bar (on the first rank).
        max_shard_bytes: largest safetensors file; more weights are split into numbered shards.
        flag: the option that named `output_dir`, for error messages.

    Returns:
        the output directory on the writing rank, None elsewhere.

    Raises:
        FileExistsError: `output_dir` exists and slime did not write it (checked before any work).
    """
    from megatron.core import parallel_state

    from slime.backends.megatron_utils.config import family_from_hf_config

    output_dir = Path(output_dir).absolute()
    atomic_dir.on_rank0(atomic_dir.check_replaceable, output_dir, flag)
    hf_config = load_hf_config(origin_hf_dir)
    family = family or family_from_hf_config(hf_config)
    if dtype is None:
        dtype_name = hf_config.get("dtype") or hf_config.get("torch_dtype")
        dtype = getattr(torch, dtype_name) if isinstance(dtype_name, str) else None

    stage_tensors: dict[str, torch.Tensor] = {}
    converted = megatron_state_to_hf(model, family, vocab_size=hf_config["vocab_size"])
    for hf_name, tensor in tqdm(converted, desc="Megatron -> HF", disable=not progress or _rank() != 0):
        stage_tensors[hf_name] = tensor.to(device="cpu", dtype=dtype or tensor.dtype).clone()

    tensors = stage_tensors
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        stages: list[dict[str, torch.Tensor] | None] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, stage_tensors, group=parallel_state.get_pipeline_model_parallel_group())
        tensors = {name: t for stage in stages for name, t in stage.items()}
    if _rank() != 0:
        _barrier()
        return None
    staging = atomic_dir.create_staging(output_dir, "hf-export", flag)
    copy_hf_metadata(origin_hf_dir, staging)
    write_safetensors(tensors, staging, max_shard_bytes)
    atomic_dir.publish(staging, output_dir, "hf-export", flag)
    _barrier()
    return output_dir


def write_safetensors(
    tensors: dict[str, torch.Tensor], output_dir: str | Path, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write HF weights: one `model.safetensors`, or numbered shards plus `model.safetensors.index.json`."""
    output_dir = Path(output_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name in sorted(tensors):
        size = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensors[name]
        shard_bytes += size
    if len(shards) == 1:
        save_file(shards[0], str(output_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(output_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (output_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
