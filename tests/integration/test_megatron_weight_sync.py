"""Megatron trainer -> CPU engine weight sync against a real engine server process, TP=1, PP=2 and TP=2.

Spawned gloo workers (tests/support/megatron_cpu.py) run the Megatron actor, train a step, and push the
weights to a CPU engine serving the same tiny model: first over the broadcast group, then (after a
second step) through shared-memory tensors. The expected log-probs come from a plain HF model given
the trainer's gathered weights, in the pytest process; the engine and the Megatron forward must
both match it. A recording client counts what the engine received: every HF weight exactly once.
A last test checks the stage forwarding with virtual pipeline chunks, without an engine.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.engines import cpu_engine_process, engine_prompt_log_probs
from support.megatron_actor import hf_model_with, make_args, make_rollout
from support.megatron_cpu import requires_megatron_core, run_in_processes
from support.tiny_model import build_tiny_model

from slime.backends.sglang_utils.http_client import EngineClient

pytestmark = requires_megatron_core

PROBE = [5, 17, 42, 99, 123, 7, 250, 31, 64, 12, 200, 3]
TOLERANCE = 1e-4
TRANSPORTS = ("distributed", "tensor")  # update 1 by broadcast, update 2 by shared-memory tensors


class RecordingClient(EngineClient):
    """A real engine client that also notes what each weight update carried (names, or a count)."""

    def __init__(self, url: str):
        super().__init__(url)
        self.names: list[str] = []
        self.tensor_counts: list[int] = []

    def update_weights_from_distributed(self, names: list[str], **kwargs):
        self.names.extend(names)
        return super().update_weights_from_distributed(names=names, **kwargs)

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], **kwargs):
        response = super().update_weights_from_tensor(serialized_named_tensors=serialized_named_tensors, **kwargs)
        self.tensor_counts.append(int(re.fullmatch(r"updated (\d+) tensors", response["message"]).group(1)))
        return response


def plain_prompt_log_probs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1).float()


def _sync_worker(rank: int, world_size: int, model_dir: str, url: str, extra: tuple) -> dict:
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.data import build_step_micro_batches
    from slime.ray.actor_group import data_parallel_ranks
    from slime.ray.rollout import split_train_data_by_dp

    args = make_args(model_dir, "--update-weight-buffer-size", "40000", *extra)  # several buckets per stage
    actor = MegatronTrainRayActor(world_size, rank, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    actor.init(args, "actor")
    client = RecordingClient(url)
    dp_ranks = data_parallel_ranks(args, world_size)
    probe_steps = build_step_micro_batches([PROBE], [len(PROBE) - 1], 1, 1, None, actor.tp_size, actor.device)
    updates = []
    for version, transport in enumerate(TRANSPORTS, start=1):
        actor.args.colocate = transport == "tensor"  # connect_engines picks the transport from --colocate
        actor.connect_rollout_engines([client], [url])
        rollout = {k: v for k, v in make_rollout(seed=version).items() if isinstance(v, list)}
        actor.train(version, split_train_data_by_dp(args, rollout, max(dp_ranks) + 1)[dp_ranks[rank]])
        update = {"trainer": actor._forward_log_probs(probe_steps, 1, temperature=1.0)[0]}
        if rank == 0:
            update["stale"] = engine_prompt_log_probs(client, PROBE)
        client.names.clear()
        client.tensor_counts.clear()
        actor.update_weights()
        update["check"] = actor.check_weights_equal()["max_abs_diff"]
        update["hf"] = actor.hf_weights()
        update["names"], update["tensor_counts"] = list(client.names), list(client.tensor_counts)
        if rank == 0:
            update["engine"] = engine_prompt_log_probs(client, PROBE)
            update["engine_version"] = client.get_model_info()["weight_version"]
        update["actor_version"] = actor.weight_version
        updates.append(update)
    return {"updates": updates}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with cpu_engine_process(tiny_model_dir) as client_and_url:
        yield client_and_url


@pytest.fixture(scope="module")
def glm4_moe_engine(tmp_path_factory):
    """A GLM-4.5 MoE model (support.tiny_model) and an engine serving it: fused experts on the engine, one tensor
    per expert from the trainer, the router's bias, shared experts."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("glm4_moe"), arch="glm4_moe")
    with cpu_engine_process(model_dir) as client_and_url:
        yield (model_dir, *client_and_url)


