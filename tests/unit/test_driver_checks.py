"""What the drivers refuse before they start anything, checked in-process (no Ray, no engine)."""

import importlib.util
from pathlib import Path

import pytest

from slime.utils.arguments import parse_args

REPO = Path(__file__).resolve().parents[2]
BASE = [
    "--hf-checkpoint", "/models/tiny", "--prompt-data", "/data/train.jsonl",
    "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2",
]  # fmt: skip


def driver(script: str):
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.reliability("train_async.py with --colocate", "refused before anything starts, pointing to train.py")
def test_train_async_refuses_colocate():
    with pytest.raises(SystemExit, match="cannot share devices: drop --colocate, or use train.py"):
        driver("train_async.py").train(parse_args([*BASE, "--colocate"]))


def test_train_async_refuses_several_adapters():
    flags = [
        "--lora-rank",
        "4",
        "--multi-lora-n-adapters",
        "2",
        "--multi-lora-prompt-data",
        "/data/a.jsonl",
        "/data/b.jsonl",
    ]
    with pytest.raises(SystemExit, match=r"several adapters \(--multi-lora-n-adapters 2\): use train.py"):
        driver("train_async.py").train(parse_args([*BASE[:2], *BASE[4:], *flags]))


def test_train_async_refuses_debug_rollout_only():
    with pytest.raises(SystemExit, match="use train.py --debug-rollout-only"):
        driver("train_async.py").train(parse_args([*BASE, "--debug-rollout-only"]))
