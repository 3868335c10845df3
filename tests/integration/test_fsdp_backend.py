"""FSDP training backend on CPU/gloo: packing, log-probs, reference swap, losses, steps, DP equivalence, critic."""

from __future__ import annotations

import math
import random

import pytest
import torch
from support.fsdp import (
    CAPTURE_HOOK,
    CAPTURED,
    make_args,
    make_rollout,
    new_actor,
    plain_response_log_probs,
)
from support.ranks import spawn_ranks
from transformers import AutoModelForCausalLM

from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
from slime.backends.fsdp_utils.data_packing import (
    pack_micro_batch,
    pack_shared_prompt_rows,
    plan_shared_prompt_micro_batches,
)
from slime.backends.fsdp_utils.model import (
    gather_full_state_dict,
    load_model,
    lr_at_step,
    response_logits,
    snapshot_local_shards,
)
from slime.ray.rollout import split_train_data_by_dp
from slime.utils.http_utils import find_free_port
from slime.utils.micro_batches import group_samples
from slime.utils.ppo_utils import compute_log_probs

pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


# ---------------------------------------------------------------------------------------------
# Packing and log-probs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["packed_row", "shared_prompt_sdpa", "shared_prompt_eager"])
def test_packed_logits_equal_unpacked(tiny_model_dir, layout):
    model = load_model(str(tiny_model_dir)).eval()
    data = make_rollout(7, seed=1, group_size=3)  # prompt groups of 3, 3 and 1 samples
    if layout == "packed_row":
        packed = pack_micro_batch(data["tokens"], data["response_lengths"], list(range(7)))
        assert packed.sequence_lengths == [len(t) for t in data["tokens"]]
    else:
        if layout == "shared_prompt_eager":
            model.set_attn_implementation("eager")
        packed = pack_shared_prompt_rows(
            data["tokens"], data["response_lengths"], [6, 0, 3, 1, 4, 2, 5], additive_mask=layout.endswith("eager")
        )
        assert packed.input_ids.shape[0] == 3  # one row per distinct prompt
        assert packed.sample_indices == [6, 0, 1, 2, 3, 4, 5]  # grouped by prompt, first appearance first
        # FLOPs are counted over each row: its prompt once, then its responses (no padding).
        prompts = [data["tokens"][i][: len(data["tokens"][i]) - data["response_lengths"][i]] for i in (6, 0, 3)]
        responses = [[6], [0, 1, 2], [3, 4, 5]]
        expected = [len(p) + sum(data["response_lengths"][i] for i in r) for p, r in zip(prompts, responses)]
        assert packed.sequence_lengths == expected
    with torch.no_grad():
        packed_logits = response_logits(model, packed)
    row = 0
    worst = 0.0
    ordered = [(data["tokens"][i], data["response_lengths"][i]) for i in packed.sample_indices]
    for tokens, response in ordered:
        with torch.no_grad():
            single = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
        expected = single[len(tokens) - response - 1 : len(tokens) - 1]
        worst = max(worst, (packed_logits[row : row + response] - expected).abs().max().item())
        row += response
    assert row == packed_logits.shape[0]
    # fp32, not exact: packing changes the matmul shapes and so the summation order, and so does the thread
    # count (measured 7e-6 at 1 thread, 1.03e-5 at 2, on logits up to ~6). K * eps for the 128-wide MLP is
    # 1.5e-5 relative, ~1e-4 here; a sample attending across its neighbour moves logits by ~9.
    assert worst < 1e-4, worst
    assert packed.target_tokens.tolist() == [t for tok, r in ordered for t in tok[-r:]]


def test_dynamic_grouping_respects_token_budget():
    lengths = [9, 3, 7, 5, 2, 12]
    groups = group_samples(list(range(6)), lengths, max_tokens=12)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(sum(lengths[i] for i in g) <= 12 for g in groups)
    assert len(groups) == 4  # 38 tokens need at least 4 bins of 12; first-fit decreasing reaches it
    assert group_samples(list(range(5)), [1] * 5, micro_batch_size=2) == [[0, 1], [2, 3], [4]]


