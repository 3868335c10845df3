"""`--eval-config` YAML: per-dataset settings over the `--eval-*` flags, and clear errors for a bad file."""

from __future__ import annotations

import pytest

from slime.utils.arguments import parse_args
from slime.utils.eval_config import eval_datasets, load_eval_config


def base_args(tmp_path, *extra: str):
    return parse_args(
        ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "2", "--num-rollout", "1", "--rollout-temperature", "0.9",
         "--rollout-max-response-len", "64", *extra]
    )  # fmt: skip


def write(tmp_path, text: str):
    path = tmp_path / "eval.yaml"
    path.write_text(text)
    return str(path)


def test_per_dataset_settings_override_defaults_and_flags(tmp_path):
    config = write(
        tmp_path,
        """
eval:
  defaults:
    n_samples_per_eval_prompt: 3
    temperature: 0.6
  datasets:
    - name: easy
      path: /data/easy.jsonl
    - name: hard
      path: /data/hard.jsonl
      n_samples_per_eval_prompt: 8
      max_response_len: 512
      rm_type: deepscaler
      metadata_overrides: {difficulty: hard}
""",
    )
    args = base_args(tmp_path, "--eval-top-p", "0.95")
    args.eval_config = config
    easy, hard = eval_datasets(args)
    assert (easy.name, easy.n_samples_per_eval_prompt, easy.temperature) == ("easy", 3, 0.6)
    assert easy.max_response_len == 64 and easy.top_p == 0.95 and easy.rm_type is None  # from the flags
    assert (hard.n_samples_per_eval_prompt, hard.max_response_len, hard.rm_type) == (8, 512, "deepscaler")
    assert hard.temperature == 0.6 and hard.metadata_overrides == {"difficulty": "hard"}


def test_eval_prompt_data_pairs_take_the_eval_flags(tmp_path):
    args = base_args(tmp_path, "--eval-prompt-data", "a", "/a.jsonl", "b", "/b.jsonl",
                     "--n-samples-per-eval-prompt", "4", "--eval-temperature", "0.1")  # fmt: skip
    datasets = eval_datasets(args)
    assert [(d.name, d.path) for d in datasets] == [("a", "/a.jsonl"), ("b", "/b.jsonl")]
    assert all(d.n_samples_per_eval_prompt == 4 and d.temperature == 0.1 and d.max_response_len == 64 for d in datasets)


@pytest.mark.reliability(
    "--eval-config with a misspelt key, a wrong type, a duplicate name or no datasets",
    "ValueError at start naming the file, the dataset and the key (with a did-you-mean)",
)
def test_bad_eval_config_is_refused_by_name(tmp_path):
    cases = {
        "eval:\n  datasets:\n    - {name: a, path: /a, temprature: 0.5}\n": "unknown key 'temprature' (did you mean 'temperature'?)",
        "eval:\n  datasets:\n    - {name: a, path: /a, n_samples_per_eval_prompt: two}\n": "n_samples_per_eval_prompt must be int",
        "eval:\n  datasets:\n    - {name: a, path: /a}\n    - {name: a, path: /b}\n": "two datasets are named 'a'",
        "eval:\n  datasets: []\n": "non-empty 'datasets:' list",
        "eval:\n  datasets:\n    - {path: /a}\n": "needs a 'name' and a 'path'",
        "eval: [unclosed\n": "not valid YAML",
    }
    for text, expected in cases.items():
        path = write(tmp_path, text)
        with pytest.raises(ValueError, match="--eval-config") as error:
            load_eval_config(path)
        assert expected in str(error.value), (text, str(error.value))
    with pytest.raises(ValueError, match="no such file"):
        load_eval_config(str(tmp_path / "missing.yaml"))


@pytest.mark.reliability("--eval-config naming a file that does not exist", "refused at parse time naming the file")
def test_eval_config_is_checked_at_parse_time(tmp_path):
    from slime.utils.arguments import ArgumentValidationError

    with pytest.raises((ArgumentValidationError, SystemExit)):
        base_args(tmp_path, "--eval-config", str(tmp_path / "missing.yaml"), "--eval-interval", "5")
    config = write(tmp_path, "eval:\n  datasets:\n    - {name: a, path: /a.jsonl}\n")
    args = base_args(tmp_path, "--eval-config", config, "--eval-interval", "5")
    assert [d.name for d in eval_datasets(args)] == ["a"]
