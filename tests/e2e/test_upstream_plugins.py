"""train.py driven by upstream-shaped plugins (agent, rollout, reward, filter), as a user runs it."""

from __future__ import annotations

import json
import textwrap

import torch
from support.runs import rollout_rows, run_driver_script, saved_samples
from transformers import AutoTokenizer

from slime.utils.types import Sample, Status

PLUGINS = {
    "my_agent.py": '''
        """A two-turn agent: answer, see a tool's output, answer again (upstream's search-r1 / retool shape)."""
        import asyncio
        import time

        from slime.rollout.sglang_rollout import GenerateState
        from slime.utils.http_utils import post
        from slime.utils.mask_utils import MultiTurnLossMaskGenerator
        from slime.utils.misc import SingletonMeta
        from slime.utils.types import Sample

        TOOL_OUTPUT = "0123456789"


        class Calculator(metaclass=SingletonMeta):
            def __init__(self):
                self.calls = 0

            async def run(self, query):
                self.calls += 1
                await asyncio.sleep(0.01)  # a tool takes time
                return TOOL_OUTPUT


        async def generate(args, sample: Sample, sampling_params) -> Sample:
            state = GenerateState(args)
            masker = MultiTurnLossMaskGenerator(state.tokenizer, tokenizer_type=args.loss_mask_type)
            url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
            messages = list(sample.prompt)
            sample.session_id = f"session-{sample.index}"
            for turn in range(2):
                text = state.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                output = await post(url, {"text": text, "sampling_params": sampling_params})
                finish = output["meta_info"]["finish_reason"]["type"]
                if finish == "abort":
                    sample.status = Sample.Status.ABORTED
                    return sample
                messages.append({"role": "assistant", "content": output["text"].split(state.tokenizer.eos_token)[0]})
                if turn == 0:
                    started = time.perf_counter()
                    messages.append({"role": "tool", "content": await Calculator().run(output["text"])})
                    sample.non_generation_time += time.perf_counter() - started
            token_ids, loss_mask = masker.get_loss_mask(messages)
            response_length = masker.get_response_lengths([loss_mask])[0]
            sample.tokens = token_ids
            sample.response_length = response_length
            sample.loss_mask = loss_mask[-response_length:]
            sample.response = state.tokenizer.decode(token_ids[-response_length:])
            sample.metadata["tool_calls"] = 1
            sample.status = Sample.Status.TRUNCATED if finish == "length" else Sample.Status.COMPLETED
            return sample
    ''',
    "my_reward.py": """
        from slime.utils.types import Sample


        async def reward(args, sample: Sample) -> dict:
            correct = float(sample.metadata["answer"] in sample.response)
            # A tiny random model never answers right; alternate within each group so advantages are not all 0.
            return {"score": float(sample.index % 2), "correct": correct, "tool_calls": sample.metadata["tool_calls"]}
    """,
    "my_filter.py": """
        import statistics

        from slime.rollout.filter_hub.base_types import DynamicFilterOutput


        def keep_varied_rewards(args, samples, **kwargs):
            rewards = [sample.get_reward_value(args) for sample in samples]
            spread = statistics.pstdev(rewards)
            for sample in samples:
                sample.metadata["group_reward_std"] = spread
            return DynamicFilterOutput(keep=spread > 0, reason=None if spread > 0 else "zero_std")
    """,
    "my_rollout.py": """
        import asyncio

        from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
        from slime.utils.async_utils import run
        from slime.utils.misc import load_function


        def generate_rollout(args, rollout_id, data_source, evaluation=False):
            assert not evaluation, "this rollout has no eval mode"
            return run(collect(args, rollout_id, data_source))


        async def collect(args, rollout_id, data_source):
            state = GenerateState(args)
            keep = load_function(args.dynamic_sampling_filter_path)
            kept = []
            while len(kept) < args.rollout_batch_size:
                groups = data_source.get_samples(args.rollout_batch_size - len(kept))
                for group in groups:
                    for sample in group:
                        sample.rollout_id = rollout_id
                        sample.metadata["collected_by"] = "my_rollout"
                done = await asyncio.gather(*(generate_and_rm_group(args, g, state.sampling_params) for g in groups))
                kept += [group for group in done if keep(args, group).keep]
            return kept
    """,
}


