"""Evaluation sets and their per-set settings: `--eval-config` YAML or the `--eval-prompt-data` pairs.

    eval:
      defaults:                     # optional: applied to every dataset below
        n_samples_per_eval_prompt: 4
        temperature: 0.6
      datasets:
        - name: aime
          path: /data/aime-2024.jsonl
          rm_type: deepscaler       # any field below may be set per dataset
          max_response_len: 8192
          metadata_overrides: {difficulty: hard}

Without `--eval-config` every `--eval-prompt-data NAME PATH` pair becomes one dataset that takes the
`--eval-*` flags (falling back to the `--rollout-*` ones), so both spellings reach the same settings.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

import yaml


@dataclass
class EvalDatasetConfig:
    """One evaluation set. Unset (None) fields fall back to the `--eval-*`, then the `--rollout-*` flags."""

    name: str
    path: str
    n_samples_per_eval_prompt: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_response_len: int | None = None
    max_prompt_len: int | None = None
    min_new_tokens: int | None = None
    rm_type: str | None = None
    reward_key: str | None = None
    input_key: str | None = None
    label_key: str | None = None
    tool_key: str | None = None
    # The set's own generate function and reward (dotted paths), in place of the run's (upstream's fields).
    custom_generate_function_path: str | None = None
    custom_rm_path: str | None = None
    metadata_overrides: dict[str, Any] = field(default_factory=dict)


_FIELDS = {f.name: f for f in fields(EvalDatasetConfig)}
_TYPES = {"int": int, "float": (int, float), "str": str}


def _check_value(where: str, key: str, value: Any) -> Any:
    """`value` as the field's type, or a ValueError naming `where`, the key and the value."""
    if key == "metadata_overrides":
        if not isinstance(value, dict):
            raise ValueError(f"{where}: metadata_overrides must be a mapping, not {value!r}")
        return value
    kind = str(_FIELDS[key].type).split(" | ")[0]
    if value is None:
        return None
    expected = _TYPES[kind]
    if isinstance(value, bool) or not isinstance(value, expected):
        raise ValueError(f"{where}: {key} must be {kind}, not {value!r}")
    return float(value) if kind == "float" else value


def _check_keys(where: str, entry: dict[str, Any], allowed: set[str]) -> None:
    for key in entry:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(sorted(allowed))}"
            raise ValueError(f"{where}: unknown key {key!r}{hint}")


def load_eval_config(path: str) -> list[EvalDatasetConfig]:
    """Read and check an `--eval-config` YAML file.

    Raises:
        ValueError: The file is missing or malformed; the message names the file, the dataset and the key.
    """
    where = f"--eval-config {path}"
    if not os.path.isfile(path):
        raise ValueError(f"{where}: no such file")
    with open(path) as f:
        try:
            document = yaml.safe_load(f)
        except yaml.YAMLError as error:
            raise ValueError(f"{where}: not valid YAML: {error}") from error
    section = document.get("eval") if isinstance(document, dict) else None
    if not isinstance(section, dict) or not isinstance(section.get("datasets"), list) or not section["datasets"]:
        raise ValueError(f"{where}: expected an 'eval:' mapping with a non-empty 'datasets:' list (see the docs)")
    _check_keys(f"{where} eval", section, {"defaults", "datasets"})
    settings = set(_FIELDS) - {"name", "path"}
    defaults = section.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ValueError(f"{where}: eval.defaults must be a mapping")
    _check_keys(f"{where} eval.defaults", defaults, settings)
    datasets, names = [], set()
    for i, entry in enumerate(section["datasets"]):
        if not isinstance(entry, dict) or not entry.get("name") or not entry.get("path"):
            raise ValueError(f"{where}: eval.datasets[{i}] needs a 'name' and a 'path'")
        name = str(entry["name"])
        dataset_where = f"{where} dataset {name!r}"
        _check_keys(dataset_where, entry, set(_FIELDS))
        if name in names:
            raise ValueError(f"{where}: two datasets are named {name!r}; names must be unique")
        names.add(name)
        merged = {**defaults, **entry}
        values = {key: _check_value(dataset_where, key, value) for key, value in merged.items()}
        if values.get("n_samples_per_eval_prompt") is not None and values["n_samples_per_eval_prompt"] < 1:
            raise ValueError(f"{dataset_where}: n_samples_per_eval_prompt must be at least 1")
        datasets.append(EvalDatasetConfig(**{**values, "name": name, "path": str(entry["path"])}))
    return datasets


def pick_from_args(args, attrs: tuple[str, ...]) -> Any:
    """The first of `args`' attributes `attrs` that is set (not None), else None."""
    return _first(*(getattr(args, attr, None) for attr in attrs))


def _spec(*arg_attrs: str, key: str) -> dict[str, tuple[str, ...]]:
    return {"dataset_keys": (key,), "default_keys": (key,), "arg_attrs": arg_attrs}


# Where each per-dataset setting comes from, first found wins (upstream's tables, same shape): the dataset's own
# entry (`dataset_keys`), then `eval.defaults` (`default_keys`), then the first flag of `arg_attrs` that is set.
# slime reads only `arg_attrs` (`load_eval_config` has merged entry over defaults already); the key names are kept
# for upstream code that reads these tables.
DATASET_RUNTIME_SPECS: dict[str, dict[str, tuple[str, ...]]] = {
    "n_samples_per_eval_prompt": _spec(
        "n_samples_per_eval_prompt", "n_samples_per_prompt", key="n_samples_per_eval_prompt"
    ),
    "temperature": _spec("eval_temperature", "rollout_temperature", key="temperature"),
    "top_p": _spec("eval_top_p", "rollout_top_p", key="top_p"),
    "top_k": _spec("eval_top_k", "rollout_top_k", key="top_k"),
    "max_response_len": _spec("eval_max_response_len", "rollout_max_response_len", key="max_response_len"),
    "max_prompt_len": _spec("eval_max_prompt_len", "rollout_max_prompt_len", key="max_prompt_len"),
    "min_new_tokens": _spec("eval_min_new_tokens", key="min_new_tokens"),
}
# The same for how a dataset's rows are read and scored.
DATASET_SAMPLE_SPECS: dict[str, dict[str, tuple[str, ...]]] = {
    "input_key": _spec("eval_input_key", "input_key", key="input_key"),
    "label_key": _spec("eval_label_key", "label_key", key="label_key"),
    "tool_key": _spec("eval_tool_key", "tool_key", key="tool_key"),
    "reward_key": _spec("eval_reward_key", "reward_key", key="reward_key"),
}


def eval_datasets(args) -> list[EvalDatasetConfig]:
    """The run's evaluation sets with every setting resolved by `DATASET_RUNTIME_SPECS` and `DATASET_SAMPLE_SPECS`
    (`load_eval_config` has already merged each dataset's entry over `eval.defaults`). `rm_type` has no flag: unset,
    the run's `--rm-type` / `--custom-rm-path` score the set."""
    if args.eval_config:
        configured = load_eval_config(args.eval_config)
    else:
        configured = [EvalDatasetConfig(name=name, path=path) for name, path in (args.eval_prompt_data or [])]
    specs = DATASET_RUNTIME_SPECS | DATASET_SAMPLE_SPECS
    flag_values = {key: pick_from_args(args, spec["arg_attrs"]) for key, spec in specs.items()}
    resolved = []
    for dataset in configured:
        values = {key: _first(getattr(dataset, key), default) for key, default in flag_values.items()}
        resolved.append(replace(dataset, **values))  # the fields without a flag stay as the dataset set them
    return resolved


def _first(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)