@pytest.mark.parametrize(
    "world_size, extra",
    [(1, ()), (2, ("--pipeline-model-parallel-size", "2")), (2, ("--tensor-model-parallel-size", "2"))],
    ids=["tp1", "pp2", "tp2"],
)
def test_update_weights_makes_engine_match_trainer(tiny_model_dir, engine, world_size, extra):
    client, url = engine
    client.update_weights_from_disk(str(tiny_model_dir), weight_version="default")  # undo earlier tests' updates
    check_updates(tiny_model_dir, run_in_processes(_sync_worker, world_size, args=(str(tiny_model_dir), url, extra)))


def test_a_glm4_moe_update_makes_engine_match_trainer(glm4_moe_engine):
    model_dir, _, url = glm4_moe_engine
    check_updates(model_dir, run_in_processes(_sync_worker, 1, args=(str(model_dir), url, ())))


def check_updates(model_dir, results: list[dict]) -> None:
    """Both updates reached the engine whole, and the engine and every rank compute what HF computes with the
    trainer's weights."""
    hf_names = set(load_file(str(Path(model_dir) / "model.safetensors")))
    first = results[0]["updates"]
    for version, (transport, update) in enumerate(zip(TRANSPORTS, first, strict=True), start=1):
        # Every rank (each pipeline stage included) exports the same whole model.
        assert update["hf"].keys() == hf_names
        for other in results[1:]:
            theirs = other["updates"][version - 1]
            assert all(torch.equal(theirs["hf"][name], update["hf"][name]) for name in hf_names)
            assert torch.equal(theirs["trainer"], update["trainer"])
            assert theirs["actor_version"] == version
        # The engine received every weight exactly once (only rank 0 posts with one engine).
        if transport == "distributed":
            assert Counter(update["names"]) == Counter(hf_names)
        else:
            assert sum(update["tensor_counts"]) == len(hf_names)
        assert all(not other["updates"][version - 1]["names"] for other in results[1:])
        assert all(not other["updates"][version - 1]["tensor_counts"] for other in results[1:])

        expected = plain_prompt_log_probs(hf_model_with(model_dir, update["hf"]), PROBE)
        stale_gap = (update["stale"] - expected).abs().max().item()
        engine_gap = (update["engine"] - expected).abs().max().item()
        trainer_gap = (update["trainer"] - expected).abs().max().item()
        print(
            f"{transport} update {version}: stale {stale_gap:.2e}, engine {engine_gap:.2e}, trainer {trainer_gap:.2e}"
        )
        assert stale_gap > 1e-2  # the step really changed what the trainer computes
        assert engine_gap < TOLERANCE and trainer_gap < TOLERANCE
        assert update["check"] < TOLERANCE
        assert update["engine_version"] == str(version) and update["actor_version"] == version


# ----------------------------------------------------------------------------------------------
# Virtual pipeline chunks: each chunk's layers keep their global numbers (no engine needed)
# ----------------------------------------------------------------------------------------------


def _virtual_pipeline_worker(rank: int, world_size: int, model_dir: str) -> dict:
    from slime.backends.megatron_utils.config import config_from_hf
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights
    from slime.backends.megatron_utils.model import build_model, initialize_model_parallel
    from slime.backends.megatron_utils.update_weight import hf_weight_buckets

    initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    args = config_from_hf(model_dir)
    args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage = 2, 1
    model = build_model(args, wrap_with_ddp=False)
    load_hf_weights(model, model_dir)
    layers = [[layer.layer_number - 1 for layer in chunk.decoder.layers] for chunk in model]
    received = {}
    for to_every_rank in (True, False):
        buckets = hf_weight_buckets(model, "llama", args.vocab_size, 20000, to_every_rank=to_every_rank)
        received[to_every_rank] = [(name, tensor.clone()) for bucket in buckets for name, tensor in bucket]
    return {"layers": layers, "received": received}


def test_virtual_pipeline_chunks_forward_every_weight_once(tmp_path):
    model_dir = build_tiny_model(tmp_path / "four_layers", num_layers=4)
    results = run_in_processes(_virtual_pipeline_worker, 2, args=(str(model_dir),))
    # Interleaved: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3.
    assert [r["layers"] for r in results] == [[[0], [2]], [[1], [3]]]
    reference = load_file(str(model_dir / "model.safetensors"))
    # One pipeline group, holding rank 0: both ranks get the whole model either way.
    for rank, result in enumerate(results):
        for to_every_rank, received in result["received"].items():
            names = [name for name, _ in received]
            assert Counter(names) == Counter(reference.keys()), (rank, to_every_rank)
            assert all(torch.equal(tensor, reference[name]) for name, tensor in received)
