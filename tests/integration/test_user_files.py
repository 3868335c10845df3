"""What slime writes next to the user's files: it never deletes or mixes what it did not write, a checkpoint
is one unit (actor, critic, data source, then the tracker), and metrics.jsonl holds each rollout once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest
import ray
import torch
from support.fsdp import base_flags, make_rollout
from transformers import AutoModelForCausalLM

from slime.backends.fsdp_utils import checkpoint
from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
from slime.backends.fsdp_utils.model import gather_full_state_dict
from slime.ray import driver
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.utils import run_dir
from slime.utils.arguments import ArgumentValidationError, parse_args
from slime.utils.atomic_dir import MARKER, atomic_write_text, remove_leftovers
from slime.utils.tracking import Tracker

pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


def new_trainer(args, role: str = "actor") -> tuple[FSDPTrainRayActor, int]:
    trainer = FSDPTrainRayActor(1, 0, None, None)
    return trainer, trainer.init(args, role)


def listing(folder) -> dict[str, bytes | None]:
    """Every path under `folder` with its bytes (None for folders)."""
    return {
        os.path.relpath(os.path.join(top, name), folder): (
            open(os.path.join(top, name), "rb").read() if name in files else None
        )
        for top, dirs, files in os.walk(folder)
        for name in dirs + files
    }


def dead_pid() -> int:
    """The id of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ---------------------------------------------------------------------------------------------
# --save-hf and --save: an existing folder is replaced only if slime wrote it
# ---------------------------------------------------------------------------------------------


