"""dist_checkpointing save/load of Megatron models: exact restore, resharding TP=2 -> TP=1, tracker, HF folders.

Megatron runs in 2 spawned gloo workers (tests/support/megatron_cpu.py); the checks run in the pytest process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.megatron_cpu import requires_megatron_core, run_in_processes
from support.tiny_model import build_tiny_model

pytestmark = requires_megatron_core


def _train_step(model, optimizer, tokens: torch.Tensor) -> float:
    from megatron.core.distributed import finalize_model_grads

    positions = torch.arange(tokens.shape[1] - 1).expand(tokens.shape[0], -1)
    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    loss = model[0](tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
    loss.backward()
    finalize_model_grads(model)
    optimizer.step()
    return loss.item()


def _hf_weights(model, vocab_size: int) -> dict[str, torch.Tensor]:
    from slime.backends.megatron_utils.megatron_to_hf import megatron_state_to_hf

    # Clone: unsplit tensors come back as views of the live parameters.
    return {name: tensor.clone() for name, tensor in megatron_state_to_hf(model, "qwen3", vocab_size)}


def _params(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model[0].named_parameters()}


def _worker(
    rank: int, world_size: int, hf_dir: str, root: str, tokens: torch.Tensor, user_dir: str, export_dir: str
) -> dict:
    from slime.backends.megatron_utils.checkpoint import load_checkpoint, save_checkpoint, save_hf_checkpoint
    from slime.backends.megatron_utils.config import config_from_hf
    from slime.backends.megatron_utils.model import build_model, build_optimizer, initialize_model_parallel

    out: dict = {}
    args = config_from_hf(hf_dir)
    vars(args).update(tensor_model_parallel_size=2, lr=1e-2, use_distributed_optimizer=True, weight_decay=0.0)

    # TP=2: start from the HF weights, take a step (so Adam has state), save twice.
    initialize_model_parallel(tensor_model_parallel_size=2, seed=1)
    model = build_model(args)
    optimizer = build_optimizer(args, model)
    iteration, _ = load_checkpoint(hf_dir, model)  # an HF folder goes through the HF converter
    out["hf_folder_iteration"] = iteration
    out["hf_folder_weights"] = _hf_weights(model, args.vocab_size)
    _train_step(model, optimizer, tokens)
    save_checkpoint(root, 5, model, optimizer, extra_state={"data_state": {"epoch": 2}})
    save_checkpoint(root, 5, model, optimizer, extra_state={"data_state": {"epoch": 2}})  # again: replaced
    saved = _params(model)
    out["saved_hf"] = _hf_weights(model, args.vocab_size)
    _train_step(model, optimizer, tokens)
    save_checkpoint(root, 7, model, optimizer)
    out["tracker_after_7"] = (Path(root) / "latest_checkpointed_iteration.txt").read_text()
    out["export_errors"] = {}
    try:  # an HF export into a folder of the user's is refused on every rank
        save_hf_checkpoint(model, user_dir, hf_dir)
    except FileExistsError as error:
        out["export_errors"]["user"] = str(error)
    save_hf_checkpoint(model, export_dir, hf_dir)  # one model.safetensors
    out["first_export"] = _hf_weights(model, args.vocab_size)

    # A fresh TP=2 model and optimizer (other seed): iteration 5 restores weights and optimizer exactly.
    initialize_model_parallel(tensor_model_parallel_size=2, seed=2)
    restored = build_model(args)
    restored_optimizer = build_optimizer(args, restored)
    out["fresh_differs"] = any(not torch.equal(p, saved[n]) for n, p in _params(restored).items())
    out["load_5"] = load_checkpoint(root, restored, restored_optimizer, iteration=5)
    out["restored_equal"] = all(torch.equal(p, saved[n]) for n, p in _params(restored).items())
    try:  # iteration 5's weights over the export of iteration 7's, in several shards: no old file may stay
        save_hf_checkpoint(restored, export_dir, hf_dir, max_shard_bytes=2**16)
        out["second_export"] = _hf_weights(restored, args.vocab_size)
    except TypeError as error:
        out["export_errors"]["second"] = str(error)
    # Same step from the same weights and optimizer state -> the same weights as the original's step.
    _train_step(restored, restored_optimizer, tokens)
    latest = build_model(args, wrap_with_ddp=False)
    out["load_latest"] = load_checkpoint(root, latest)
    after_step = {n: p.detach() for n, p in latest[0].named_parameters()}
    out["step_after_restore_equal"] = all(
        torch.equal(p, after_step[n.removeprefix("module.")]) for n, p in _params(restored).items()
    )

    # TP=1 (two data-parallel replicas) reads the TP=2 checkpoint: resharded on load, weights only.
    initialize_model_parallel(tensor_model_parallel_size=1)
    vars(args).update(tensor_model_parallel_size=1)
    resharded = build_model(args, wrap_with_ddp=False)
    load_checkpoint(root, resharded, iteration=5)
    out["resharded_hf"] = _hf_weights(resharded, args.vocab_size)
    try:
        load_checkpoint(Path(root) / "missing", resharded)
    except FileNotFoundError as error:
        out["missing_error"] = str(error)
    return out


USER_FOLDERS = ("iter_0000005.tmp", "iter_0000005.old", "results.tmp-final")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("megatron_ckpt")
    hf_dir = build_tiny_model(base / "hf", arch="qwen3")
    root = base / "ckpt"
    # The user's own folders, named as slime's temporary and replaced folders once were.
    for name in USER_FOLDERS:
        (root / name).mkdir(parents=True)
        (root / name / "keep.txt").write_text("mine")
    (base / "my_model").mkdir()
    (base / "my_model" / "notes.txt").write_text("mine")
    torch.manual_seed(3)
    tokens = torch.randint(0, 300, (2, 10))
    folders = (str(base / "my_model"), str(base / "export"))
    results = run_in_processes(_worker, world_size=2, args=(str(hf_dir), str(root), tokens, *folders))
    return hf_dir, root, results


def test_hf_folder_loads_through_the_converter(run):
    hf_dir, _, results = run
    reference = load_file(str(Path(hf_dir) / "model.safetensors"))
    for result in results:
        assert result["hf_folder_iteration"] == 0
        assert result["hf_folder_weights"].keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(result["hf_folder_weights"][name], tensor), name


def test_save_load_restores_weights_and_optimizer_exactly(run):
    _, _, results = run
    for result in results:
        assert result["fresh_differs"]  # otherwise "restored" would prove nothing
        assert result["load_5"] == (5, {"data_state": {"epoch": 2}})
        assert result["restored_equal"]
        assert result["step_after_restore_equal"]
        assert result["load_latest"][0] == 7


def test_tracker_and_layout_are_megatrons(run):
    _, root, results = run
    assert results[0]["tracker_after_7"] == "7"
    names = sorted(p.name for p in Path(root).iterdir() if p.name not in USER_FOLDERS)
    assert names == ["iter_0000005", "iter_0000007", "latest_checkpointed_iteration.txt"]  # no tmp leftovers
    assert (Path(root) / "iter_0000005" / ".metadata").is_file()


def test_tp2_checkpoint_loads_at_tp1(run):
    _, _, results = run
    for result in results:
        assert result["resharded_hf"].keys() == result["saved_hf"].keys()
        for name, tensor in result["saved_hf"].items():
            assert torch.equal(result["resharded_hf"][name], tensor), name
        # The checkpoint holds the trained weights, not the HF start.
        assert any(not torch.equal(result["saved_hf"][n], t) for n, t in result["hf_folder_weights"].items())


def test_missing_checkpoint_names_the_path(run):
    _, root, results = run
    message = results[0]["missing_error"]
    assert str(Path(root) / "missing") in message and "--load" in message


def test_has_checkpoint_tells_resume_from_start(run, tmp_path):
    from slime.backends.megatron_utils.checkpoint import has_checkpoint

    hf_dir, root, _ = run
    assert has_checkpoint(root) and has_checkpoint(Path(root) / "iter_0000005") and has_checkpoint(hf_dir)
    assert not has_checkpoint(tmp_path / "not_yet_saved") and not has_checkpoint(None)


@pytest.mark.reliability(
    "Megatron saves and HF exports next to the user's folders (iter_0000005.tmp/, a model folder of theirs)",
    "the user's folders are untouched; an export into one is refused on every rank, naming it",
)
def test_user_folders_are_never_touched(run):
    _, root, results = run
    for name in USER_FOLDERS:
        assert (Path(root) / name / "keep.txt").read_text() == "mine", name
    user_dir = Path(root).parent / "my_model"
    assert sorted(p.name for p in user_dir.iterdir()) == ["notes.txt"]
    for result in results:
        assert (
            str(user_dir) in result["export_errors"].get("user", "") and "--save-hf" in result["export_errors"]["user"]
        )


@pytest.mark.reliability(
    "an HF export over an earlier one with other weights and other weight files",
    "the folder is replaced whole: from_pretrained loads the new weights, no old shard stays",
)
def test_second_export_replaces_the_first_whole(run):
    from transformers import AutoModelForCausalLM

    _, root, results = run
    export = Path(root).parent / "export"
    assert "second" not in results[0]["export_errors"], results[0]["export_errors"]
    names = sorted(p.name for p in export.iterdir())
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names  # the first export's file
    assert len([name for name in names if name.startswith("model-")]) > 1
    loaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).state_dict()
    expected = results[0]["second_export"]
    assert expected.keys() <= loaded.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor.float()), name
    # The first export held other weights (iteration 7's), so this proves the replacement.
    assert any(not torch.equal(expected[name], results[0]["first_export"][name]) for name in expected)