def test_shared_prompt_plan_keeps_groups_together_within_budget():
    data = make_rollout(16, seed=7, group_size=4)
    tokens, lengths = data["tokens"], data["response_lengths"]
    prompt_of = [tuple(t[: len(t) - r]) for t, r in zip(tokens, lengths)]
    group_cost = max(len(prompt_of[i]) + sum(lengths[i : i + 4]) for i in range(0, 16, 4))
    budget = group_cost + 5
    (step,) = plan_shared_prompt_micro_batches(tokens, lengths, num_steps=1, max_tokens=budget)
    assert sorted(i for mb in step for i in mb) == list(range(16))
    for micro_batch in step:
        prompts = {prompt_of[i] for i in micro_batch}
        assert sum(map(len, prompts)) + sum(lengths[i] for i in micro_batch) <= budget  # a prompt counts once
        for prompt in prompts:  # every group fits the budget, so none is split
            assert sum(p == prompt for p in prompt_of) == sum(prompt_of[i] == prompt for i in micro_batch)
    # a budget below a group's cost splits the group, each part paying for its prompt
    (small,) = plan_shared_prompt_micro_batches(tokens, lengths, num_steps=1, max_tokens=20)
    for micro_batch in small:
        prompts = {prompt_of[i] for i in micro_batch}
        if len(micro_batch) > 1:
            assert sum(map(len, prompts)) + sum(lengths[i] for i in micro_batch) <= 20


def test_old_log_probs_equal_plain_forward(tiny_model_dir):
    args = make_args(tiny_model_dir, "--rollout-temperature", "0.7", "--rollout-data-postprocess-path", CAPTURE_HOOK)
    actor = new_actor(args)
    data = make_rollout(6, seed=2)
    actor.train(100, data)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for tokens, response, trainer in zip(data["tokens"], data["response_lengths"], CAPTURED[100]["log_probs"]):
        worst = max(worst, (trainer - plain_response_log_probs(plain, tokens, response, 0.7)).abs().max().item())
    assert worst < 1e-5, worst


def test_kl_is_exactly_zero_when_reference_equals_actor(tiny_model_dir):
    args = make_args(
        tiny_model_dir, "--use-kl-loss", "--kl-loss-coef", "0.5", "--rollout-data-postprocess-path", CAPTURE_HOOK
    )
    actor = new_actor(args, with_ref=True)
    metrics = actor.train(101, make_rollout(8, seed=3))
    captured = CAPTURED[101]
    assert all(torch.equal(a, b) for a, b in zip(captured["log_probs"], captured["ref_log_probs"]))
    assert metrics["train/kl_loss"] == 0.0
    assert metrics["train/ppo_kl"] == 0.0
    # After the update the actor moved away from the reference, and the swap restored the actor weights.
    second = actor.train(102, make_rollout(8, seed=3))
    assert second["train/kl_loss"] != 0.0
    assert not all(torch.equal(a, b) for a, b in zip(CAPTURED[102]["log_probs"], CAPTURED[102]["ref_log_probs"]))


def test_bf16_on_cpu_computes_under_autocast_from_float32_weights(tiny_model_dir):
    """--bf16 on CPU: bf16 matmuls with float32 attention, weights and gradients float32, KL still exactly 0."""
    args = make_args(tiny_model_dir, "--bf16", "--use-kl-loss", "--kl-loss-coef", "0.5", "--lr", "1e-3",
                     "--rollout-data-postprocess-path", CAPTURE_HOOK)  # fmt: skip
    actor = new_actor(args, with_ref=True)
    assert actor.model.config._attn_implementation == "sdpa_float32"
    data = make_rollout(8, seed=7)
    before = gather_full_state_dict(actor.model)
    metrics = actor.train(103, data)
    captured = CAPTURED[103]
    assert all(torch.equal(a, b) for a, b in zip(captured["log_probs"], captured["ref_log_probs"]))
    assert metrics["train/ppo_kl"] == 0.0 and metrics["train/kl_loss"] == 0.0
    after = gather_full_state_dict(actor.model)
    assert all(t.dtype == torch.float32 for t in after.values())
    assert any(not torch.equal(before[name], after[name]) for name in before)
    # The log-probs are bf16's (8 significant bits): near the float32 model's (0.02-0.05 nats on this random
    # model), but not equal to them.
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    gaps = [
        (trainer - plain_response_log_probs(plain, tokens, response)).abs().max().item()
        for tokens, response, trainer in zip(data["tokens"], data["response_lengths"], captured["log_probs"])
    ]
    assert 1e-4 < max(gaps) < 0.1, gaps


