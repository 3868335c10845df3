"""`--offload-train` on the Megatron actor (CPU, gloo worker): offload really frees the weights, gradients
and optimizer state (measured in the process's resident size), onload restores them bit for bit, and the
next step matches an actor that never offloaded. Plus the storage helper on its own."""

from __future__ import annotations

import os
import resource
import signal
import tempfile

import numpy as np
import pytest
import torch

from slime.backends.storage_offload import release_storages, restore_storages

HIDDEN = 512  # ~5M parameters: large enough that the freed bytes stand out from the process's noise


def test_release_restores_shared_views_bit_for_bit():
    base = torch.randn(1000)
    views = [base[:10], base[100:200].view(10, 10), base]
    scratch = torch.randn(64)
    expected = base.clone()
    released = release_storages([*views, scratch[:3]])
    grads = release_storages([scratch, base], keep_contents=False)
    assert released.nbytes == (1000 + 64) * 4  # each storage once, however many views
    assert grads.nbytes == 0  # both released above: skipped
    assert base.untyped_storage().nbytes() == 0
    backup_dir = released.backup_dir
    assert os.path.isfile(os.path.join(backup_dir, "storages.bin"))
    restore_storages(grads)
    restore_storages(released)
    assert torch.equal(base, expected) and torch.equal(views[1].flatten(), expected[100:200])
    assert not os.path.exists(backup_dir)  # the backup goes with the restore
    zeroed = release_storages([scratch], keep_contents=False)
    assert zeroed.backup_dir is None
    restore_storages(zeroed)
    assert torch.equal(scratch, torch.zeros(64))


@pytest.mark.reliability(
    "the offload backup cannot be written (disk full)",
    "OSError naming the directory and TMPDIR; every storage already released is restored bit for bit",
)
def test_failed_backup_restores_everything(tmp_path, monkeypatch):
    first, second = torch.randn(4096), torch.randn(4096)  # 16 KiB each; the file may hold 20 KiB
    expected = [first.clone(), second.clone()]
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 1024, hard))
    try:
        with pytest.raises(OSError, match=f"{tmp_path}.*set TMPDIR to a disk with room"):
            release_storages([first, second])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert torch.equal(first, expected[0]) and torch.equal(second, expected[1])
    assert list(tmp_path.iterdir()) == []  # the partial backup is gone


@pytest.mark.reliability(
    "offloading a tensor whose storage cannot be resized (shared with numpy, memory-mapped)",
    "ValueError saying which storages and why, before anything is released",
)
def test_fixed_storage_is_refused_before_releasing_anything():
    resizable, shared = torch.randn(256), torch.from_numpy(np.arange(16, dtype=np.float32))
    with pytest.raises(ValueError, match="1 of 2 storages .64 bytes.: they are not resizable"):
        release_storages([resizable, shared])
    assert resizable.untyped_storage().nbytes() == 256 * 4 and torch.equal(shared, torch.arange(16.0))


def _optimizer_state(actor) -> dict[str, torch.Tensor]:
    inner = actor.optimizer.optimizer
    state = {}
    for g, group in enumerate(inner.param_groups):
        for i, param in enumerate(group["params"]):
            state[f"{g}.{i}.param"] = param.detach().clone()
            for key, value in inner.state[param].items():
                state[f"{g}.{i}.{key}"] = value.clone()
    return state


def _rss() -> int:
    import psutil

    from slime.utils.misc import release_free_host_memory

    release_free_host_memory()
    return psutil.Process().memory_info().rss


def _worker(rank: int, world_size: int, model_dir: str, first: dict, second: dict, extra: tuple) -> dict:
    from support.megatron_actor import make_args, new_megatron_actor

    from slime.ray.rollout import split_train_data_by_dp

    args = make_args(model_dir, *extra)
    # As the driver does: one shard per data-parallel rank (every rank is one here: no model parallelism).
    first, second = (
        split_train_data_by_dp(args, {k: v for k, v in data.items() if isinstance(v, list)}, world_size)[rank]
        for data in (first, second)
    )
    offloaded, _ = new_megatron_actor(rank, world_size, args)
    offloaded.train(0, first)  # Adam's state exists from the first step on
    before = {"weights": offloaded.hf_weights(), "optimizer": _optimizer_state(offloaded)}
    rss_before = _rss()
    offloaded.offload()
    rss_offloaded = _rss()
    sizes = {part: released.nbytes for part, released in offloaded.offloaded.items()}
    # As `update_weights` does while offloaded: the weights come back for the export, then go again.
    exported = offloaded.hf_weights()
    exported_equal = exported.keys() == before["weights"].keys()
    exported_equal &= all(torch.equal(exported[name], tensor) for name, tensor in before["weights"].items())
    del exported
    rss_after_export = _rss()
    offloaded.onload()
    rss_onloaded = _rss()
    after = {"weights": offloaded.hf_weights(), "optimizer": _optimizer_state(offloaded)}
    grads = [chunk_buffer.grad_data.clone() for chunk in offloaded.model for chunk_buffer in chunk.buffers]
    rss = (rss_before, rss_offloaded, rss_after_export, rss_onloaded)
    result = {"sizes": sizes, "rss": rss, "before": before, "after": after, "exported_equal": exported_equal}
    result["grads"] = grads
    result["metrics"] = offloaded.train(1, second)
    result["trained"] = offloaded.hf_weights()
    del offloaded

    plain, _ = new_megatron_actor(rank, world_size, args)
    plain.train(0, first)
    result["plain_metrics"] = plain.train(1, second)
    result["plain_trained"] = plain.hf_weights()
    return result