def test_train_py_runs_upstream_shaped_plugins(tiny_model_dir, tmp_path, monkeypatch):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    for name, source in PLUGINS.items():
        (plugins / name).write_text(textwrap.dedent(source).lstrip())
    monkeypatch.setenv("PYTHONPATH", str(plugins))
    data = tmp_path / "train.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "metadata": {"answer": str(a + b)}}
        for a in range(1, 4)
        for b in range(1, 4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    save = tmp_path / "run"
    result = run_driver_script(
        "train.py", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--input-key", "messages",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--num-rollout", "2", "--lr", "1e-3", "--save", str(save),
        "--save-debug-rollout-data", str(save / "rollouts" / "rollout_{rollout_id}.pt"),
        "--rollout-function-path", "my_rollout.generate_rollout",
        "--custom-generate-function-path", "my_agent.generate",
        "--custom-rm-path", "my_reward.reward", "--reward-key", "score",
        "--dynamic-sampling-filter-path", "my_filter.keep_varied_rewards",
        timeout=420,
    )  # fmt: skip
    assert result.returncode == 0, f"train.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    history = rollout_rows(save)
    assert [h["rollout_id"] for h in history] == [0, 1] and all("train/loss" in h for h in history)
    assert [h["rollout/reward"] for h in history] == [0.5, 0.5]  # the "score" entry, picked by --reward-key

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # From the tiny template's layout: what sits between the two assistant turns is context, never trained on.
    between_turns = "<|im_start|>tool\n0123456789<|im_end|>\n<|im_start|>assistant\n"
    for rollout_id in (0, 1):
        saved = torch.load(save / "rollouts" / f"rollout_{rollout_id}.pt", weights_only=False)
        samples = [Sample.from_dict(d) for d in saved["samples"]]
        assert len(samples) == 4 and [s.group_index for s in samples][::2] == [s.group_index for s in samples][1::2]
        for s in samples:
            assert s.metadata["collected_by"] == "my_rollout" and s.metadata["group_reward_std"] == 0.5
            assert s.reward["score"] == s.index % 2 and s.reward["tool_calls"] == 1
            assert s.session_id == f"session-{s.index}" and s.non_generation_time >= 0.01
            assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.rollout_id == rollout_id
            response = s.tokens[-s.response_length :]
            assert len(s.loss_mask) == s.response_length and s.loss_mask[0] == 1
            masked_out = [t for t, keep in zip(response, s.loss_mask, strict=True) if not keep]
            assert tokenizer.decode(masked_out) == between_turns, tokenizer.decode(response)
            prompt = tokenizer.apply_chat_template(s.prompt, tokenize=False, add_generation_prompt=True)
            assert tokenizer.decode(s.tokens[: -s.response_length]) == prompt


def test_train_py_runs_current_upstream_examples_routed_per_sample(tiny_model_dir, tmp_path):
    """search-r1, multi_agent and retool as upstream writes them today, one run, each prompt routed to its own
    generate and reward by a data source (per-sample `generate_function_path` / `custom_rm_path`)."""
    domains = ["search_r1", "multi_agent", "retool"]
    rows = [
        {
            "messages": [{"role": "user", "content": f"What is {i} + 2?"}],
            "label": str(i + 2),
            # The first multi_agent prompt is one no agent solves: its generate returns no samples.
            "metadata": {"domain": domains[i % 3], "unsolvable": i == 1},
        }
        for i in range(9)
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    save = tmp_path / "run"
    result = run_driver_script(
        "train.py", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--input-key", "messages",
        "--label-key", "label", "--rollout-batch-size", "3", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--num-rollout", "2", "--lr", "1e-3", "--save", str(save),
        "--save-debug-rollout-data", str(save / "rollouts" / "rollout_{rollout_id}.pt"),
        "--data-source-path", "support.upstream_examples.routed_data_source.RoutedDataSource",
        "--reward-key", "score", "--use-dynamic-global-batch-size",
        timeout=420,
    )  # fmt: skip
    assert result.returncode == 0, f"train.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    history = rollout_rows(save)
    assert [h["rollout_id"] for h in history] == [0, 1] and all("train/loss" in h for h in history)
    assert [h["rollout/dropped_samples"] for h in history] == [0, 0]  # one trainer rank: nothing to round off
    assert history[0]["rollout/empty_groups"] == 1  # the unsolvable prompt's group was dropped, not an IndexError

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    context = {
        "search_r1": "\n<information>Doc 1: two plus two is four.</information>\n",
        "retool": "\n<interpreter>4</interpreter>\n",
    }
    groups: dict[tuple[int, int], list[str]] = {}  # (rollout, group) -> its samples' domains
    for rollout_id in (0, 1):
        samples = saved_samples(save, rollout_id)
        if any(s.metadata["domain"] == "search_r1" for s in samples):
            # slime.observability's log reached the row of the rollout that finished a search_r1 sample (which
            # prompts a rollout finishes depends on the interleaving).
            assert history[rollout_id]["search_r1/last_searches"] == 1
        for s in samples:
            domain = s.metadata["domain"]
            groups.setdefault((rollout_id, s.group_index), []).append(domain)
            assert s.generate_function_path.startswith(f"support.upstream_examples.{domain}.")
            assert not s.metadata["unsolvable"]
            response = s.tokens[-s.response_length :]
            assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
            masked = [t for t, keep in zip(response, s.loss_mask, strict=True) if not keep]
            # Only the tool's output is masked out, and its log-prob entries are 0.
            assert tokenizer.decode(masked) == context.get(domain, ""), (domain, tokenizer.decode(response))
            assert all(lp == 0.0 for lp, keep in zip(s.rollout_log_probs, s.loss_mask, strict=True) if not keep)
            if domain == "search_r1":
                assert s.reward == float(str(s.label) in s.response) + s.index % 2
            elif domain == "retool":
                assert set(s.reward) == {"score", "acc", "pred"} and s.metadata["tool_call_count"] == 1
            else:
                assert s.metadata["role"] in ("solver", "rewriter")
                assert s.reward == (1.2 if s.metadata["role"] == "solver" else 0.0)
    # Three prompt groups a rollout (which ones depends on what finished first); each prompt gives 2 samples, and a
    # multi_agent sample fans out into its 2 agents' samples.
    assert [sum(rollout == r for rollout, _ in groups) for r in (0, 1)] == [3, 3]
    for domains_of_group in groups.values():
        (domain,) = set(domains_of_group)
        assert len(domains_of_group) == (2 * 2 if domain == "multi_agent" else 2)
    # Six groups kept from the eight solvable prompts (three of each of search_r1 and retool, two multi_agent) hold
    # both of the first two domains; a multi_agent group, when kept, is checked above.
    assert {"search_r1", "retool"} <= {domains_of_group[0] for domains_of_group in groups.values()}