def noop_hook(args, rollout_id, data):
    """A --rollout-data-postprocess-path hook that changes nothing (forces the separate old-log-prob pass)."""


def test_old_log_probs_from_training_forward_equal_separate_pass(tiny_model_dir):
    """One step per rollout: taking the old log-probs from the training forward changes no number."""
    data = make_rollout(8, seed=6)
    rollout_log_probs = [torch.full((r,), -1.0) for r in data["response_lengths"]]
    results = []
    for extra in ([], ["--rollout-data-postprocess-path", f"{__name__}.noop_hook"]):
        actor = new_actor(make_args(tiny_model_dir, "--lr", "1e-3", "--use-dynamic-batch-size",
                                    "--max-tokens-per-gpu", "40", *extra))  # fmt: skip
        assert actor._can_fuse_old_log_probs(actor._prepare(data)) == (not extra)
        metrics = actor.train(0, dict(data, rollout_log_probs=rollout_log_probs))
        results.append((metrics, gather_full_state_dict(actor.model)))
    (fused, fused_weights), (separate, separate_weights) = results
    assert fused["train/ppo_kl"] == separate["train/ppo_kl"] == 0.0
    for name in ("train/loss", "train/pg_loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff",
                 "train/train_rollout_logprob_max_abs_diff"):  # fmt: skip
        assert fused[name] == separate[name], name
    assert all(torch.equal(fused_weights[name], separate_weights[name]) for name in fused_weights)


# ---------------------------------------------------------------------------------------------
# Optimizer steps
# ---------------------------------------------------------------------------------------------


def test_train_step_changes_weights_and_lowers_loss(tiny_model_dir):
    args = make_args(tiny_model_dir, "--loss-type", "sft_loss", "--lr", "3e-3", "--micro-batch-size", "3")
    actor = new_actor(args)
    data = make_rollout(8, seed=4)
    before = gather_full_state_dict(actor.model)
    losses = [actor.train(i, data)["train/loss"] for i in range(5)]
    after = gather_full_state_dict(actor.model)
    assert any(not torch.equal(before[name], after[name]) for name in before)
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses


def test_grpo_step_moves_probability_towards_rewarded_samples(tiny_model_dir):
    args = make_args(tiny_model_dir, "--lr", "1e-3", "--rollout-data-postprocess-path", CAPTURE_HOOK)
    actor = new_actor(args)
    data = make_rollout(8, seed=5)
    actor.train(110, data)
    actor.train(111, data)
    for old, new, reward in zip(CAPTURED[110]["log_probs"], CAPTURED[111]["log_probs"], data["rewards"]):
        assert (new.mean() - old.mean()).item() * reward > 0


def test_nan_gradient_step_is_skipped(tiny_model_dir):
    args = make_args(tiny_model_dir, "--lr", "1e-3", "--no-check-for-nan-in-loss-and-grad", num_steps=2)
    actor = new_actor(args)
    data = make_rollout(8, seed=6, num_steps=2)
    before = snapshot_local_shards(actor.model)
    hook = actor.model.lm_head.register_forward_hook(lambda module, inputs, output: output * float("nan"))
    metrics = actor.train(0, data)
    hook.remove()
    after = snapshot_local_shards(actor.model)
    assert metrics["train/skipped_steps"] == 2.0
    assert math.isnan(metrics["train/grad_norm"])
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert actor.lr_scheduler.last_epoch == 0 and not actor.optimizer.state
    healthy = actor.train(1, data)
    assert healthy["train/skipped_steps"] == 0.0 and math.isfinite(healthy["train/grad_norm"])
    assert actor.lr_scheduler.last_epoch == 2


