"""FSDP checkpoints: exact resume, crash safety, world-size independence, HF export."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from support.fsdp import CAPTURE_HOOK, CAPTURED, base_flags, make_rollout, plain_response_log_probs
from support.ranks import spawn_ranks
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime.backends.fsdp_utils import checkpoint
from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
from slime.backends.fsdp_utils.data_packing import pack_micro_batch
from slime.backends.fsdp_utils.model import gather_full_state_dict, response_logits
from slime.utils.arguments import parse_args
from slime.utils.http_utils import find_free_port

pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


def make_args(model_dir, save_dir, *extra: str):
    return parse_args([*base_flags(model_dir), "--save", str(save_dir), "--load", str(save_dir), *extra])


def new_actor(args) -> tuple[FSDPTrainRayActor, int]:
    actor = FSDPTrainRayActor(1, 0, None, None)
    return actor, actor.init(args, "actor")


def optimizer_state_by_name(actor) -> dict[str, dict]:
    """AdamW state per parameter name, gathered to full tensors."""
    names = {id(param): name for name, param in actor.model.named_parameters()}
    state = {}
    for param, values in actor.optimizer.state.items():
        state[names[id(param)]] = {
            key: (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
            for key, value in values.items()
        }
    return state


def test_save_then_load_restores_everything(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path / "ckpt")
    actor, start = new_actor(args)
    assert start == 0  # nothing saved yet: start from --hf-checkpoint
    data = make_rollout(8, seed=0, num_steps=2)
    actor.train(0, data)
    actor.train(1, data)
    actor.save_model(1)
    saved_weights = gather_full_state_dict(actor.model)
    saved_optimizer = optimizer_state_by_name(actor)
    saved_scheduler = actor.lr_scheduler.state_dict()
    saved_torch_rng, saved_python_rng, saved_numpy_rng = torch.get_rng_state(), random.getstate(), np.random.rand(3)
    assert checkpoint.latest_iteration(str(tmp_path / "ckpt")) == 1
    # Everything but DCP's files reads back without unpickling code (weights_only=True).
    folder = tmp_path / "ckpt" / "iter_0000001"
    for path in [folder / "scheduler.pt", *(folder / "rng").iterdir()]:
        torch.load(path, weights_only=True)

    torch.rand(100), random.random(), np.random.rand(5)  # move the generators on; loading must bring them back
    resumed, start = new_actor(args)
    assert start == 2
    loaded_weights = gather_full_state_dict(resumed.model)
    assert all(torch.equal(saved_weights[name], loaded_weights[name]) for name in saved_weights)
    loaded_optimizer = optimizer_state_by_name(resumed)
    assert loaded_optimizer.keys() == saved_optimizer.keys() and saved_optimizer
    for name, state in saved_optimizer.items():
        assert all(torch.equal(state[key], loaded_optimizer[name][key]) for key in state), name
    assert resumed.lr_scheduler.state_dict() == saved_scheduler
    assert resumed.lr_scheduler.last_epoch == 4
    assert torch.equal(torch.get_rng_state(), saved_torch_rng) and random.getstate() == saved_python_rng
    assert np.array_equal(np.random.rand(3), saved_numpy_rng)  # numpy continues from the saved state too

    # Training on from either copy gives the same numbers (timings aside).
    timing = ("train/step_time", "train/tokens_per_s")
    continued, original = resumed.train(2, data), actor.train(2, data)

    def numbers(metrics: dict) -> dict:
        return {k: v for k, v in metrics.items() if k not in timing and not k.startswith("perf/")}

    assert numbers(continued) == numbers(original)


@pytest.mark.reliability(
    "an FSDP save killed while writing the optimizer state",
    "the tracker stays on the previous checkpoint, which resumes; the next save removes the leftover",
)
def test_interrupted_save_leaves_previous_checkpoint_loadable(tiny_model_dir, tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    args = make_args(tiny_model_dir, root)
    actor, _ = new_actor(args)
    data = make_rollout(8, seed=1, num_steps=2)
    actor.train(0, data)
    actor.save_model(0)
    weights_at_0 = gather_full_state_dict(actor.model)
    actor.train(1, data)

    real_save = checkpoint.dcp.save

    def dies_during_optimizer_save(state_dict, checkpoint_id):
        if "optim" in state_dict:
            raise KeyboardInterrupt("killed while writing the optimizer state")
        real_save(state_dict, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(checkpoint.dcp, "save", dies_during_optimizer_save)
    with pytest.raises(KeyboardInterrupt):
        actor.save_model(1)
    monkeypatch.undo()
    leftovers = [name for name in os.listdir(root) if ".slime-tmp-" in name]
    assert leftovers and os.listdir(root / leftovers[0] / "model")  # half-written
    assert checkpoint.latest_iteration(str(root)) == 0
    assert not (root / "iter_0000001").exists()

    resumed, start = new_actor(args)
    assert start == 1
    loaded = gather_full_state_dict(resumed.model)
    assert all(torch.equal(weights_at_0[name], loaded[name]) for name in weights_at_0)

    resumed.save_model(1)  # the next save succeeds and clears the leftovers
    assert checkpoint.latest_iteration(str(root)) == 1
    assert not [name for name in os.listdir(root) if ".slime-tmp-" in name]


def _load_worker(rank: int, world_size: int, port: int, args, out_dir: str) -> None:
    actor = FSDPTrainRayActor(world_size, rank, "127.0.0.1", port)
    start = actor.init(args, "actor")
    weights = gather_full_state_dict(actor.model)
    torch.save(
        {"start": start, "weights": weights, "lr": actor.optimizer.param_groups[0]["lr"]}, f"{out_dir}/{rank}.pt"
    )


def test_checkpoint_from_one_rank_loads_on_two(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path / "ckpt")
    actor, _ = new_actor(args)
    actor.train(0, make_rollout(8, seed=2, num_steps=2))
    actor.save_model(0)
    saved = gather_full_state_dict(actor.model)
    spawn_ranks(_load_worker, (2, find_free_port(), args, str(tmp_path)), 2)
    for rank in range(2):
        loaded = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        assert loaded["start"] == 1
        assert loaded["lr"] == actor.optimizer.param_groups[0]["lr"]
        assert all(torch.equal(saved[name], loaded["weights"][name]) for name in saved)


def test_save_hf_folder_loads_with_transformers(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path / "ckpt", "--save-hf", str(tmp_path / "hf" / "rollout_{rollout_id}"))
    actor, _ = new_actor(args)
    data = make_rollout(8, seed=3, num_steps=2)
    actor.train(0, data)
    actor.save_model(7)
    folder = tmp_path / "hf" / "rollout_7"
    exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert exported.config.architectures == ["LlamaForCausalLM"]
    assert AutoTokenizer.from_pretrained(folder).chat_template is not None
    trained = gather_full_state_dict(actor.model)
    assert all(torch.equal(tensor, trained[name]) for name, tensor in exported.state_dict().items())

    micro_batch = pack_micro_batch(data["tokens"], data["response_lengths"], list(range(8)))
    actor.model.eval()
    with torch.no_grad():
        trainer_logits = response_logits(actor.model, micro_batch)
        exported_logits = response_logits(exported, micro_batch)
    assert torch.equal(trainer_logits, exported_logits)


def test_load_hf_folder_and_ref_load(tiny_model_dir, tmp_path):
    """--load at a HF folder starts from it; --ref-load (HF folder or FSDP checkpoint) sets the reference."""
    export = tmp_path / "hf" / "rollout_0"
    args = make_args(tiny_model_dir, tmp_path / "ckpt", "--save-hf", str(tmp_path / "hf" / "rollout_{rollout_id}"))
    trained, _ = new_actor(args)
    trained.train(0, make_rollout(8, seed=4, num_steps=2))
    trained.save_model(0)  # FSDP checkpoint in ckpt/ and the same weights as a HF folder in hf/rollout_0
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    data = make_rollout(8, seed=5)

    def run(load: str, ref_load: str, rollout_id: int) -> tuple[int, dict]:
        flags = [
            "--load",
            load,
            "--ref-load",
            ref_load,
            "--use-kl-loss",
            "--rollout-data-postprocess-path",
            CAPTURE_HOOK,
        ]
        actor = FSDPTrainRayActor(1, 0, None, None)
        start = actor.init(parse_args([*base_flags(tiny_model_dir), *flags]), "actor", with_ref=True)
        actor.train(rollout_id, data)
        return start, CAPTURED[rollout_id]

    start, captured = run(str(export), str(tiny_model_dir), 200)
    assert start == 0
    for tokens, response, lp, ref in zip(
        data["tokens"], data["response_lengths"], captured["log_probs"], captured["ref_log_probs"]
    ):
        assert torch.allclose(lp, plain_response_log_probs(exported, tokens, response), atol=1e-5)
        assert torch.allclose(ref, plain_response_log_probs(original, tokens, response), atol=1e-5)

    _, captured = run(str(tiny_model_dir), str(tmp_path / "ckpt"), 201)
    for tokens, response, lp, ref in zip(
        data["tokens"], data["response_lengths"], captured["log_probs"], captured["ref_log_probs"]
    ):
        assert torch.allclose(lp, plain_response_log_probs(original, tokens, response), atol=1e-5)
        assert torch.allclose(ref, plain_response_log_probs(exported, tokens, response), atol=1e-5)
