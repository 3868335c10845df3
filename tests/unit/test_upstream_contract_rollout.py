"""Upstream's rollout-side contract, as its plugins (search-r1, multi_agent, on-policy distillation) use it: `Sample`
bookkeeping, per-sample generate / reward paths, `GenerateState`, the filter hub and empty generations."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from argparse import Namespace

import pytest
import torch
from support.flags import slime_flags

from slime.rollout import sglang_rollout
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn
from slime.rollout.filter_hub import (
    DynamicFilterOutput,
    MetricGatherer,
    call_dynamic_filter,
    should_drop_dynamic_filter_output,
)
from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std_with_fallback
from slime.utils.arguments import parse_args
from slime.utils.misc import load_function
from slime.utils.moe_routing import encode_routed_experts
from slime.utils.types import Sample, Status

MODULE = __name__


def int32_base64(values: list[int]) -> str:
    """How SGLang sends an int32 array in `meta_info`."""
    return base64.b64encode(b"".join(v.to_bytes(4, "little", signed=True) for v in values)).decode("ascii")


# ---- Sample.append_response_tokens -----------------------------------------------------------------------------
def test_append_response_tokens_keeps_a_multi_turn_sample_aligned():
    args = slime_flags(sglang_speculative_algorithm="EAGLE")
    sample = Sample(index=0, tokens=[1, 2, 3])
    first_turn = {"finish_reason": {"type": "stop"}, "weight_version": 4, "prompt_tokens": 3, "cached_tokens": 1,
                  "completion_tokens": 2, "spec_accept_token_num": 1, "spec_draft_token_num": 4, "spec_verify_ct": 1}  # fmt: skip
    sample.append_response_tokens(args, tokens=[10, 11], log_probs=[-0.1, -0.2], meta_info=first_turn, text="hi")
    sample.append_response_tokens(args, tokens=[20, 21, 22], trainable=False, text="<obs>")
    second_turn = {"finish_reason": {"type": "length"}, "weight_version": "5", "prompt_tokens": 8, "cached_tokens": 5,
                   "completion_tokens": 1, "spec_accept_token_num": 2, "spec_draft_token_num": 4, "spec_verify_ct": 3}  # fmt: skip
    sample.append_response_tokens(
        args, tokens=torch.tensor([30]), log_probs=torch.tensor([-0.5]), meta_info=second_turn
    )

    assert sample.tokens == [1, 2, 3, 10, 11, 20, 21, 22, 30] and sample.response == "hi<obs>"
    assert sample.response_length == 6 and sample.prompt_length == 3
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1] and sample.effective_response_length == 3
    assert sample.rollout_log_probs == pytest.approx([-0.1, -0.2, 0.0, 0.0, 0.0, -0.5])
    assert sample.status is Status.TRUNCATED and sample.weight_versions == ["4", "5"]
    assert (sample.prefix_cache_info.cached_tokens, sample.prefix_cache_info.total_prompt_tokens) == (6, 11)
    assert sample.prefix_cache_info.prefix_cache_hit_rate == pytest.approx(6 / 11)
    assert sample.spec_info.spec_accept_rate == pytest.approx(3 / 8)
    assert sample.spec_info.spec_accept_length == pytest.approx(3 / 4)

    # Without speculative decoding nothing is counted; a streaming chunk (no terminal info) leaves the status be.
    plain = Sample(index=1, tokens=[1])
    plain.append_response_tokens(slime_flags(), tokens=[2], log_probs=[-1.0], meta_info=first_turn)
    assert plain.spec_info == Sample.SpecInfo() and plain.status is Status.COMPLETED
    plain.append_response_tokens(None, tokens=[3], log_probs=[-1.0], meta_info=second_turn, update_terminal_info=False)
    assert plain.status is Status.COMPLETED and plain.weight_versions == ["4"]


def test_append_response_tokens_replays_top_p_spans():
    sample = Sample(index=0, tokens=[1])
    # Token 10 kept {10, 12}, token 11 kept {11}.
    meta = {"top_p_token_ids": int32_base64([10, 12, 11]), "top_p_token_offsets": int32_base64([0, 2, 3])}
    sample.append_response_tokens(tokens=[10, 11], log_probs=[-0.1, -0.2], meta_info=meta)
    sample.append_response_tokens(tokens=[99, 98], trainable=False)  # tool output: empty spans
    sample.append_response_tokens(
        tokens=[7], log_probs=[-0.3], meta_info={"top_p_kept_token_ids": [7, 8], "top_p_kept_token_offsets": [0, 2]}
    )
    assert sample.rollout_top_p_token_ids == [10, 12, 11, 7, 8]
    assert sample.rollout_top_p_token_offsets == [0, 2, 3, 3, 3, 5]
    offsets = sample.rollout_top_p_token_offsets
    spans = [sample.rollout_top_p_token_ids[offsets[i] : offsets[i + 1]] for i in range(sample.response_length)]
    assert spans == [[10, 12], [11], [], [], [7, 8]]

    # Tool output before the first nucleus gets empty spans too.
    late = Sample(index=1)
    late.append_response_tokens(tokens=[5], trainable=False)
    late.append_response_tokens(
        tokens=[6], log_probs=[-1.0], meta_info={"top_p_token_ids": [6], "top_p_token_offsets": [0, 1]}
    )
    assert (late.rollout_top_p_token_ids, late.rollout_top_p_token_offsets) == ([6], [0, 0, 1])


def test_append_response_tokens_reads_routed_experts():
    routed = torch.arange(3 * 2 * 2).reshape(3, 2, 2)
    sample = Sample(index=0, tokens=[1, 2])
    meta = {"routed_experts": encode_routed_experts(routed), "finish_reason": {"type": "stop"}}
    sample.append_response_tokens(
        slime_flags(num_layers=2, moe_router_topk=2), tokens=[3, 4], log_probs=[0.0, 0.0], meta_info=meta
    )
    assert torch.equal(sample.rollout_routed_experts.long(), routed)


@pytest.mark.parametrize(
    "setup, call, message",
    [
        (dict(), dict(tokens=[1, 2]), "trainable tokens need their log_probs"),
        (dict(), dict(tokens=[1], log_probs=[0.0], trainable=False), "take no log_probs"),
        (dict(), dict(tokens=[1, 2], log_probs=[0.0]), "1 log_probs for 2 tokens"),
        (dict(tokens=[1, 2], response_length=1), dict(tokens=[3], log_probs=[0.0]), "no rollout_log_probs"),
        (dict(), dict(tokens=[1], log_probs=[0.0], meta_info={"top_p_token_ids": [1]}), "only one of the top-p"),
        (
            dict(),
            dict(tokens=[1], log_probs=[0.0], meta_info={"top_p_token_ids": [1], "top_p_token_offsets": [0, 2]}),
            "do not describe 1 ids over 1 tokens",
        ),  # fmt: skip
        (
            dict(response_length=1, tokens=[1], loss_mask=[1, 1], rollout_log_probs=[0.0]),
            dict(tokens=[2], trainable=False),
            "loss_mask has 3 entries for 2 response tokens",
        ),  # fmt: skip
    ],
)
def test_append_response_tokens_refuses_misaligned_input(setup, call, message):
    with pytest.raises(ValueError, match=message):
        Sample(index=0, **setup).append_response_tokens(**call)


def test_to_dict_round_trip_keeps_user_attributes(tmp_path):
    sample = Sample(index=2, prompt="q", tokens=[1, 2], response_length=1, reward={"score": 1.0, "teacher": [0.5]},
                    multimodal_inputs={"images": []}, apply_chat_template_kwargs={"enable_thinking": False},
                    generate_function_path="pkg.gen", custom_rm_path="pkg.rm", rollout_top_p_token_ids=[4],
                    rollout_top_p_token_offsets=[0, 1], status=Status.TRUNCATED)  # fmt: skip
    sample.spec_info.add({"spec_accept_token_num": 3, "spec_draft_token_num": 6})
    sample.prefix_cache_info.add({"cached_tokens": 1, "prompt_tokens": 2})
    sample.turns, sample.tool_calls = ["t1", "t2"], 2  # upstream plugins hang their own data on samples
    data = sample.to_dict()
    assert data["status"] == "truncated" and data["turns"] == ["t1", "t2"]
    assert data["spec_info"]["spec_accept_token_num"] == 3 and data["prefix_cache_info"] == {
        "cached_tokens": 1,
        "total_prompt_tokens": 2,
    }
    torch.save(data, tmp_path / "s.pt")  # as --save-debug-rollout-data writes it
    restored = Sample.from_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert restored == sample and (restored.turns, restored.tool_calls) == (["t1", "t2"], 2)
    assert restored.status is Status.TRUNCATED and restored.spec_info.spec_accept_rate == 0.5
    # A dump from before these fields loads with their defaults.
    old = {k: v for k, v in data.items() if k not in ("spec_info", "prefix_cache_info", "custom_rm_path")}
    assert Sample.from_dict(old).custom_rm_path is None and Sample.from_dict(old).spec_info == Sample.SpecInfo()


# ---- call_rollout_fn and the filter hub ------------------------------------------------------------------------
def test_call_rollout_fn_wraps_legacy_outputs():
    seen = []

    def legacy(args, rollout_id, data_source, evaluation=False):
        seen.append((rollout_id, evaluation))
        return {"toy": {"rewards": [1.0]}} if evaluation else [[Sample(index=0)]]

    train = call_rollout_fn(legacy, None, 3, None, evaluation=False)
    assert isinstance(train, RolloutFnTrainOutput) and train.samples[0][0].index == 0 and train.metrics == {}
    evaluation = call_rollout_fn(legacy, None, 4, None, evaluation=True)
    assert isinstance(evaluation, RolloutFnEvalOutput) and evaluation.data == {"toy": {"rewards": [1.0]}}
    assert seen == [(3, False), (4, True)]
    made = RolloutFnTrainOutput(samples=[], metrics={"m": 1.0})
    assert call_rollout_fn(lambda *a, evaluation: made, evaluation=False) is made


def test_dynamic_filter_helpers():
    assert call_dynamic_filter(None, slime_flags(), []) == DynamicFilterOutput(keep=True)
    assert call_dynamic_filter(lambda args, samples: False, slime_flags(), []) == DynamicFilterOutput(keep=False)
    assert call_dynamic_filter(lambda args, samples: DynamicFilterOutput(False, "x"), slime_flags(), []).reason == "x"

    drop, fallback = DynamicFilterOutput(False, "zero"), DynamicFilterOutput(False, "zero", keep_when_insufficient=True)
    assert should_drop_dynamic_filter_output(drop, remaining_batch_size=1, target_data_size=4)
    assert not should_drop_dynamic_filter_output(fallback, remaining_batch_size=4, target_data_size=4)
    assert should_drop_dynamic_filter_output(fallback, remaining_batch_size=5, target_data_size=4)
    assert not should_drop_dynamic_filter_output(DynamicFilterOutput(True), remaining_batch_size=9, target_data_size=1)

    gatherer = MetricGatherer()
    for reason in ("zero", "zero", None, "broken"):
        gatherer.on_dynamic_filter_drop(reason)
    assert gatherer.collect() == {"rollout/dynamic_filter/drop_zero": 2.0, "rollout/dynamic_filter/drop_broken": 1.0}

    same = [Sample(index=i, reward=1.0) for i in range(2)]
    verdict = check_reward_nonzero_std_with_fallback(slime_flags(), same)
    assert (verdict.keep, verdict.keep_when_insufficient) == (False, True)
    unscored = check_reward_nonzero_std_with_fallback(slime_flags(), [Sample(index=0), Sample(index=1, reward=1.0)])
    assert (unscored.keep, unscored.keep_when_insufficient) == (False, False)  # never stands in for a good group


# ---- the default rollout with user generate / reward functions -------------------------------------------------
CALLS: list[tuple[str, int, dict]] = []
GATE: dict[str, asyncio.Event] = {}


async def two_token_generate(args, sample, sampling_params):
    """A generate function as upstream's agents write one: append the engine's tokens and meta_info."""
    CALLS.append(("two_token", sample.index, dict(sampling_params)))
    meta = {"finish_reason": {"type": "stop"}, "weight_version": "1"}
    sample.append_response_tokens(args, tokens=[5, 6], log_probs=[-0.5, -0.25], meta_info=meta, text="ab")
    return sample


async def own_generate(args, sample, sampling_params, evaluation=False):
    CALLS.append(("own", sample.index, dict(sampling_params)))
    sample.append_response_tokens(args, tokens=[7], log_probs=[-1.0], meta_info={"finish_reason": {"type": "length"}})
    sample.metadata["evaluation"] = evaluation
    return sample


async def nothing_for_odd_prompts(args, sample, sampling_params):
    """Upstream's multi-agent shape: a list of samples, empty when the agents produced nothing."""
    return [] if sample.group_index % 2 else [await two_token_generate(args, sample, sampling_params)]