@pytest.mark.slow
def test_offload_frees_memory_and_restores_bit_for_bit(tmp_path):
    pytest.importorskip("megatron.core")
    from support.megatron_actor import make_rollout
    from support.megatron_cpu import run_in_processes
    from support.tiny_model import build_tiny_model
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / "model", hidden_size=HIDDEN, num_heads=4, num_kv_heads=2)
    result = run_in_processes(_worker, 1, args=(str(model_dir), make_rollout(seed=0), make_rollout(seed=1), ()))[0]

    # Expected sizes from the HF checkpoint: fp32 weights, Adam's two moments, fp32 gradients.
    hf_state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    weight_bytes = sum(t.numel() * 4 for name, t in hf_state.items() if "rotary" not in name)
    vocab = hf_state["model.embed_tokens.weight"].shape[0]
    weight_bytes += 2 * (-vocab % 128) * HIDDEN * 4  # Megatron pads embedding and LM head rows to 128
    sizes = result["sizes"]
    assert sizes["weights"] == weight_bytes
    assert 2 * weight_bytes <= sizes["optimizer"] <= 2 * weight_bytes + 8 * len(hf_state)  # + per-param `step`
    assert weight_bytes <= sizes["grads"] <= 1.1 * weight_bytes  # DDP may pad its buffer
    rss_before, rss_offloaded, rss_after_export, rss_onloaded = result["rss"]
    freed, released = rss_before - rss_offloaded, sum(sizes.values())
    mib = [round(x / 2**20, 1) for x in (released, *result["rss"])]
    print(
        f"released {sizes} = {mib[0]} MiB; RSS {mib[1]} -> {mib[2]} offloaded, {mib[3]} after an export, {mib[4]} MiB onloaded"
    )
    assert freed >= 0.8 * released
    assert result["exported_equal"]  # an export while offloaded sees the weights...
    assert rss_before - rss_after_export >= 0.8 * released  # ...and releases them again
    assert rss_onloaded - rss_offloaded >= 0.8 * released

    _assert_restored_and_same_step(result)


def _assert_restored_and_same_step(result: dict) -> None:
    for part in ("weights", "optimizer"):
        assert result["before"][part].keys() == result["after"][part].keys()
        for name, tensor in result["before"][part].items():
            assert torch.equal(result["after"][part][name], tensor), (part, name)
    assert all(torch.equal(grad, torch.zeros_like(grad)) for grad in result["grads"])

    # The next step is the one an actor that never offloaded takes.
    assert result["metrics"]["train/loss"] == result["plain_metrics"]["train/loss"]
    assert result["metrics"]["train/grad_norm"] == result["plain_metrics"]["train/grad_norm"]
    for name, tensor in result["plain_trained"].items():
        assert torch.equal(result["trained"][name], tensor), name
    assert any(not torch.equal(result["trained"][n], result["after"]["weights"][n]) for n in result["trained"])


@pytest.mark.slow
def test_offload_round_trip_distributed_optimizer(tiny_model_dir):
    """Two data-parallel ranks whose optimizer state is sharded: the main params view DDP's param buffer."""
    pytest.importorskip("megatron.core")
    from support.megatron_actor import make_rollout
    from support.megatron_cpu import run_in_processes

    first, second = make_rollout(seed=0), make_rollout(seed=1)
    for result in run_in_processes(
        _worker, 2, args=(str(tiny_model_dir), first, second, ("--use-distributed-optimizer",))
    ):
        assert result["sizes"]["weights"] > 0 and result["sizes"]["optimizer"] > 0 and result["sizes"]["grads"] > 0
        _assert_restored_and_same_step(result)