@pytest.mark.parametrize("per_token", [False, True])
def test_per_sample_and_per_token_aggregation(tiny_model_dir, per_token):
    extra = ["--loss-type", "sft_loss", "--micro-batch-size", "3"] + (
        ["--calculate-per-token-loss"] if per_token else []
    )
    actor = new_actor(make_args(tiny_model_dir, *extra))
    data = make_rollout(8, seed=7, mask_holes=True)
    reported = actor.train(0, data)["train/loss"]

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    nll_sums, token_counts = [], []
    for tokens, response, mask in zip(data["tokens"], data["response_lengths"], data["loss_masks"]):
        nll = -plain_response_log_probs(plain, tokens, response)
        nll_sums.append(float((nll * torch.tensor(mask, dtype=torch.float32)).sum()))
        token_counts.append(sum(mask))
    per_sample_mean = sum(s / n for s, n in zip(nll_sums, token_counts)) / len(nll_sums)
    token_mean = sum(nll_sums) / sum(token_counts)
    assert abs(per_sample_mean - token_mean) > 1e-3  # unequal lengths make the two differ
    expected = token_mean if per_token else per_sample_mean
    assert reported == pytest.approx(expected, abs=1e-5)


def test_lr_schedule_warmup_and_decay():
    # warm-up 1e-3 * (step + 1) / 4, then cosine from 1e-3 to 1e-4 over steps 4..12
    assert lr_at_step(0, 1e-3, 1e-4, 4, 12, "cosine") == pytest.approx(2.5e-4)
    assert lr_at_step(3, 1e-3, 1e-4, 4, 12, "cosine") == pytest.approx(1e-3)
    assert lr_at_step(8, 1e-3, 1e-4, 4, 12, "cosine") == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half-way: cos = 0
    assert lr_at_step(12, 1e-3, 1e-4, 4, 12, "linear") == pytest.approx(1e-4)
    assert lr_at_step(10, 1e-3, 1e-4, 0, 20, "linear") == pytest.approx(1e-3 - 0.9e-3 * 0.5)
    assert lr_at_step(50, 1e-3, 1e-4, 0, None, "constant") == 1e-3


# ---------------------------------------------------------------------------------------------
# Data parallel: world size 2 == world size 1 (real processes, gloo)
# ---------------------------------------------------------------------------------------------


def _dp_worker(rank: int, world_size: int, port: int, args, shards: list[dict], out_dir: str) -> None:
    actor = FSDPTrainRayActor(world_size, rank, "127.0.0.1", port)
    actor.init(args, "actor", with_ref=True)
    metrics = actor.train(0, shards[rank])
    weights = gather_full_state_dict(actor.model)
    torch.save({"metrics": metrics, "weights": weights}, f"{out_dir}/rank{rank}.pt")


def _run_ranks(world_size: int, args, shards: list[dict], out_dir) -> dict:
    spawn_ranks(_dp_worker, (world_size, find_free_port(), args, shards, str(out_dir)), world_size)
    return torch.load(f"{out_dir}/rank0.pt", weights_only=False)


def test_world_size_two_matches_world_size_one(tiny_model_dir, tmp_path):
    common = ["--lr", "1e-3", "--use-kl-loss", "--kl-loss-coef", "0.1", "--entropy-coef", "0.01"]
    data = make_rollout(8, seed=8, num_steps=2)
    single_args = make_args(tiny_model_dir, *common, "--micro-batch-size", "3", num_steps=2)
    dual_args = make_args(
        tiny_model_dir, *common, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "24", num_steps=2
    )
    (tmp_path / "ws1").mkdir()
    (tmp_path / "ws2").mkdir()
    single = _run_ranks(1, single_args, [data], tmp_path / "ws1")
    per_sample = {key: value for key, value in data.items() if isinstance(value, list)}
    dual = _run_ranks(2, dual_args, split_train_data_by_dp(dual_args, per_sample, 2), tmp_path / "ws2")
    for name in ("train/loss", "train/pg_loss", "train/kl_loss", "train/entropy"):
        assert dual["metrics"][name] == pytest.approx(single["metrics"][name], abs=1e-5), name
    # The norm (~13) sums squares over ~100k float32 entries in a different order per layout.
    assert dual["metrics"]["train/grad_norm"] == pytest.approx(single["metrics"]["train/grad_norm"], rel=1e-5)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    moved = max((single["weights"][n] - initial[n]).abs().max().item() for n in initial)
    worst = max((single["weights"][n] - dual["weights"][n]).abs().max().item() for n in initial)
    # Adam divides each gradient entry by its own scale, so entries whose gradient is at float noise
    # level move by up to lr either way; the updates themselves agree to a few percent of their size.
    assert worst < 0.05 * moved, (worst, moved)
    print(
        f"ws2 vs ws1: loss {dual['metrics']['train/loss']} vs {single['metrics']['train/loss']}, "
        f"grad norm {dual['metrics']['train/grad_norm']} vs {single['metrics']['train/grad_norm']}, weights {worst:.2e} "
        f"(moved {moved:.2e})"
    )


