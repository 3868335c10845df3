"""MoE routing replay (R3): the CPU engine reports the experts it routed every token to, and both trainers replay
them, so their log-probs of a rollout come closer to the engine's.

The rollouts come from a tiny Qwen3-MoE (2 layers, 8 experts, top 2) served by the CPU engine in float32 and in
bfloat16. The trainers compute in float32. With a float32 engine nothing separates the two sides but rounding,
so replay must change nothing (a routing laid out one row off would); with a bfloat16 engine some tokens sit
near a routing tie and the two sides pick different experts, which replay removes.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist
from support.moe import NUM_LAYERS, TOP_K, hf_routing
from support.tiny_model import build_tiny_model
from transformers import AutoModelForCausalLM

from slime.backends.cpu_engine.engine import CpuEngine
from slime.backends.cpu_engine.protocol import RequestError, build_generate_response, parse_generate_request
from slime.utils.arguments import ArgumentValidationError, parse_args
from slime.utils.moe_routing import HFRouters, decode_routed_experts, routing_shape


def _generate(engine: CpuEngine, body: dict) -> list:
    requests, _ = parse_generate_request(body, engine.tokenizer, engine.vocab_size, engine.context_length)
    done, left = threading.Event(), [len(requests)]

    def finished(_request):
        left[0] -= 1
        if not left[0]:
            done.set()

    for request in requests:
        request.on_finish = finished
    engine.submit(requests)
    assert done.wait(120), "the engine did not finish"
    return requests


def engine_rollout(model_dir: str, dtype: torch.dtype) -> dict:
    """Train data of 4 prompts (5 to 14 tokens) x 2 samples of 24 tokens, as the SGLang-shaped answers carry it."""
    engine = CpuEngine(model_dir, dtype=dtype, max_running_requests=16)
    try:
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, 300, (n,), generator=generator).tolist() for n in (5, 9, 14, 7)]
        body = {
            "input_ids": [p for p in prompts for _ in range(2)],
            "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3},
            "return_logprob": True,
            "return_routed_experts": True,
        }
        answers = [build_generate_response(r, engine.tokenizer) for r in _generate(engine, body)]
    finally:
        engine.shutdown()
    tokens = [p + a["output_ids"] for p, a in zip(body["input_ids"], answers, strict=True)]
    lengths = [len(a["output_ids"]) for a in answers]
    n = len(tokens)
    return {
        "tokens": tokens,
        "response_lengths": lengths,
        "rewards": [1.0, -1.0] * (n // 2),
        "raw_reward": [1.0, -1.0] * (n // 2),
        "truncated": [1] * n,
        "loss_masks": [[1] * r for r in lengths],
        "rollout_log_probs": [[lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]] for a in answers],
        "rollout_routed_experts": [
            decode_routed_experts(a["meta_info"]["routed_experts"], NUM_LAYERS, TOP_K) for a in answers
        ],
        "sample_indices": list(range(n)),
        "num_steps": 1,
    }


@pytest.fixture(scope="module")
def rollouts(moe_dir):
    return {"float32": engine_rollout(moe_dir, torch.float32), "bfloat16": engine_rollout(moe_dir, torch.bfloat16)}


def routing_mismatches(model_dir: str, data: dict) -> int:
    """(token, layer) pairs where the engine's experts differ from a float32 forward's."""
    count = 0
    for tokens, routed in zip(data["tokens"], data["rollout_routed_experts"], strict=True):
        mine = hf_routing(model_dir, tokens)[: len(tokens) - 1]
        count += int((mine.sort(-1).values != routed.long().sort(-1).values).any(-1).sum())
    return count


def gap(log_probs: list[torch.Tensor], data: dict) -> tuple[float, float]:
    """Mean and max |trainer - engine| log-prob over the response tokens."""
    diffs = torch.cat([(a - torch.tensor(b)).abs() for a, b in zip(log_probs, data["rollout_log_probs"], strict=True)])
    return float(diffs.mean()), float(diffs.max())


def make_args(model_dir: str, backend: str, *extra: str):
    return parse_args(
        ["--train-backend", backend, "--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl",
         "--num-rollout", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
         "--global-batch-size", "8", "--micro-batch-size", "3", "--lr", "1e-3", "--weight-decay", "0",
         "--use-rollout-routing-replay", *extra]
    )  # fmt: skip


def replayed_and_free_log_probs(actor, rollouts: dict) -> dict:
    """Per rollout: the actor's log-probs with the engines' routing replayed and with its own routing."""
    out = {}
    for name, data in rollouts.items():
        prepared = actor._prepare(data)
        steps = actor._micro_batches(prepared)
        replayed = actor._forward_log_probs(steps, len(prepared["tokens"]), temperature=1.0)
        actor.replay_routing = False  # the same model and micro-batches, its routers choosing
        free = actor._forward_log_probs(steps, len(prepared["tokens"]), temperature=1.0)
        actor.replay_routing = True
        out[name] = {"replayed": replayed, "free": free}
    return out


def _megatron_worker(rank: int, world_size: int, model_dir: str, rollouts: dict) -> dict:
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    actor = MegatronTrainRayActor(1, 0, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    actor.init(make_args(model_dir, "megatron"), "actor")
    return replayed_and_free_log_probs(actor, rollouts)


@pytest.fixture(scope="module")
def trainer_log_probs(moe_dir, rollouts):
    from support.megatron_cpu import run_in_processes

    from slime.backends.fsdp_utils.actor import FSDPTrainRayActor

    megatron = run_in_processes(_megatron_worker, 1, args=(moe_dir, rollouts))[0]
    try:
        actor = FSDPTrainRayActor(1, 0, None, None)
        actor.init(make_args(moe_dir, "fsdp"), "actor")
        fsdp = replayed_and_free_log_probs(actor, rollouts)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"fsdp": fsdp, "megatron": megatron}


def test_engine_reports_the_routing_of_every_token_it_ran(moe_dir, rollouts):
    data = rollouts["float32"]
    for tokens, routed in zip(data["tokens"], data["rollout_routed_experts"], strict=True):
        # prompt + output - 1 rows (the last sampled token never went through the model), SGLang's layout
        assert routed.shape == (len(tokens) - 1, NUM_LAYERS, TOP_K)
        assert routed.min() >= 0 and routed.max() < 8
    # Prompts of different lengths, left-padded, prefilled once per two samples, then decoded in one batch: every
    # row is still the routing of a plain float32 forward over the finished sequence.
    assert routing_mismatches(moe_dir, data) == 0


def test_bfloat16_engine_routes_some_tokens_differently(moe_dir, rollouts):
    """The premise of the gap test below: without it, replay would have nothing to fix."""
    mismatches = routing_mismatches(moe_dir, rollouts["bfloat16"])
    print(f"bfloat16 engine vs float32 forward: {mismatches} (token, layer) routings differ")
    assert mismatches > 0


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_replay_changes_nothing_when_the_routing_agrees(trainer_log_probs, rollouts, backend):
    runs = trainer_log_probs[backend]["float32"]
    for replayed, free in zip(runs["replayed"], runs["free"], strict=True):
        torch.testing.assert_close(replayed, free, atol=1e-5, rtol=0)
    assert gap(runs["replayed"], rollouts["float32"])[1] < 1e-4


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_replay_lowers_the_trainer_engine_log_prob_gap(trainer_log_probs, rollouts, backend):
    runs, data = trainer_log_probs[backend]["bfloat16"], rollouts["bfloat16"]
    (mean_free, max_free), (mean_replay, max_replay) = gap(runs["free"], data), gap(runs["replayed"], data)
    print(
        f"{backend}: |trainer - engine| mean {mean_free:.3e} -> {mean_replay:.3e}, max {max_free:.3e} -> {max_replay:.3e}"
    )
    assert mean_replay < mean_free
    assert max_replay < max_free


def test_both_trainers_replay_the_same_experts(trainer_log_probs):
    for name in ("float32", "bfloat16"):
        pairs = zip(trainer_log_probs["fsdp"][name]["replayed"], trainer_log_probs["megatron"][name]["replayed"])
        for fsdp, megatron in pairs:
            torch.testing.assert_close(fsdp, megatron, atol=1e-4, rtol=0)


def test_fsdp_training_step_with_replay(moe_dir, rollouts):
    """A whole train() on the rollout: its logged gap is the replayed one."""
    from slime.backends.fsdp_utils.actor import FSDPTrainRayActor

    try:
        actor = FSDPTrainRayActor(1, 0, None, None)
        actor.init(make_args(moe_dir, "fsdp"), "actor")
        metrics = actor.train(0, rollouts["bfloat16"])
        with pytest.raises(ValueError, match="rollout_routed_experts"):
            actor.train(1, {k: v for k, v in rollouts["bfloat16"].items() if k != "rollout_routed_experts"})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert metrics["train/grad_norm"] > 0
    print("train/train_rollout_logprob_abs_diff", metrics["train/train_rollout_logprob_abs_diff"])


@pytest.mark.reliability("return_routed_experts sent to an engine serving a dense model", "HTTP 400 naming the field")
def test_dense_engine_refuses_routed_experts(tiny_model_dir):
    engine = CpuEngine(str(tiny_model_dir))
    try:
        with pytest.raises(RequestError, match="return_routed_experts"):
            _generate(engine, {"input_ids": [5, 6], "return_routed_experts": True})
    finally:
        engine.shutdown()


@pytest.mark.reliability("--use-rollout-routing-replay on a dense model or with an agent", "refused at parse time")
def test_flag_refused_where_it_cannot_work(tiny_model_dir, moe_dir):
    with pytest.raises(ArgumentValidationError, match="is a dense model"):
        make_args(str(tiny_model_dir), "fsdp")
    with pytest.raises(ArgumentValidationError, match="agent-function-path"):
        make_args(moe_dir, "fsdp", "--agent-function-path", "examples.x.agent")
    with pytest.raises(ArgumentValidationError, match="--use-rollout-routing-replay"):
        parse_args(
            ["--hf-checkpoint", moe_dir, "--prompt-data", "x.jsonl", "--num-rollout", "1", "--use-routing-replay"]
        )
    assert routing_shape({"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2}) == (2, 2)
    assert routing_shape({"num_hidden_layers": 2}) is None


def test_glm4_moe_routers_are_recorded_and_replayed(tmp_path):
    """GLM-4.5's router (DeepSeek-V3's: sigmoid scores, a bias that only picks, grouped top-k, scaled weights):
    replaying what it picked reproduces the forward; other experts change it."""
    model_dir = build_tiny_model(tmp_path, arch="glm4_moe", num_layers=3)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routers = HFRouters(model, 3)
    tokens = torch.randint(10, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(tokens).logits
    routed = routers.take()
    assert routers.layers == [1, 2] and routed.shape == (12, 3, 2)  # layer 0 is dense
    assert (routed[:, 1:] < 8).all() and (routed[:, 0] == 0).all()

    routers.replay = routed.long()
    with torch.no_grad():
        replayed = model(tokens).logits  # the first replay also checks the weights' rule against the router's
    assert torch.allclose(replayed, plain, atol=1e-5)
    routers.replay = (routed.long() + 1) % 8
    with torch.no_grad():
        moved = model(tokens).logits
    assert (moved - plain).abs().max() > 1e-2
