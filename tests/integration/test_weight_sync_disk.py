"""Disk weight sync (`--update-weight-transport disk`) and engines started outside slime
(`--rollout-external-engine-addrs`), against a real CPU engine server process that requires an API key.

After a push the engine must compute what the trainer's weights compute; the expected values come from a
plain HF model given the trainer's gathered weights, and from `from_pretrained` of the pushed folder.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import ray
import torch
from safetensors import safe_open
from support.engines import engine_prompt_log_probs, engine_server
from support.fsdp import make_rollout
from support.ranks import spawn_ranks
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
from slime.backends.fsdp_utils.model import gather_full_state_dict
from slime.backends.sglang_utils.http_client import EngineClient
from slime.ray.placement_group import PlacementSlice
from slime.ray.rollout import create_rollout_manager, split_train_data_by_dp, wait_for_external_engines
from slime.utils import atomic_dir
from slime.utils.arguments import ArgumentValidationError, parse_args
from slime.utils.http_utils import find_free_port

KEY = "disk-sync-test-key"
PROBE = [5, 17, 42, 99, 123, 7, 250, 31, 64, 12, 200, 3]
BUFFER = 40_000  # bytes: the ~0.4 MB tiny model goes over in several shards
PUSHES_SEEN: list[dict] = []  # what `record_push` saw


pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """(client, URL) of one CPU engine for the module; every test compares it with its own trainer after a push."""
    with engine_server(tiny_model_dir, "--api-key", KEY) as (_, url):
        yield EngineClient(url, api_key=KEY), url


def make_args(model_dir, disk_dir, *extra: str):
    return parse_args(
        [
            "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl", "--num-rollout", "2",
            "--rollout-batch-size", "8", "--n-samples-per-prompt", "1", "--loss-type", "sft_loss", "--lr", "1e-2",
            "--update-weight-buffer-size", str(BUFFER),
            "--update-weight-transport", "disk", "--update-weight-disk-dir", str(disk_dir),
            *extra,
        ]
    )  # fmt: skip


def plain_model(weights: dict[str, torch.Tensor], model_dir) -> torch.nn.Module:
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    plain.load_state_dict(weights)
    return plain


def plain_prompt_log_probs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)


def pushed_folders(disk_dir: Path) -> list[Path]:
    return sorted(p for p in disk_dir.iterdir() if p.name.startswith("weights-v"))


def record_push(args, version_dir: str, engines: list) -> None:
    """--custom-update-weight-post-write-path: what is on disk and what the engine serves when it runs."""
    folder = Path(version_dir)
    PUSHES_SEEN.append(
        {
            "folder": folder,
            "files": sorted(p.name for p in folder.iterdir()),
            "engine_version": engines[0].get_model_info()["weight_version"],
        }
    )


def check_folder(folder: Path, model_dir: Path, trainer_weights: dict[str, torch.Tensor]) -> None:
    """A complete HF folder: sharded within the buffer size, indexed, with the checkpoint's config and tokenizer,
    loadable by `from_pretrained` into the trainer's weights."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((folder / name).is_file() for name in shards)
    for name in shards:
        with safe_open(folder / name, framework="pt") as reader:
            sizes = [reader.get_slice(key).get_shape() for key in reader.keys()]
        nbytes = sum(4 * torch.Size(shape).numel() for shape in sizes)
        assert nbytes <= BUFFER or len(sizes) == 1, (name, nbytes)
    for side in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / side).read_bytes() == (model_dir / side).read_bytes()
    assert atomic_dir.is_slime_folder(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for name, tensor in trainer_weights.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert (
        AutoTokenizer.from_pretrained(folder)("1 + 2").input_ids
        == AutoTokenizer.from_pretrained(model_dir)("1 + 2").input_ids
    )


@pytest.mark.parametrize("keep_files", [False, True], ids=["cleaned", "kept"])
def test_disk_push_makes_engine_match_trainer(tiny_model_dir, engine, tmp_path, keep_files):
    client, url = engine
    disk_dir = tmp_path / "sync"
    disk_dir.mkdir()
    # What the user had there, and a staging-like folder slime did not write: all left alone.
    (disk_dir / "notes.txt").write_text("mine")
    (disk_dir / "mine").mkdir()
    (disk_dir / "mine" / "model.safetensors").write_bytes(b"not slime's")
    unmarked = disk_dir / ".weights-v1-0123abcd.slime-tmp-1"
    unmarked.mkdir()
    # The staging folder of a killed push (marked, its process gone): removed when the trainer connects.
    finished = subprocess.Popen(["true"])
    finished.wait()
    leftover = disk_dir / f".weights-v3-89abcdef.slime-tmp-{finished.pid}"
    leftover.mkdir()
    atomic_dir.write_marker(leftover, "weight-sync")

    extra = ["--custom-update-weight-post-write-path", f"{__name__}.record_push"]
    args = make_args(tiny_model_dir, disk_dir, *extra, *(["--update-weight-disk-keep-files"] if keep_files else []))
    actor = FSDPTrainRayActor(1, 0, None, None)
    actor.init(args, "actor")
    actor.connect_rollout_engines([client], [url])
    assert not leftover.exists()
    PUSHES_SEEN.clear()
    before = client.get_model_info()["weight_version"]

    folders = []
    for version in ("1", "2"):
        actor.train(int(version), make_rollout(8, seed=int(version)))
        weights = gather_full_state_dict(actor.model)
        expected = plain_prompt_log_probs(plain_model(weights, tiny_model_dir), PROBE)
        assert (engine_prompt_log_probs(client, PROBE) - expected).abs().max().item() > 1e-2  # the step changed it
        actor.update_weights()
        gap = (engine_prompt_log_probs(client, PROBE) - expected).abs().max().item()
        assert gap < 1e-4, gap
        assert client.get_model_info()["weight_version"] == version
        assert actor.check_weights_equal()["max_abs_diff"] < 1e-4

        # The hook saw the finished folder while the engine still served the previous version.
        seen = PUSHES_SEEN[-1]
        assert "model.safetensors.index.json" in seen["files"] and "config.json" in seen["files"]
        assert seen["engine_version"] == (before if version == "1" else "1")
        folders.append(seen["folder"])
        check_folder(seen["folder"], Path(tiny_model_dir), weights)
        print(f"disk push {version}: log-prob gap {gap:.2e}, {len(seen['files'])} files")

    assert folders[0].name.startswith("weights-v1-") and folders[1].name.startswith("weights-v2-")
    assert pushed_folders(disk_dir) == (sorted(folders) if keep_files else [folders[1]])
    assert not [p for p in disk_dir.iterdir() if ".slime-tmp-" in p.name and p != unmarked]  # no staging left
    assert (disk_dir / "notes.txt").read_text() == "mine"
    assert (disk_dir / "mine" / "model.safetensors").read_bytes() == b"not slime's"
    assert unmarked.is_dir()


@pytest.mark.reliability(
    "--update-weight-disk-dir that cannot be written (a path under a regular file)",
    "connecting the trainer raises, naming --update-weight-disk-dir and the fix; nothing is pushed",
)
def test_unwritable_disk_dir_is_a_clear_error(tiny_model_dir, engine, tmp_path):
    client, url = engine
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    actor = FSDPTrainRayActor(1, 0, None, None)
    actor.init(make_args(tiny_model_dir, blocker / "sync"), "actor")
    version = client.get_model_info()["weight_version"]
    with pytest.raises(ValueError, match=r"--update-weight-disk-dir .*a_file/sync: the trainer cannot write there"):
        actor.connect_rollout_engines([client], [url])
    assert blocker.read_text() == "" and client.get_model_info()["weight_version"] == version


@pytest.mark.reliability(
    "disk sync without --update-weight-disk-dir or with --colocate, disk flags without disk sync, and "
    "--rollout-external-engine-addrs that is not host:port or comes with --colocate, --use-fault-tolerance, "
    "--offload-rollout or --rollout-num-gpus",
    "refused at parse time, naming the flags and the fix",
)
def test_bad_weight_sync_and_external_engine_flags_are_refused(tiny_model_dir, tmp_path):
    base = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", "x.jsonl", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "1"]  # fmt: skip
    disk = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path)]
    external = ["--rollout-external-engine-addrs", "127.0.0.1:30000"]
    refused = {
        "--update-weight-transport disk needs --update-weight-disk-dir": ["--update-weight-transport", "disk"],
        "--update-weight-transport disk does not apply with --colocate": [*disk, "--colocate"],
        "--update-weight-disk-dir, --update-weight-disk-keep-files only take effect with --update-weight-transport "
        "disk": ["--update-weight-disk-dir", str(tmp_path), "--update-weight-disk-keep-files"],
        "--rollout-external-engine-addrs 'localhost' is not host:port": [
            "--rollout-external-engine-addrs",
            "localhost",
        ],
        "'127.0.0.1:http' is not host:port": ["--rollout-external-engine-addrs", "127.0.0.1:http"],
        "drop --colocate, --use-fault-tolerance": [*external, "--colocate", "--use-fault-tolerance"],
        r"drop --offload-rollout \(or --offload\)": [*external, "--offload"],
        "drop --rollout-num-gpus": [*external, "--rollout-num-gpus", "1"],
    }
    for message, flags in refused.items():
        with pytest.raises(ArgumentValidationError, match=message):
            parse_args(base + flags)
    args = parse_args(base + disk + ["--rollout-external-engine-addrs", "127.0.0.1:30000", "http://h2:31000/"])
    assert args.rollout_external_engine_addrs == ["http://127.0.0.1:30000", "http://h2:31000"]
    assert (args.rollout_num_gpus, args.rollout_num_engines) == (0, 2)  # no devices reserved for them