# ---------------------------------------------------------------------------------------------
# Critic and PPO
# ---------------------------------------------------------------------------------------------


def test_critic_value_loss_decreases(tiny_model_dir):
    args = make_args(tiny_model_dir, "--advantage-estimator", "ppo", "--lr", "1e-2", "--value-clip", "0.5")
    critic = new_actor(args, role="critic")
    data = make_rollout(8, seed=9)
    losses = []
    for rollout_id in range(6):
        values = critic.compute_values(data)
        assert [len(v) for v in values] == data["response_lengths"]
        losses.append(critic.train(rollout_id, data)["value_loss"])
    assert losses[-1] < 0.5 * losses[0], losses


def test_ppo_actor_uses_critic_values_in_gae(tiny_model_dir):
    args = make_args(
        tiny_model_dir, "--advantage-estimator", "ppo", "--lr", "1e-3", "--rollout-data-postprocess-path", CAPTURE_HOOK
    )
    critic = new_actor(args, role="critic")
    actor = new_actor(args)
    data = make_rollout(8, seed=10)
    critic.train(0, data)  # move the value head off zero so the values matter
    values = critic.compute_values(data)
    metrics = actor.train(120, data, values_refs=values)
    assert all(math.isfinite(v) for v in metrics.values())
    # gamma = lambda = 1, no KL: the return of every token is the reward, so A_t = reward - V_t.
    for advantages, value, reward in zip(CAPTURED[120]["advantages"], values, data["rewards"]):
        assert torch.allclose(advantages, reward - torch.tensor(value), atol=1e-5)
    assert any(abs(v) > 1e-3 for sample in values for v in sample)


# ---------------------------------------------------------------------------------------------
# Other estimators, TIS, rollout log-probs, custom loss
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_other_estimators_train(tiny_model_dir, estimator):
    args = make_args(
        tiny_model_dir,
        "--advantage-estimator",
        estimator,
        "--lr",
        "1e-3",
        "--rollout-data-postprocess-path",
        CAPTURE_HOOK,
        num_steps=2,
    )
    actor = new_actor(args)
    data = make_rollout(8, seed=11, num_steps=2, mask_holes=True)
    for rollout_id in (140, 141):
        metrics = actor.train(rollout_id, data)
        assert all(math.isfinite(value) for value in metrics.values()), metrics
        assert 0.0 <= metrics["train/pg_clipfrac"] <= 1.0
    assert metrics["train/ppo_kl"] != 0.0  # the second step of each rollout saw updated weights
    if args.normalize_advantages:  # turned on for the REINFORCE++ estimators
        advantages = torch.cat(CAPTURED[141]["advantages"])
        mask = torch.cat([torch.tensor(m, dtype=torch.float32) for m in data["loss_masks"]])
        mean = (advantages * mask).sum() / mask.sum()
        variance = ((advantages - mean) ** 2 * mask).sum() / mask.sum()
        assert abs(mean.item()) < 1e-5 and variance.item() == pytest.approx(1.0, abs=1e-4)