async def never_anything(args, sample, sampling_params):
    return []


async def blocking_generate(args, sample, sampling_params):
    CALLS.append(("blocking", sample.index, {}))
    GATE["started"].set()
    await GATE["release"].wait()
    return await two_token_generate(args, sample, sampling_params)


async def reward_by_index(args, sample):
    return float(sample.index % 2)


async def constant_reward(args, sample):
    return 1.0


async def own_reward(args, sample):
    return 7.0


@pytest.fixture
def rollout_args(tiny_model_dir, tmp_path, monkeypatch):
    """Parsed arguments for the default rollout over 12 prompts, with a fresh rollout state."""
    monkeypatch.setattr(sglang_rollout, "_STATE", None)
    CALLS.clear()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"what is {i} + 1?"}) + "\n" for i in range(12)))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"input": "what is 2 + 2?"}) + "\n")

    def make(*extra: str) -> Namespace:
        sglang_rollout._STATE = None  # the state is made once per process, from the args it first sees
        return parse_args([
            "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(prompts), "--num-rollout", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
            "--custom-generate-function-path", f"{MODULE}.two_token_generate",
            "--custom-rm-path", f"{MODULE}.reward_by_index", "--eval-prompt-data", "toy", str(tmp_path / "eval.jsonl"),
            *extra,
        ])  # fmt: skip

    yield make
    sglang_rollout._STATE = None