@pytest.mark.reliability(
    "an external engine address where nothing answers",
    "the rollout manager fails after --rollout-engine-start-timeout, naming the address and the flags",
)
def test_unreachable_external_engine_is_a_clear_error():
    url = f"http://127.0.0.1:{find_free_port()}"
    with pytest.raises(TimeoutError, match=rf"--rollout-external-engine-addrs: engine {url} did not answer"):
        wait_for_external_engines([url], timeout=1)


# ---------------------------------------------------------------------------------------------
# World size 2: only rank 0 writes, both ranks gather (real processes, gloo)
# ---------------------------------------------------------------------------------------------


def _ws2_worker(rank: int, port: int, args, shards: list[dict], url: str, out_dir: str) -> None:
    actor = FSDPTrainRayActor(2, rank, "127.0.0.1", port)
    actor.init(args, "actor")
    actor.connect_rollout_engines([EngineClient(url, api_key=KEY)], [url])
    actor.train(1, shards[rank])
    actor.update_weights()
    weights = gather_full_state_dict(actor.model)
    if rank == 0:
        torch.save(weights, f"{out_dir}/weights.pt")


@pytest.mark.slow
def test_world_size_two_disk_push(tiny_model_dir, engine, tmp_path):
    client, url = engine
    disk_dir = tmp_path / "sync"
    args = make_args(tiny_model_dir, disk_dir)
    data = make_rollout(8, seed=3)
    per_sample = {key: value for key, value in data.items() if isinstance(value, list)}
    shards = split_train_data_by_dp(args, per_sample, 2)
    spawn_ranks(_ws2_worker, (find_free_port(), args, shards, url, str(tmp_path)), nprocs=2)
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    expected = plain_prompt_log_probs(plain_model(weights, tiny_model_dir), PROBE)
    gap = (engine_prompt_log_probs(client, PROBE) - expected).abs().max().item()
    assert gap < 1e-4, gap
    assert client.get_model_info()["weight_version"] == "1"
    (folder,) = pushed_folders(disk_dir)
    check_folder(folder, Path(tiny_model_dir), weights)


