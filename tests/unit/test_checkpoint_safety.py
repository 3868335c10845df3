"""Checkpoint folders: torch's DCP index is a pickle, so slime loads only folders it wrote and reads their index
with DCP's own classes first (slime.utils.checkpoint_safety)."""

from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from slime.backends.fsdp_utils import checkpoint as fsdp_checkpoint
from slime.utils import atomic_dir
from slime.utils.checkpoint_safety import UntrustedCheckpointError, check_checkpoint, read_dcp_metadata


class _RunsCode:
    """Unpickles into a call of os.system: what a crafted `.metadata` does under plain pickle.load."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def save_checkpoint_folder(final) -> None:
    """One iteration as slime's writers lay it out: staged, DCP-saved, then published (which marks it)."""
    staging = atomic_dir.create_staging(final, "checkpoint")
    state = {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.ones(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is not initialized": one process is the point here
        dcp.save({"model": state}, checkpoint_id=str(staging / "model"))
    atomic_dir.publish(staging, final, "checkpoint")


def plant_code(folder, victim) -> None:
    """Replace the index with one that runs `touch victim`, and record its digest as slime would."""
    (folder / "model" / ".metadata").write_bytes(pickle.dumps(_RunsCode(f"touch {victim}")))
    atomic_dir.write_marker(folder, "checkpoint")  # the attacker can compute a digest too


def test_a_checkpoint_slime_wrote_passes_and_its_index_reads_as_torch_reads_it(tmp_path):
    folder = tmp_path / "iter_0000001"
    save_checkpoint_folder(folder)
    marker = json.loads((folder / atomic_dir.MARKER).read_text())
    assert set(marker["metadata_sha256"]) == {"model/.metadata"}
    check_checkpoint(folder)
    ours = read_dcp_metadata((folder / "model" / ".metadata").read_bytes())
    torchs = FileSystemReader(str(folder / "model")).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata
    assert ours.storage_data == torchs.storage_data


@pytest.mark.reliability(
    "--load of a checkpoint whose DCP .metadata pickle calls os.system (marker and digest forged to match)",
    "UntrustedCheckpointError naming --load, the folder and the global (posix.system) before torch reads it; the "
    "command never runs",
)
def test_a_crafted_index_is_refused_before_torch_unpickles_it(tmp_path):
    root = tmp_path / "ckpt"
    folder = root / "iter_0000003"
    save_checkpoint_folder(folder)
    fsdp_checkpoint.write_tracker(str(root), 3)
    (folder / "meta.json").write_text(json.dumps({"rollout_id": 3, "world_size": 1, "has_optimizer": False}))
    victim = tmp_path / "ran"
    plant_code(folder, victim)

    with pytest.raises(
        UntrustedCheckpointError, match=r"--load .*iter_0000003: model/\.metadata refused: posix\.system"
    ):
        fsdp_checkpoint.load_checkpoint(str(root), model=None, optimizer=None, scheduler=None)
    assert not victim.exists()
    # What torch itself does with the same folder: the command runs, then torch fails on what it returned.
    with pytest.raises(AttributeError):
        FileSystemReader(str(folder / "model")).read_metadata()
    assert victim.exists()


@pytest.mark.reliability(
    "--load / --ref-load of a DCP checkpoint slime did not write (no .slime-folder marker), or one whose index "
    "changed after slime saved it",
    "UntrustedCheckpointError naming the flag, the folder and the fix (an HF folder, or "
    "tools/convert_torch_dist_to_hf.py); nothing is unpickled",
)
def test_unmarked_or_changed_checkpoints_are_refused_naming_the_fix(tmp_path):
    folder = tmp_path / "iter_0000001"
    save_checkpoint_folder(folder)
    (folder / "model" / ".metadata").write_bytes((folder / "model" / ".metadata").read_bytes() + b"\0")
    with pytest.raises(UntrustedCheckpointError, match=r"model/\.metadata differ from what slime wrote there"):
        check_checkpoint(folder, "--ref-load")

    (folder / atomic_dir.MARKER).unlink()
    with pytest.raises(UntrustedCheckpointError, match="--ref-load .* has no .slime-folder marker") as refused:
        check_checkpoint(folder, "--ref-load")
    assert "tools/convert_torch_dist_to_hf.py" in str(refused.value)


def test_the_converter_takes_unmarked_checkpoints_whose_index_names_only_dcp_classes(tmp_path):
    folder = tmp_path / "from_elsewhere"
    save_checkpoint_folder(folder)
    (folder / atomic_dir.MARKER).unlink()
    check_checkpoint(folder, "--input-dir", require_marker=False)
    plant_code(folder, tmp_path / "ran")
    (folder / atomic_dir.MARKER).unlink()
    with pytest.raises(UntrustedCheckpointError, match="--input-dir .* posix.system"):
        check_checkpoint(folder, "--input-dir", require_marker=False)
    assert not (tmp_path / "ran").exists()
