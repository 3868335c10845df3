"""A data source for `--data-source-path my_data_source.AdditionSource`: prompts made by code, not read from a file."""

from __future__ import annotations

import json
import os
import random

from slime.utils.types import Sample


class AdditionSource:
    """Endless two-digit additions; the position is saved with each checkpoint and restored by `--load`.

    No `--prompt-data` is needed (a custom data source brings its own prompts); pass `--num-rollout`.
    """

    def __init__(self, args):
        self.args = args
        self.next_index = 0  # the next new prompt group; a group is a function of its index
        self.buffer: list[list[Sample]] = []  # groups put back (aborted, or generated beyond the batch)

    def __len__(self) -> int:
        return 0  # no fixed epoch: use --num-rollout

    def _group(self, index: int) -> list[Sample]:
        rng = random.Random(index)
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        prompt = f"What is {a} + {b}? Reply with only the number."
        n = self.args.n_samples_per_prompt
        return [Sample(index=index * n + k, group_index=index, prompt=prompt, label=str(a + b)) for k in range(n)]

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """`num_samples` groups of `--n-samples-per-prompt` samples, put-back groups first."""
        groups, self.buffer = self.buffer[:num_samples], self.buffer[num_samples:]
        while len(groups) < num_samples:
            groups.append(self._group(self.next_index))
            self.next_index += 1
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Take back groups the rollout did not use; they are served first, as fresh prompts."""
        self.buffer.extend(self._group(group[0].group_index) for group in groups)

    @staticmethod
    def _path(root: str, rollout_id: int) -> str:
        return os.path.join(root, "rollout", f"addition_source_{rollout_id}.json")

    def save(self, rollout_id: int) -> None:
        """Write the position after rollout `rollout_id` under `--save`."""
        path = self._path(self.args.save, rollout_id)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {"next_index": self.next_index, "put_back": [group[0].group_index for group in self.buffer]}
        with open(path, "w") as f:
            json.dump(state, f)

    def load(self, rollout_id: int | None = None) -> None:
        """Restore the position saved after rollout `rollout_id` from `--load` (None: nothing saved yet)."""
        if rollout_id is None or not self.args.load:
            return
        with open(self._path(self.args.load, rollout_id)) as f:
            state = json.load(f)
        self.next_index = state["next_index"]
        self.buffer = [self._group(index) for index in state["put_back"]]