# ---------------------------------------------------------------------------------------------
# External engines: the RolloutManager starts none, routes to the user's, and the trainer pushes to them
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_external_engine_generates_and_receives_weights(ray_cluster, tiny_model_dir, engine, tmp_path):
    client, url = engine
    prompts = tmp_path / "train.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"What is {a} + {a}?", "label": str(2 * a)}) + "\n" for a in range(4))
    )
    args = parse_args(
        [
            "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(prompts), "--input-key", "prompt",
            "--label-key", "label", "--apply-chat-template", "--rm-type", "math",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2",
            "--rollout-max-response-len", "8", "--loss-type", "sft_loss", "--lr", "1e-2",
            "--rollout-external-engine-addrs", url.removeprefix("http://"), "--sglang-api-key", KEY,
            "--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "sync"),
        ]
    )  # fmt: skip
    manager = create_rollout_manager(args, PlacementSlice(None))
    try:
        engines, urls = ray.get([manager.get_engines.remote(), manager.get_engine_urls.remote()])
        assert urls == [url] and [type(e) for e in engines] == [EngineClient]
        shards = ray.get(ray.get(manager.generate.remote(0, 1)).data_refs)
        (shard,) = shards
        assert len(shard["tokens"]) == 4
        for tokens, length, log_probs in zip(shard["tokens"], shard["response_lengths"], shard["rollout_log_probs"]):
            assert 0 < length <= 8 and len(tokens) > length and len(log_probs) == length

        actor = FSDPTrainRayActor(1, 0, None, None)
        actor.init(args, "actor")
        actor.connect_rollout_engines(engines, urls)
        actor.train(0, shard)
        expected = plain_prompt_log_probs(plain_model(gather_full_state_dict(actor.model), tiny_model_dir), PROBE)
        assert (engine_prompt_log_probs(client, PROBE) - expected).abs().max().item() > 1e-2
        actor.update_weights()
        assert client.get_model_info()["weight_version"] == "1"
        assert (engine_prompt_log_probs(client, PROBE) - expected).abs().max().item() < 1e-4
        # The router serves the new weights: a second rollout goes through.
        assert ray.get(manager.generate.remote(1, 1)).metrics["rollout/response_length"] > 0
    finally:
        ray.get(manager.dispose.remote())
        ray.kill(manager)
    assert client.health()  # slime never stops an engine it did not start
    assert len(pushed_folders(tmp_path / "sync")) == 1