def test_tis_weights_the_policy_loss(tiny_model_dir):
    data = make_rollout(8, seed=12)
    rng = random.Random(12)
    data["rollout_log_probs"] = [[-rng.uniform(3.0, 8.0) for _ in range(r)] for r in data["response_lengths"]]
    args = make_args(tiny_model_dir, "--use-tis", "--tis-clip", "1.5", "--rollout-data-postprocess-path", CAPTURE_HOOK)
    metrics = new_actor(args).train(150, data)
    old = CAPTURED[150]["log_probs"]

    # By hand: w = clamp(exp(old - rollout), 0, 1.5); at the first step ratio = 1, so the
    # per-token loss is -A * w, averaged per sample then over samples.
    diff_sum = weight_sum = count = 0.0
    sample_losses = []
    for old_lp, rollout_lp, reward in zip(old, data["rollout_log_probs"], data["rewards"]):
        weights = torch.exp(old_lp - torch.tensor(rollout_lp)).clamp(0.0, 1.5)
        diff_sum += (old_lp - torch.tensor(rollout_lp)).abs().sum().item()
        weight_sum += weights.sum().item()
        count += len(rollout_lp)
        sample_losses.append((-reward * weights).mean().item())
    assert metrics["train/train_rollout_logprob_abs_diff"] == pytest.approx(diff_sum / count, rel=1e-5)
    assert metrics["train/tis_weight_mean"] == pytest.approx(weight_sum / count, rel=1e-5)
    assert metrics["train/pg_loss"] == pytest.approx(sum(sample_losses) / len(sample_losses), abs=1e-5)


def test_use_rollout_logprobs_skips_recomputation(tiny_model_dir):
    data = make_rollout(8, seed=13)
    data["rollout_log_probs"] = [[-2.0] * r for r in data["response_lengths"]]
    args = make_args(tiny_model_dir, "--use-rollout-logprobs", "--rollout-data-postprocess-path", CAPTURE_HOOK)
    metrics = new_actor(args).train(160, data)
    assert [lp.tolist() for lp in CAPTURED[160]["log_probs"]] == data["rollout_log_probs"]
    assert "train/train_rollout_logprob_abs_diff" not in metrics
    assert metrics["train/ppo_kl"] != 0.0  # the engine's log-probs are not the trainer's


def nll_custom_loss(args, batch, logits, sum_of_sample_mean):
    """--custom-loss-function-path example: negative log-likelihood, through the given reducer."""
    log_probs = torch.split(compute_log_probs(logits, batch["target_tokens"]), batch["response_lengths"])
    loss = sum_of_sample_mean([-lp for lp in log_probs])
    return loss, {"nll": loss.detach()}


def test_custom_loss_hook(tiny_model_dir):
    data = make_rollout(8, seed=14, num_steps=2)
    custom = make_args(
        tiny_model_dir,
        "--loss-type",
        "custom_loss",
        "--custom-loss-function-path",
        f"{__name__}.nll_custom_loss",
        "--micro-batch-size",
        "3",
        num_steps=2,
    )
    builtin = make_args(tiny_model_dir, "--loss-type", "sft_loss", num_steps=2)
    custom_metrics = new_actor(custom).train(0, data)
    builtin_metrics = new_actor(builtin).train(0, data)
    assert custom_metrics["train/loss"] == pytest.approx(builtin_metrics["train/loss"], abs=1e-6)
    assert custom_metrics["train/nll"] == pytest.approx(custom_metrics["train/loss"], abs=1e-7)
    assert custom_metrics["train/grad_norm"] == pytest.approx(builtin_metrics["train/grad_norm"], rel=1e-5)


def test_gradient_checkpointing_and_offload_round_trip_do_not_change_training(tiny_model_dir):
    data = make_rollout(8, seed=15, num_steps=2)
    timing = ("train/step_time", "train/tokens_per_s")
    plain = new_actor(make_args(tiny_model_dir, "--lr", "1e-3", num_steps=2))
    checkpointed = new_actor(make_args(tiny_model_dir, "--lr", "1e-3", "--gradient-checkpointing", num_steps=2))
    assert checkpointed.model.model.layers[0].gradient_checkpointing
    for rollout_id in range(2):
        checkpointed.offload()  # what the driver does around generation with --offload-train
        checkpointed.onload()
        expected, got = plain.train(rollout_id, data), checkpointed.train(rollout_id, data)
        for name, value in expected.items():
            if name not in timing and not name.startswith("perf/"):
                assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