@pytest.mark.reliability(
    "--save-hf at a folder of the user's (at parse time, and as the {rollout_id} folder of a later save)",
    "refused, naming the folder and the fix; the folder is untouched; an earlier slime export is replaced whole",
)
def test_save_hf_never_replaces_a_folder_slime_did_not_write(tiny_model_dir, tmp_path):
    user_dir = tmp_path / "my_model"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("mine")
    with pytest.raises(ArgumentValidationError, match="--save-hf") as error:
        parse_args([*base_flags(tiny_model_dir), "--save-hf", str(user_dir)])
    assert str(user_dir) in str(error.value) and "Choose another --save-hf" in str(error.value)

    template = str(tmp_path / "hf" / "rollout_{rollout_id}")
    args = parse_args([*base_flags(tiny_model_dir), "--save-hf", template])
    actor, _ = new_trainer(args)
    taken = tmp_path / "hf" / "rollout_3"
    taken.mkdir(parents=True)
    (taken / "model.safetensors").write_bytes(b"the user's own weights")
    before = listing(tmp_path / "hf")
    with pytest.raises(FileExistsError, match="rollout_3") as error:
        actor.save_model(3)
    assert "--save-hf" in str(error.value)
    assert listing(tmp_path / "hf") == before  # nothing deleted, nothing written beside it

    # A fixed --save-hf folder that slime wrote earlier is replaced at each save, with nothing stale left.
    fixed = tmp_path / "export"
    actor, _ = new_trainer(parse_args([*base_flags(tiny_model_dir), "--save-hf", str(fixed)]))
    actor.save_model(0)
    (fixed / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")  # as if an earlier export had two
    parse_args([*base_flags(tiny_model_dir), "--save-hf", str(fixed)])  # a resumed run may write there again
    actor.train(1, make_rollout(8, seed=1))
    actor.save_model(1)
    assert "model-00001-of-00002.safetensors" not in os.listdir(fixed) and (fixed / MARKER).is_file()
    exported = AutoModelForCausalLM.from_pretrained(fixed, dtype=torch.float32).state_dict()
    trained = gather_full_state_dict(actor.model)
    assert all(torch.equal(tensor, trained[name]) for name, tensor in exported.items())
    assert not [name for name in os.listdir(tmp_path) if ".slime-" in name]


@pytest.mark.reliability(
    "--save DIR on a folder that holds a run, without --load DIR",
    "refused at parse time, naming --load DIR to resume or another --save",
)
def test_save_refuses_a_folder_that_holds_a_run(tiny_model_dir, tmp_path):
    empty = tmp_path / "fresh"
    empty.mkdir()
    parse_args([*base_flags(tiny_model_dir), "--save", str(empty)])  # an empty folder is fine
    for name in (run_dir.TRACKER_FILE, run_dir.METRICS_FILE):
        run = tmp_path / name.split(".")[0]
        run.mkdir()
        (run / name).write_text("3\n" if name == run_dir.TRACKER_FILE else '{"rollout_id": 0}\n')
        for load in ([], ["--load", str(tmp_path / "elsewhere")]):
            with pytest.raises(ArgumentValidationError, match="already holds a run") as error:
                parse_args([*base_flags(tiny_model_dir), "--save", str(run), *load])
            assert f"--load {run}" in str(error.value) and "another --save" in str(error.value)
        parse_args([*base_flags(tiny_model_dir), "--save", str(run), "--load", str(run) + "/"])  # resumes it


@pytest.mark.reliability(
    "files of the user's in --save named like leftovers (results.tmp-final.csv, my_notes.old-2024/)",
    "kept; the next save removes only marked leftovers of killed slime saves",
)
def test_checkpoint_cleanup_removes_only_slime_leftovers(tiny_model_dir, tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "results.tmp-final.csv").write_text("a,b\n1,2\n")
    (root / "my_notes.old-2024").mkdir()
    (root / "my_notes.old-2024" / "notes.txt").write_text("keep me")
    (root / ".iter_0000001.slime-tmp-1").mkdir()  # slime's name, but no marker: not provably slime's
    (root / ".iter_0000001.slime-tmp-1" / "data.bin").write_bytes(b"?")
    users = listing(root)
    dead = root / f".iter_0000001.slime-tmp-{dead_pid()}"  # a killed slime save of another process
    dead.mkdir()
    (dead / MARKER).write_text("{}")

    args = parse_args([*base_flags(tiny_model_dir), "--save", str(root), "--load", str(root)])
    actor, _ = new_trainer(args)
    real_save = checkpoint.dcp.save

    def killed_while_saving_the_optimizer(state_dict, checkpoint_id):
        if "optim" in state_dict:
            raise KeyboardInterrupt("killed")
        real_save(state_dict, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(checkpoint.dcp, "save", killed_while_saving_the_optimizer)
    with pytest.raises(KeyboardInterrupt):
        actor.save_model(0)
    monkeypatch.undo()
    killed = set(os.listdir(root)) - {p.split(os.sep)[0] for p in users} - {dead.name}
    assert len(killed) == 1  # what the kill left

    actor.save_model(1)
    actor.save_model(0)
    after = listing(root)
    assert {path: data for path, data in after.items() if path in users} == users
    assert not dead.exists() and not (root / killed.pop()).exists()
    assert sorted(set(os.listdir(root)) - {p.split(os.sep)[0] for p in users}) == [
        "iter_0000000",
        "iter_0000001",
        run_dir.TRACKER_FILE,
    ]


# ---------------------------------------------------------------------------------------------
# One checkpoint unit
# ---------------------------------------------------------------------------------------------


@pytest.mark.reliability(
    "a kill while saving step N, after the actor's part and before the critic's and the data source's",
    "the tracker stays on N-1; resume loads actor, critic and data source of N-1",
)
def test_kill_between_checkpoint_parts_resumes_the_previous_step(tiny_model_dir, tmp_path, monkeypatch, ray_cluster):
    root = tmp_path / "run"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"prompt {i}"}) + "\n" for i in range(20)))
    flags = [*base_flags(tiny_model_dir), "--advantage-estimator", "ppo", "--save", str(root), "--load", str(root)]
    flags[flags.index("unused.jsonl")] = str(prompts)
    args = parse_args(flags)
    actor, _ = new_trainer(args)
    critic, _ = new_trainer(args, "critic")
    data_source = ray.remote(RolloutDataSourceWithBuffer).remote(args)  # as the RolloutManager holds it
    run = driver.TrainingRun(args, data_source, actor, critic, None, 0, 10, 10)

    def train_step(rollout_id: int) -> None:
        ray.get(data_source.get_samples.remote(8))
        data = make_rollout(8, seed=rollout_id)
        critic.train(rollout_id, data)
        actor.train(rollout_id, data, values_refs=critic.compute_values(data))

    train_step(0)
    driver.save_checkpoint(run, 0)
    run_dir.commit_step(args.save, 0)  # what log_step does once the step's metrics row is written
    saved = {"actor": gather_full_state_dict(actor.model), "critic": gather_full_state_dict(critic.model)}
    saved["data_source"] = ray.get(data_source.state_dict.remote())
    train_step(1)

    real_save = checkpoint.dcp.save

    def killed_in_the_critic_save(state_dict, checkpoint_id):
        if f"{os.sep}critic{os.sep}" in checkpoint_id:
            raise KeyboardInterrupt("killed")
        real_save(state_dict, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(checkpoint.dcp, "save", killed_in_the_critic_save)
    with pytest.raises(KeyboardInterrupt):
        driver.save_checkpoint(run, 1)
    monkeypatch.undo()
    assert (root / "iter_0000001").is_dir() and not (root / "critic" / "iter_0000001").exists()

    resumed_actor, start = new_trainer(args)
    resumed_critic, critic_start = new_trainer(args, "critic")
    assert start == critic_start == 1
    assert driver.check_resume(args) == 0  # and every part of step 0 is there
    for role, trainer in (("actor", resumed_actor), ("critic", resumed_critic)):
        loaded = gather_full_state_dict(trainer.model)
        assert all(torch.equal(saved[role][name], loaded[name]) for name in saved[role]), role
    resumed_source = RolloutDataSourceWithBuffer(args)
    resumed_source.load(start - 1)
    assert resumed_source.state_dict() == saved["data_source"]


@pytest.mark.reliability(
    "resume a run whose last step lacks a part (e.g. --use-critic added, or a data source file removed)",
    "refused before anything starts, naming the step and the missing parts",
)
def test_resume_refuses_a_step_with_missing_parts(tiny_model_dir, tmp_path):
    root = tmp_path / "run"
    (root / "iter_0000004").mkdir(parents=True)
    (root / "rollout").mkdir()
    (root / "rollout" / "data_source_4.pt").write_bytes(b"")
    run_dir.commit_step(root, 4)
    grpo = parse_args([*base_flags(tiny_model_dir), "--save", str(root), "--load", str(root)])
    assert driver.check_resume(grpo) == 4
    ppo = parse_args([*base_flags(tiny_model_dir), "--advantage-estimator", "ppo", "--load", str(root)])
    with pytest.raises(FileNotFoundError, match="step 4") as error:
        driver.check_resume(ppo)
    assert os.path.join("critic", "iter_0000004") in str(error.value) and str(root) in str(error.value)
    (root / "rollout" / "data_source_4.pt").unlink()
    with pytest.raises(FileNotFoundError, match="data_source_4.pt"):
        driver.check_resume(grpo)


# ---------------------------------------------------------------------------------------------
# metrics.jsonl
# ---------------------------------------------------------------------------------------------


def tracker_args(save) -> Namespace:
    return Namespace(use_wandb=False, use_tensorboard=False, save=str(save), ci_test=False)


@pytest.mark.reliability(
    "a run killed after logging rollouts past its last checkpoint, then resumed",
    "metrics.jsonl keeps one row per rollout: the redone rollouts' rows replace the old ones",
)
def test_metrics_hold_each_rollout_once_after_resume(tmp_path):
    first = Tracker(tracker_args(tmp_path))
    first.log(0, {"eval/addition": 0.1})  # eval before training, then the training metrics: one row
    for rollout_id in range(5):
        first.log(rollout_id, {"rollout/reward": float(rollout_id)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"rollout_id": 5, "rollout/rew')  # killed mid-line
    resumed = Tracker(tracker_args(tmp_path), start_rollout_id=3)  # last checkpoint: rollout 2
    for rollout_id in range(3, 6):
        resumed.log(rollout_id, {"rollout/reward": 10.0 + rollout_id})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["rollout_id"] for row in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[0] == {"rollout_id": 0, "eval/addition": 0.1, "rollout/reward": 0.0}
    assert [row["rollout/reward"] for row in rows] == [0.0, 1.0, 2.0, 13.0, 14.0, 15.0]


@pytest.mark.reliability(
    "a user's file named exactly like an interrupted slime write (.latest_checkpointed_iteration.txt.slime-tmp-<dead "
    "pid>) beside a file slime rewrites",
    "kept, byte for byte: only marked folders count as slime's leftovers, and slime's own temporary files have fresh "
    "random names created exclusively",
)
def test_a_user_file_named_like_a_slime_temporary_is_never_removed_or_overwritten(tmp_path):
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    users = tmp_path / f".{tracker.name}.slime-tmp-{dead_pid()}"
    users.write_text("my notes")
    remove_leftovers(tracker)
    atomic_write_text(tracker, "3")
    atomic_write_text(tracker, "4")
    assert users.read_text() == "my notes"
    assert tracker.read_text() == "4" and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [tracker.name, users.name]
    )
