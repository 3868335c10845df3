"""Where rollout prompts come from: the prompt dataset, walked epoch by epoch, plus a buffer of groups put back.

The data source hands out prompt *groups*: `n_samples_per_prompt` copies of one prompt that share a
`group_index`. Its position (epoch, offset in the epoch, running indices) and the buffer are saved
with each checkpoint, so a resumed run draws exactly the prompts an uninterrupted run would have.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import re
import tempfile
from typing import Any

import torch

from slime.utils.data import Dataset, load_dataset
from slime.utils.misc import load_function, load_tokenizer
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

_CHECKPOINT_NAME = re.compile(r"^data_source_(\d+)\.pt$")


_PLAIN_TYPES = (str, int, float, bool, type(None), torch.Tensor)


def _first_unsafe_value(value: Any, where: str = "state") -> str | None:
    """Where the first value `torch.load(weights_only=True)` cannot rebuild sits, and its type; None if none."""
    if isinstance(value, dict):
        for key, item in value.items():
            found = _first_unsafe_value(key, f"{where} key") or _first_unsafe_value(item, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _first_unsafe_value(item, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(value, _PLAIN_TYPES):
        return None
    return f"{type(value).__module__}.{type(value).__qualname__} at {where}"


def compute_num_rollout(args: Any, dataset_len: int) -> int:
    """Number of rollout steps for the run.

    With `--num-epoch`, prompts flow across epoch boundaries, so the run takes
    `num_epoch * dataset_len // rollout_batch_size` steps: the floor drops only the final partial batch
    of the last epoch (e.g. 2 epochs of 10 prompts at 4 per step → 5 steps, all 20 prompts).

    Args:
        args: Parsed arguments; reads num_epoch, num_rollout and rollout_batch_size.
        dataset_len: Number of prompts in the dataset (after filtering).

    Returns:
        The number of rollout steps.
    """
    if args.num_epoch is not None:
        num_rollout = args.num_epoch * dataset_len // args.rollout_batch_size
        if num_rollout < 1:
            raise ValueError(
                f"--num-epoch {args.num_epoch} over {dataset_len} prompts gives less than one rollout of "
                f"--rollout-batch-size {args.rollout_batch_size}; raise --num-epoch or lower --rollout-batch-size"
            )
        if args.num_rollout is not None and args.num_rollout != num_rollout:
            logger.warning(
                "--num-epoch %d gives %d rollouts; it overrides --num-rollout %d",
                args.num_epoch,
                num_rollout,
                args.num_rollout,
            )
        return num_rollout
    if args.num_rollout is None:
        raise ValueError("set either --num-rollout (rollout steps) or --num-epoch (passes over --prompt-data)")
    return args.num_rollout


def _load_tokenizer(args: Any) -> Any:
    if args.hf_checkpoint is None:
        raise ValueError("--apply-chat-template and --rollout-max-prompt-len need a tokenizer; pass --hf-checkpoint")
    return load_tokenizer(args.hf_checkpoint, args.trust_remote_code)


class RolloutDataSource:
    """Prompt groups from `--prompt-data`, epoch after epoch.

    Without `--prompt-data` (a custom rollout that makes its own prompts) it hands out empty
    samples that carry only their indices.

    Args:
        args: Parsed arguments (prompt_data, the dataset keys, rollout_shuffle, rollout_seed,
            n_samples_per_prompt, hf_checkpoint, save, load, start_rollout_id).
        tokenizer: The tokenizer to use; by default loaded from `--hf-checkpoint` when the chat
            template or `--rollout-max-prompt-len` needs it.
    """

    def __init__(self, args: Any, tokenizer: Any = None):
        self.args = args
        self.epoch_id = 0
        self.sample_offset = 0  # next position in the current epoch's order
        self.sample_index = 0  # next Sample.index
        self.sample_group_index = 0  # next Sample.group_index
        self.dataset: Dataset | None = None
        if args.prompt_data is None:
            logger.info("no --prompt-data: the data source hands out empty samples for the rollout to fill")
            return
        if tokenizer is None and (args.apply_chat_template or args.rollout_max_prompt_len is not None):
            tokenizer = _load_tokenizer(args)
        self.dataset = load_dataset(args.prompt_data, args, tokenizer)
        if args.rollout_shuffle:
            self.dataset.shuffle(self.epoch_id)

    def __len__(self) -> int:
        """Number of prompts in one epoch (0 without `--prompt-data`)."""
        return 0 if self.dataset is None else len(self.dataset)

    def _next_prompt(self) -> Sample:
        if self.dataset is None:
            return Sample()
        # Advance lazily, so a save right after the last prompt of an epoch resumes into the next one.
        if self.sample_offset >= len(self.dataset):
            self.epoch_id += 1
            self.sample_offset = 0
            if self.args.rollout_shuffle:
                self.dataset.shuffle(self.epoch_id)
        prompt_sample = self.dataset[self.sample_offset]
        self.sample_offset += 1
        return prompt_sample

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """Take the next `num_samples` prompts.

        Args:
            num_samples: Number of prompt groups.

        Returns:
            `num_samples` groups, each `n_samples_per_prompt` independent copies of one prompt with
            the group's `group_index` and running `index` values.
        """
        groups = []
        for _ in range(num_samples):
            prompt_sample = self._next_prompt()
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                sample = copy.deepcopy(prompt_sample)
                sample.group_index = self.sample_group_index
                sample.index = self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Not supported without a buffer; use `RolloutDataSourceWithBuffer`."""
        raise NotImplementedError(
            f"{type(self).__name__} has no buffer to put samples back into; use RolloutDataSourceWithBuffer"
        )

    def state_dict(self) -> dict[str, Any]:
        """The position in the data stream, as plain Python values."""
        return {
            "epoch_id": self.epoch_id,
            "sample_offset": self.sample_offset,
            "sample_index": self.sample_index,
            "sample_group_index": self.sample_group_index,
            "rollout_shuffle": bool(self.args.rollout_shuffle),
            "shuffle_seed": None if self.dataset is None else self.dataset.seed,
            "dataset_len": len(self),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict`."""
        self.epoch_id = state["epoch_id"]
        self.sample_offset = state["sample_offset"]
        self.sample_index = state["sample_index"]
        self.sample_group_index = state["sample_group_index"]
        if self.dataset is None:
            return
        if state["dataset_len"] != len(self.dataset):
            logger.warning(
                "the data source checkpoint was saved with %d prompts but --prompt-data now has %d; "
                "the resumed prompt order will differ from the original run",
                state["dataset_len"],
                len(self.dataset),
            )
        if state["shuffle_seed"] is not None and state["shuffle_seed"] != self.dataset.seed:
            logger.warning(
                "--rollout-seed %d differs from the checkpoint's %d; keeping the checkpoint's to replay the same order",
                self.dataset.seed,
                state["shuffle_seed"],
            )
            self.dataset.seed = state["shuffle_seed"]
        if self.args.rollout_shuffle:
            self.dataset.shuffle(self.epoch_id)

    def save(self, rollout_id: int) -> str:
        """Write the state to `{--save}/rollout/data_source_{rollout_id}.pt`, atomically (`save_state`)."""
        return save_state(self.args, self.state_dict(), rollout_id)

    def load(self, rollout_id: int | None = None) -> None:
        """Restore the state saved by `save` from `{--load}/rollout/` (`load_state`; no-op on a fresh start)."""
        loaded = load_state(self.args, rollout_id)
        if loaded is not None:
            self.load_state_dict(loaded[0])
            logger.info(
                "loaded data source state from %s (epoch %d, offset %d)", loaded[1], self.epoch_id, self.sample_offset
            )


def save_state(args: Any, state: dict[str, Any], rollout_id: int) -> str:
    """Write a data source's state to `{--save}/rollout/data_source_{rollout_id}.pt`, atomically.

    The file must load with `torch.load(weights_only=True)` (plain Python values and tensors), so that
    resuming never runs code from a file; this is checked before the file takes its real name.

    Returns:
        The path written.

    Raises:
        TypeError: the state (e.g. sample metadata in the buffer) holds other objects.
    """
    if args.save is None:
        raise ValueError("saving the data source needs --save (the checkpoint directory)")
    directory = os.path.join(args.save, "rollout")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"data_source_{rollout_id}.pt")
    # Write beside the target and rename, so a crash never leaves a truncated checkpoint under the real name.
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=f".data_source_{rollout_id}.", suffix=".tmp")
    try:
        unsafe = _first_unsafe_value(state)
        if unsafe:
            raise TypeError(
                f"the data source state of rollout {rollout_id} holds an object a checkpoint cannot store safely "
                f"({unsafe}); keep Sample.metadata / label / reward of samples put back into the buffer to "
                "plain Python values (str, int, float, bool, None, list, dict) and tensors"
            )
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        torch.load(tmp_path, weights_only=True)  # the guarantee itself: resuming will never unpickle code
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise
    logger.info("saved data source state to %s", path)
    return path


def load_state(args: Any, rollout_id: int | None = None) -> tuple[dict[str, Any], str] | None:
    """The state `save_state` wrote under `{--load}/rollout/`, and its path.

    Args:
        rollout_id: The step to load; None loads the latest one present, and gives None (fresh start) when
            `--load` holds no data source checkpoint.
    """
    directory = None if args.load is None else os.path.join(args.load, "rollout")
    saved_ids = []
    if directory is not None and os.path.isdir(directory):
        saved_ids = sorted(int(m.group(1)) for name in os.listdir(directory) if (m := _CHECKPOINT_NAME.match(name)))
    if rollout_id is None:
        if not saved_ids:
            logger.info("no data source checkpoint under --load=%s; starting from the first prompt", args.load)
            return None
        rollout_id = saved_ids[-1]
    elif rollout_id not in saved_ids:
        raise FileNotFoundError(
            f"no data source checkpoint for rollout {rollout_id} under --load={args.load} "
            f"(found rollouts: {saved_ids or 'none'}); pass an existing rollout id or check --load"
        )
    path = os.path.join(directory, f"data_source_{rollout_id}.pt")
    try:
        state = torch.load(path, weights_only=True)  # `save_state` wrote only plain values and tensors
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path} holds objects beyond plain Python values and tensors ({e}); "
            "slime does not unpickle them, as that could run code from the file. It was not written by this "
            "version of slime's data source: resume from a checkpoint it wrote, or start a new run"
        ) from e
    start_rollout_id = args.start_rollout_id
    if start_rollout_id is not None and start_rollout_id != rollout_id + 1:
        logger.warning(
            "loaded data source of rollout %d but --start-rollout-id is %d; prompts and model steps may not line up",
            rollout_id,
            start_rollout_id,
        )
    return state, path


def pop_first(args: Any, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """Default `--buffer-filter-path`: take up to `num_samples` groups from the front of the buffer.

    Args:
        args: Parsed arguments (unused; part of the filter signature).
        rollout_id: The rollout step, or None when the caller does not know it (unused).
        buffer: The buffer; the returned groups are removed from it.
        num_samples: Most groups to take.

    Returns:
        The oldest `min(num_samples, len(buffer))` groups.
    """
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """`RolloutDataSource` with a buffer of groups put back (e.g. aborted partial rollouts), served first.

    Args:
        args: As for `RolloutDataSource`, plus buffer_filter_path: a function
            `f(args, rollout_id, buffer, num_samples) -> list[list[Sample]]` that removes and returns
            the groups to serve (default `pop_first`).
        tokenizer: As for `RolloutDataSource`.
    """

    def __init__(self, args: Any, tokenizer: Any = None):
        super().__init__(args, tokenizer)
        self.buffer: list[list[Sample]] = []
        self.buffer_filter = pop_first if args.buffer_filter_path is None else load_function(args.buffer_filter_path)

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """Serve groups from the buffer first (through the buffer filter, with rollout_id None), then the dataset.

        Args:
            num_samples: Number of prompt groups.

        Returns:
            `num_samples` groups.
        """
        from_buffer = self.buffer_filter(self.args, None, self.buffer, num_samples) if self.buffer else []
        if len(from_buffer) > num_samples:
            raise ValueError(
                f"--buffer-filter-path {self.args.buffer_filter_path} returned {len(from_buffer)} groups "
                f"but only {num_samples} were asked for"
            )
        return from_buffer + super().get_samples(num_samples - len(from_buffer))

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Put groups back, to be served before new prompts.

        Args:
            groups: Groups of exactly `n_samples_per_prompt` samples each.
        """
        expected = self.args.n_samples_per_prompt
        for i, group in enumerate(groups):
            if not isinstance(group, list) or not all(isinstance(s, Sample) for s in group):
                raise TypeError(f"add_samples expects a list of groups (lists of Sample); group {i} is {group!r:.80}")
            if len(group) != expected:
                raise ValueError(
                    f"add_samples: group {i} has {len(group)} samples but --n-samples-per-prompt is {expected}; "
                    "put back whole groups"
                )
        self.buffer.extend(groups)

    def get_buffer_length(self) -> int:
        """Number of groups waiting in the buffer."""
        return len(self.buffer)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["buffer"] = [[sample.to_dict() for sample in group] for group in self.buffer]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.buffer = [[Sample.from_dict(d) for d in group] for group in state.get("buffer", [])]


class AdapterDataSource(RolloutDataSourceWithBuffer):
    """One adapter's prompt stream under `--multi-lora-n-adapters`: the adapter's file of `--multi-lora-prompt-data`,
    with its own position and buffer.

    The samples it hands out carry the adapter (`Sample.lora_adapter`), and indices unique over all the adapters'
    streams: `index * K + adapter` (group indices likewise).

    Args:
        args: Parsed arguments (as for `RolloutDataSource`; the file is `multi_lora_prompt_data[adapter]`).
        adapter: The adapter's index.
        tokenizer: As for `RolloutDataSource`.
    """

    def __init__(self, args: Any, adapter: int, tokenizer: Any = None):
        own = copy.copy(args)
        own.prompt_data = args.multi_lora_prompt_data[adapter]
        super().__init__(own, tokenizer)
        self.adapter = adapter

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = super().get_samples(num_samples)
        count = self.args.multi_lora_n_adapters
        for sample in (s for group in groups for s in group):
            if sample.lora_adapter is None:  # fresh from the file; groups put back are tagged already
                sample.lora_adapter = self.adapter
                sample.index = sample.index * count + self.adapter
                sample.group_index = sample.group_index * count + self.adapter
        return groups


class MultiLoraDataSource:
    """The data source of `--multi-lora-n-adapters K`: one `AdapterDataSource` per adapter (`sources`), each drawn
    by its own rollout call (the rollout manager's), and saved and restored together in one checkpoint file.

    Args:
        args: Parsed arguments (multi_lora_prompt_data, multi_lora_rm_path, and what `RolloutDataSource` reads).
        tokenizer: As for `RolloutDataSource` (loaded once for every adapter).
    """

    def __init__(self, args: Any, tokenizer: Any = None):
        self.args = args
        if tokenizer is None and (args.apply_chat_template or args.rollout_max_prompt_len is not None):
            tokenizer = _load_tokenizer(args)
        self.sources = [AdapterDataSource(args, k, tokenizer) for k in range(args.multi_lora_n_adapters)]

    def __len__(self) -> int:
        """Prompts in the largest adapter's file: `--num-epoch` counts passes over it (smaller files wrap around)."""
        return max(len(source) for source in self.sources)

    def rollout_args(self, args: Any, adapter: int) -> Any:
        """`args` for adapter `adapter`'s rollout call: its reward function (`--multi-lora-rm-path`) in place of the
        run's, when given."""
        paths = self.args.multi_lora_rm_path
        if paths is None:
            return args
        own = copy.copy(args)
        own.custom_rm_path = paths[adapter]
        return own

    def state_dict(self) -> dict[str, Any]:
        """Every adapter's position and buffer."""
        return {"adapters": [source.state_dict() for source in self.sources]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("adapters")
        if not isinstance(saved, list) or len(saved) != len(self.sources):
            have = f"{len(saved)} adapters" if isinstance(saved, list) else "a single data source"
            raise ValueError(
                f"the data source checkpoint holds {have}, but this run trains --multi-lora-n-adapters "
                f"{len(self.sources)}; resume with the adapter count it was saved with"
            )
        for source, source_state in zip(self.sources, saved, strict=True):
            source.load_state_dict(source_state)

    def save(self, rollout_id: int) -> str:
        """Write every adapter's state to `{--save}/rollout/data_source_{rollout_id}.pt` (`save_state`)."""
        return save_state(self.args, self.state_dict(), rollout_id)

    def load(self, rollout_id: int | None = None) -> None:
        """Restore what `save` wrote (`load_state`; no-op on a fresh start)."""
        loaded = load_state(self.args, rollout_id)
        if loaded is not None:
            self.load_state_dict(loaded[0])
            positions = ", ".join(
                f"adapter {s.adapter}: epoch {s.epoch_id} offset {s.sample_offset}" for s in self.sources
            )
            logger.info("loaded data source state from %s (%s)", loaded[1], positions)
