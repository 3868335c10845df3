"""Delta weight sync (`--update-weight-mode delta`): an FSDP trainer pushes to a real CPU engine server (in this
process, so the test can read the engine's live weights bit by bit) through `--update-weight-disk-dir`.

Expected values come from the trainer's own gathered weights: which tensors changed is found by comparing their
bytes before and after the optimizer step, and the engine must then hold exactly the trainer's bytes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from support.fsdp import make_rollout

from slime.backends.cpu_engine import ServerArgs, launch_server
from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
from slime.backends.fsdp_utils.model import gather_full_state_dict
from slime.backends.sglang_utils.http_client import EngineClient
from slime.utils.arguments import parse_args
from slime.utils.weight_delta import MANIFEST

DRIFTED = "model.layers.1.mlp.down_proj.weight"
CORRUPT: list[bool] = []  # set by a test: the post-write hook damages the next delta's payload


pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


@pytest.fixture
def engine(tiny_model_dir):
    """A CPU engine serving on a background thread of this process: (client, URL, CpuEngine)."""
    threads = torch.get_num_threads()
    handle = launch_server(ServerArgs(model_path=str(tiny_model_dir), port=0, num_threads=1))
    try:
        yield EngineClient(handle.url), handle.url, handle.engine
    finally:
        handle.stop()
        torch.set_num_threads(threads)


def make_args(model_dir, tmp_path, *extra: str):
    return parse_args(
        [
            "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl", "--num-rollout", "4",
            "--rollout-batch-size", "8", "--n-samples-per-prompt", "1", "--loss-type", "sft_loss", "--lr", "1e-4",
            "--rollout-backend", "cpu", "--update-weight-buffer-size", "40000",
            "--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "sync"),
            "--update-weight-disk-keep-files", "--update-weight-mode", "delta",
            "--custom-update-weight-post-write-path", f"{__name__}.corrupt_delta",
            *extra,
        ]
    )  # fmt: skip


def corrupt_delta(args, folder: str, engines: list) -> None:
    """Post-write hook: when a test asked, flip one byte in the middle of the delta's first payload file."""
    if CORRUPT and (Path(folder) / MANIFEST).is_file():
        CORRUPT.clear()
        payload = sorted(Path(folder).glob("delta-*.safetensors"))[0]
        data = bytearray(payload.read_bytes())
        data[-len(data) // 3] ^= 0xFF
        payload.write_bytes(bytes(data))


def engine_weights(engine) -> dict[str, torch.Tensor]:
    return engine.call(lambda: {n: t.detach().clone() for n, t in engine.model.state_dict().items()}).result(30)


def bytes_of(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.detach().contiguous().view(torch.uint8).numpy())


def assert_bit_equal(engine, trainer: dict[str, torch.Tensor]) -> None:
    held = engine_weights(engine)
    different = [name for name, tensor in trainer.items() if bytes_of(held[name]) != bytes_of(tensor)]
    assert not different, different


def folder_bytes(folder: Path, pattern: str) -> int:
    return sum(f.stat().st_size for f in folder.glob(pattern))


def pushed(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "sync").glob("weights-v*"), key=lambda p: p.stat().st_mtime_ns)