def test_a_sample_names_its_own_generate_and_reward(rollout_args):
    args = rollout_args()
    group = [Sample(index=0, group_index=0, prompt="p"), Sample(index=1, group_index=0, prompt="p")]
    group[1].generate_function_path, group[1].custom_rm_path = f"{MODULE}.own_generate", f"{MODULE}.own_reward"
    sglang_rollout.GenerateState(args)
    done = asyncio.run(sglang_rollout.generate_and_rm_group(args, group, {"temperature": 1.0}))
    assert [(name, index) for name, index, _ in CALLS] == [("two_token", 0), ("own", 1)]
    assert done[0].response == "ab" and done[0].reward == 0.0  # --custom-rm-path: index % 2
    assert done[1].status is Status.TRUNCATED and done[1].reward == 7.0 and done[1].metadata["evaluation"] is False


def test_group_rm_scores_per_sample_paths(rollout_args):
    # No group reward function: each sample is scored on its own, by its own path rather than --rm-type.
    args = rollout_args("--group-rm", "--custom-rm-path", "", "--rm-type", "random")
    group = [Sample(index=i, group_index=0, prompt="p", custom_rm_path=f"{MODULE}.own_reward") for i in range(2)]
    sglang_rollout.GenerateState(args)
    done = asyncio.run(sglang_rollout.generate_and_rm_group(args, group, {}))
    assert [s.reward for s in done] == [7.0, 7.0]


