"""Megatron training actor on CPU (gloo workers with the CPU patch): init from HF, log-probs, a train
step, HF export of the trained weights, save/load, TP=2.

The HF reference forwards run in the pytest process; the actor runs in spawned workers
(tests/support/megatron_cpu.py), the only place the CPU patch is applied.
"""

from __future__ import annotations

import pytest
import torch
from support.megatron_actor import hf_model_with, make_args, make_rollout, new_megatron_actor
from support.megatron_cpu import requires_megatron_core, run_in_processes
from transformers import AutoModelForCausalLM

pytestmark = requires_megatron_core

TOLERANCE = 1e-4
VOCAB = 320


def _log_probs(actor, data: dict) -> list[torch.Tensor]:
    """Log-probs of the samples this rank's data-parallel group trains on, in rollout order."""
    prepared = actor._prepare(data)
    values = actor._forward_log_probs(actor._micro_batches(prepared), len(prepared["tokens"]), temperature=1.0)
    return [value for _, value in sorted(zip(prepared["sample_indices"], values, strict=True))]


def _worker(rank: int, world_size: int, model_dir: str, save_dir: str, rollout: dict, extra: tuple) -> dict:
    from slime.ray.actor_group import data_parallel_ranks
    from slime.ray.rollout import split_train_data_by_dp

    args = make_args(model_dir, "--save", save_dir, *extra)
    # As the driver and RayTrainGroup do: one shard per data-parallel rank, shared by its TP group.
    per_sample = {key: value for key, value in rollout.items() if isinstance(value, list)}
    dp_ranks = data_parallel_ranks(args, world_size)
    data = split_train_data_by_dp(args, per_sample, max(dp_ranks) + 1)[dp_ranks[rank]]
    actor, start = new_megatron_actor(rank, world_size, args)
    result = {"start": start, "initial_log_probs": _log_probs(actor, data), "initial_hf": actor.hf_weights()}
    result["metrics"] = actor.train(0, data)
    result["trained_hf"] = actor.hf_weights()
    result["trained_log_probs"] = _log_probs(actor, data)
    actor.save_model(0)
    # A second run resumes from --load and must see exactly the saved weights.
    resumed, resumed_start = new_megatron_actor(rank, world_size, make_args(model_dir, "--load", save_dir, *extra))
    result["resumed_start"] = resumed_start
    result["resumed_hf"] = resumed.hf_weights()
    result["resumed_lr_steps"] = resumed.lr_scheduler.num_steps
    return result


def hf_log_probs(model, data: dict) -> list[torch.Tensor]:
    """Reference: each sequence alone through the HF model, log_softmax at the response positions."""
    out = []
    with torch.no_grad():
        for tokens, response in zip(data["tokens"], data["response_lengths"], strict=True):
            logits = model(input_ids=torch.tensor([tokens])).logits[0]
            start = len(tokens) - response
            log_probs = torch.log_softmax(logits[start - 1 : len(tokens) - 1].double(), dim=-1)
            out.append(log_probs.gather(-1, torch.tensor(tokens[start:]).unsqueeze(-1)).squeeze(-1).float())
    return out


def max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    data = make_rollout()
    root = tmp_path_factory.mktemp("megatron_actor")
    tp1 = run_in_processes(_worker, 1, args=(str(tiny_model_dir), str(root / "tp1"), data, ()))
    tp2 = run_in_processes(
        _worker, 2, args=(str(tiny_model_dir), str(root / "tp2"), data, ("--tensor-model-parallel-size", "2"))
    )
    return data, tp1[0], tp2


def test_init_log_probs_match_hf(tiny_model_dir, runs):
    data, tp1, _ = runs
    reference = hf_log_probs(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(), data)
    assert tp1["start"] == 0
    gap = max_gap(tp1["initial_log_probs"], reference)
    print(f"init: max |megatron - hf| log-prob = {gap:.2e}")
    assert gap < TOLERANCE
    # The initial export is the HF checkpoint itself.
    hf_state = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    for name, tensor in tp1["initial_hf"].items():
        assert torch.equal(tensor, hf_state[name]), name


def test_train_step_changes_weights_and_export_matches(tiny_model_dir, runs):
    data, tp1, _ = runs
    metrics = tp1["metrics"]
    for name in ("train/loss", "train/pg_loss", "train/ppo_kl", "train/entropy", "train/grad_norm", "train/lr"):
        assert name in metrics and torch.isfinite(torch.tensor(metrics[name])), name
    assert metrics["train/ppo_kl"] == 0.0  # first step: old log-probs are the current policy's, bit for bit
    assert metrics["train/grad_norm"] > 0
    changed = [n for n in tp1["trained_hf"] if not torch.equal(tp1["trained_hf"][n], tp1["initial_hf"][n])]
    assert len(changed) == len(tp1["trained_hf"])
    # The exported (sync) weights in an HF model reproduce the trained Megatron model's log-probs.
    reference = hf_log_probs(hf_model_with(tiny_model_dir, tp1["trained_hf"]), data)
    gap = max_gap(tp1["trained_log_probs"], reference)
    print(f"after a step: max |megatron - hf(exported)| log-prob = {gap:.2e}")
    assert gap < TOLERANCE
    assert max_gap(tp1["trained_log_probs"], tp1["initial_log_probs"]) > 1e-3


def test_save_load_round_trip(runs):
    _, tp1, tp2 = runs
    for result in [tp1, *tp2]:
        assert result["resumed_start"] == 1
        assert result["resumed_lr_steps"] == 1
        assert result["resumed_hf"].keys() == result["trained_hf"].keys()
        for name in result["trained_hf"]:
            assert torch.equal(result["resumed_hf"][name], result["trained_hf"][name]), name


def test_tp2_matches_tp1(runs):
    _, tp1, tp2 = runs
    for rank, result in enumerate(tp2):
        gap = max_gap(result["initial_log_probs"], tp1["initial_log_probs"])
        print(f"TP=2 rank {rank}: max |tp2 - tp1| log-prob = {gap:.2e}")
        assert gap < TOLERANCE
        for name in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
            assert abs(result["metrics"][name] - tp1["metrics"][name]) < TOLERANCE, name
        assert max_gap(result["trained_log_probs"], tp1["trained_log_probs"]) < TOLERANCE


def test_zigzag_positions_cover_each_token_once():
    from slime.backends.megatron_utils.cp_utils import zigzag_positions

    bounds = [0, 8, 12]  # two sequences of 8 and 4 tokens, CP=2: chunks of 2 and 1 tokens
    ranks = [zigzag_positions(bounds, 2, rank).tolist() for rank in range(2)]
    # By hand: rank 0 keeps chunks 0 and 3 of each sequence, rank 1 chunks 1 and 2.
    assert ranks[0] == [0, 1, 6, 7, 8, 11]
    assert ranks[1] == [2, 3, 4, 5, 9, 10]
    with pytest.raises(ValueError, match="sequence_pad_multiple=4"):
        zigzag_positions([0, 6], 2, 0)


def test_packing_pads_and_masks():
    from slime.backends.megatron_utils.data import pack_micro_batch

    batch = pack_micro_batch([[5, 6, 7], [8, 9]], [1, 1], [0, 1], pad_multiple=4)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 8]
    assert batch.logit_positions.tolist() == [1, 3] and batch.target_tokens.tolist() == [7, 9]
    mask = batch.attention_mask()[0, 0]
    assert not mask[4, 3] and mask[4, 2] and mask[3, 4]  # own sequence only, causal