@pytest.mark.parametrize(
    "flags",
    [
        ["--update-weight-delta-encoding", "xor", "--update-weight-delta-checksum", "xxh3-128"],
        [
            "--update-weight-delta-encoding",
            "overwrite",
            "--update-weight-delta-checksum",
            "sha256",
            "--update-weight-local-checkpoint-dir",
            "LOCAL",
            "--only-train-params-name-list",
            r"layers\.0\.",
        ],
    ],  # fmt: skip
    ids=["xor-in-memory", "overwrite-on-disk"],
)
def test_delta_push_makes_engine_bit_equal_with_fewer_bytes(tiny_model_dir, engine, tmp_path, caplog, flags):
    client, url, cpu_engine = engine
    flags = [str(tmp_path / "local") if flag == "LOCAL" else flag for flag in flags]
    actor = FSDPTrainRayActor(1, 0, None, None)
    actor.init(make_args(tiny_model_dir, tmp_path, *flags), "actor")
    actor.connect_rollout_engines([client], [url])
    caplog.set_level(logging.INFO, logger="slime.backends.weight_sync.disk")

    actor.train(1, make_rollout(8, seed=1))
    actor.update_weights()
    assert "weight push v1 is full (--update-weight-mode delta): first push of this trainer" in caplog.text
    before = {name: t.clone() for name, t in gather_full_state_dict(actor.model).items()}
    assert_bit_equal(cpu_engine, before)

    actor.train(2, make_rollout(8, seed=2))
    after = gather_full_state_dict(actor.model)
    changed = {name for name in after if bytes_of(after[name]) != bytes_of(before[name])}
    assert changed and (len(changed) < len(after)) == ("overwrite" in flags)  # layer 0 alone trains there
    actor.update_weights()
    assert "weight push v2 is a delta against v1" in caplog.text
    assert client.get_model_info()["weight_version"] == "2"
    assert_bit_equal(cpu_engine, after)

    full, delta = pushed(tmp_path)
    manifest = json.loads((delta / MANIFEST).read_text())
    assert set(manifest["tensors"]) == changed and manifest["base_version"] == "1"
    assert manifest["unchanged"] == len(after) - len(changed)
    full_bytes, delta_bytes = folder_bytes(full, "*.safetensors"), folder_bytes(delta, "delta-*.safetensors")
    assert delta_bytes < full_bytes
    print(f"{flags[1]}: full push {full_bytes} bytes, delta {delta_bytes} bytes, {len(changed)}/{len(after)} changed")
    if "--update-weight-local-checkpoint-dir" in flags:
        base = tmp_path / "local" / "slime-delta-base"
        assert len(list((base / "base").glob("*.safetensors"))) == len(after)
        assert not list((base / "pending").iterdir())


@pytest.mark.reliability(
    "delta sync to an engine whose weights drifted from the trainer's copy, a corrupted delta payload, an engine "
    "relabelled to another weight version, and reconnected (restarted) engines",
    "the engine refuses the delta naming the tensor or version, the trainer logs why and pushes the full weights "
    "in the same update; the engine ends bit-equal to the trainer and the next push is a delta again",
)
def test_refused_delta_is_followed_by_the_full_weights(tiny_model_dir, engine, tmp_path, caplog):
    client, url, cpu_engine = engine
    actor = FSDPTrainRayActor(1, 0, None, None)
    actor.init(make_args(tiny_model_dir, tmp_path), "actor")
    actor.connect_rollout_engines([client], [url])
    caplog.set_level(logging.INFO, logger="slime.backends.weight_sync.disk")
    actor.train(1, make_rollout(8, seed=1))
    actor.update_weights()

    def push_and_check(step: int) -> str:
        caplog.clear()
        actor.train(step, make_rollout(8, seed=step))
        actor.update_weights()
        assert_bit_equal(cpu_engine, gather_full_state_dict(actor.model))
        assert client.get_model_info()["weight_version"] == str(step)
        return caplog.text

    # The engine's copy of one tensor drifted: rebuilding it fails the checksum.
    cpu_engine.call(lambda: cpu_engine.model.get_parameter(DRIFTED).data.add_(1e-3)).result(30)
    log = push_and_check(2)
    assert "delta weight push v2 was refused (" in log and "pushing the full weights of v2 instead" in log
    assert f"tensor {DRIFTED} fails its xxh3-128 checksum" in log

    # A byte of the payload flipped on its way (the post-write hook damages it).
    CORRUPT.append(True)
    log = push_and_check(3)
    assert "delta weight push v3 was refused (" in log and not CORRUPT

    # The engine says it holds another version than the one the delta was encoded against.
    client.update_weight_version("99")
    log = push_and_check(4)
    assert "encoded against weight version '3' but the weights held are version '99'" in log

    # Nothing wrong: a delta again, accepted.
    log = push_and_check(5)
    assert "weight push v5 is a delta against v4" in log and "refused" not in log

    # Reconnecting (as after an engine restart) makes the next push full, saying why.
    actor.connect_rollout_engines([client], [url])
    log = push_and_check(6)
    assert "weight push v6 is full (--update-weight-mode delta): reconnected to the engines" in log
    names = [p.name.split("-")[1] + ("-delta" if "-delta-" in p.name else "") for p in pushed(tmp_path)]
    assert names == ["v1", "v2-delta", "v2", "v3-delta", "v3", "v4-delta", "v4", "v5-delta", "v6"]