async def rank_in_group(args, samples):
    """A group reward function (--group-rm): the responses ranked by index."""
    return [float(rank) for rank in range(len(samples))]


def test_group_rm_refuses_samples_that_name_another_reward():
    from slime.rollout.rm_hub import batched_async_rm

    args = slime_flags(group_rm=True, custom_rm_path=f"{MODULE}.rank_in_group")
    group = [Sample(index=i, group_index=0, prompt="p", response="r") for i in range(3)]
    group[0].custom_rm_path = args.custom_rm_path  # naming the group function itself is no conflict
    assert asyncio.run(batched_async_rm(args, group)) == [0.0, 1.0, 2.0]
    group[2].custom_rm_path = f"{MODULE}.own_reward"
    with pytest.raises(ValueError) as error:
        asyncio.run(batched_async_rm(args, group))
    for part in (f"{MODULE}.rank_in_group", f"{MODULE}.own_reward", "index [2]", "--group-rm"):
        assert part in str(error.value)


def test_empty_generations_drop_their_group_with_a_warning(rollout_args, caplog):
    args = rollout_args("--custom-generate-function-path", f"{MODULE}.nothing_for_odd_prompts")
    data_source = load_function(args.data_source_path)(args)
    with caplog.at_level(logging.WARNING, logger=sglang_rollout.__name__):
        output = sglang_rollout.generate_rollout(args, 0, data_source)
    assert [len(g) for g in output.samples] == [2, 2]
    assert all(s.group_index % 2 == 0 and s.response == "ab" for g in output.samples for s in g)
    assert output.metrics["rollout/empty_groups"] >= 1
    assert f"{MODULE}.nothing_for_odd_prompts returned no samples for prompt group 1" in caplog.text

    never = rollout_args("--custom-generate-function-path", f"{MODULE}.never_anything")
    with pytest.raises(RuntimeError, match="returned no sample for 9 .* return at\\s+least one Sample per prompt"):
        sglang_rollout.generate_rollout(never, 0, load_function(never.data_source_path)(never))


def test_fallback_filter_keeps_groups_instead_of_drawing_more(rollout_args):
    args = rollout_args("--custom-rm-path", f"{MODULE}.constant_reward", "--over-sampling-batch-size", "4",
                        "--dynamic-sampling-filter-path",
                        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback")  # fmt: skip
    # Upstream's form: the data source's get_samples, and the unused groups handed back to the caller.
    data_source = load_function(args.data_source_path)(args)
    output, returned = asyncio.run(sglang_rollout.generate_rollout_async(args, 0, data_source.get_samples))
    # Every group has equal rewards: two of the four drawn are dropped, then the last two stand in.
    assert len(output.samples) == 2 and returned == []
    assert output.metrics["rollout/submitted_groups"] == 4 and output.metrics["rollout/dropped_groups"] == 2
    assert output.metrics["rollout/dynamic_filter/drop_all 2 rewards equal 1.0"] == 2.0


def test_generate_state_carries_upstreams_names(rollout_args):
    args = rollout_args("--sglang-dp-size", "2", "--sglang-enable-deterministic-inference", "--rollout-seed", "7")
    state = sglang_rollout.GenerateState(args)
    assert state.processor is None  # a text-only model
    assert state.group_sampling_seeds == [7, 8]
    with state.dp_rank_context() as first, state.dp_rank_context() as second:
        assert (first, second, state.dp_counts) == (0, 1, [1, 1])
    assert state.dp_counts == [0, 0]

    async def submit_and_wait():
        state.submit_generate_tasks([[Sample(index=4, group_index=2, prompt="p"), Sample(index=5, group_index=2)]])
        assert (len(state.pendings), state.remaining_batch_size) == (1, 1)
        (group,) = await asyncio.gather(*state.pendings)
        return group

    group = asyncio.run(submit_and_wait())
    assert [s.reward for s in group] == [0.0, 1.0]
    assert [params["sampling_seed"] for _, _, params in CALLS] == [7, 8]  # the k-th response of a prompt, seed + k
    state.reset()
    assert (state.pendings, state.remaining_batch_size, state.aborted) == (set(), 0, False)


def test_abort_stops_queued_requests_and_returns_the_groups(rollout_args):
    args = rollout_args("--custom-generate-function-path", f"{MODULE}.blocking_generate",
                        "--sglang-server-concurrency", "1")  # fmt: skip
    state = sglang_rollout.GenerateState(args)
    groups = [[Sample(index=2 * g + k, group_index=g, prompt="p") for k in range(2)] for g in range(2)]

    async def scenario():
        GATE.update(started=asyncio.Event(), release=asyncio.Event())
        state.semaphore = asyncio.Semaphore(1)
        state.submit_generate_tasks(groups)
        await GATE["started"].wait()
        aborting = asyncio.ensure_future(sglang_rollout.abort(args, 3))
        await asyncio.sleep(0)  # abort has marked the state before the running request is let go
        GATE["release"].set()
        return await aborting

    returned = asyncio.run(scenario())
    assert [name for name, _, _ in CALLS].count("blocking") == 1  # the three queued ones never reached it
    assert sorted(s.index for g in returned for s in g) == [0, 1, 2, 3]
    assert all(s.status is Status.PENDING and s.tokens == [] and s.reward is None for g in returned for s in g)
    assert state.pendings == set()


def test_a_group_its_generate_function_grew_goes_back_as_its_prompt_samples(caplog):
    args = slime_flags(n_samples_per_prompt=2, partial_rollout=False)
    # multi_agent's shape: two agents' samples from each of the group's two prompt samples (index 4 and 5)
    grown = [Sample(index=4 + k // 2, group_index=2, prompt="p", tokens=[1, 2], response="r", response_length=1,
                    reward=1.0, status=Status.COMPLETED) for k in range(4)]  # fmt: skip
    renumbered = [Sample(index=7, group_index=3, prompt="q", status=Status.COMPLETED) for _ in range(3)]
    with caplog.at_level(logging.WARNING):
        returned = sglang_rollout.prepare_for_return(args, [grown, renumbered])
    assert [[s.index for s in g] for g in returned] == [[4, 5]]
    assert all(s.status is Status.PENDING and s.tokens == [] and s.reward is None for s in returned[0])
    assert "indices [7]" in caplog.text  # the group that cannot be told apart is named, not put back


def test_eval_rollout_and_get_model_url(rollout_args):
    args = rollout_args()
    output, returned = asyncio.run(sglang_rollout.eval_rollout(args, 5))
    assert returned == [] and output.data["toy"]["rewards"] == [0.0]
    assert output.data["toy"]["samples"][0].rollout_id == 5

    routed = slime_flags(sglang_router_ip="10.0.0.1", sglang_router_port=3000, sglang_model_routers={"ref": ("h", 9)})
    assert sglang_rollout.get_model_url(routed, "ref") == "http://h:9/generate"
    assert sglang_rollout.get_model_url(routed, "ref", "v1/chat/completions") == "http://h:9/v1/chat/completions"
    assert sglang_rollout.get_model_url(routed, "actor") == "http://10.0.0.1:3000/generate"


def test_a_generated_image_placeholder_ends_the_response_before_it():
    # A VLM's forward reads every placeholder as an image slot: one the model generated cannot be trained on.
    from slime.utils.router_generate import end_before_generated_image_token

    image = 7
    prompt = [1, image, image, 2]  # the prompt's own image stays
    sample = Sample(index=0, tokens=prompt + [3, 4, image, 5], response_length=4, loss_mask=[1, 1, 1, 1])
    sample.rollout_log_probs = [-0.1, -0.2, -0.3, -0.4]
    sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets = [3, 9, 4, 7, 5], [0, 2, 3, 4, 5]

    class Decoder:
        def decode(self, ids):
            return " ".join(map(str, ids))

    end_before_generated_image_token(sample, 0, image, Decoder(), "earlier ")
    assert sample.tokens == prompt + [3, 4] and sample.response_length == 2 and sample.response == "earlier 3 4"
    assert sample.loss_mask == [1, 1] and sample.rollout_log_probs == [-0.1, -0.2]
    assert sample.rollout_top_p_token_offsets == [0, 2, 3] and sample.rollout_top_p_token_ids == [3, 9, 4]
    assert sample.status == Status.TRUNCATED
    untouched = Sample(index=1, tokens=prompt + [3, 4], response_length=2, loss_mask=[1, 1], status=Status.COMPLETED)
    end_before_generated_image_token(untouched, 0, image, Decoder())
    assert untouched.tokens == prompt + [3, 4] and untouched.status == Status.COMPLETED
