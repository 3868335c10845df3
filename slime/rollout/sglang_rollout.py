"""The default rollout: send prompts through the router, score the responses, return sample groups.

    generate_rollout(args, rollout_id, data_source, evaluation=False)

Train: takes prompt groups from the data source (over-sampling when a dynamic filter is set),
generates `n_samples_per_prompt` responses per prompt with at most `--sglang-server-concurrency`
requests in flight per engine, scores them, and stops once `--rollout-batch-size` groups are kept.
Requests still running then are aborted and their groups go back to the data source (with their
partial responses under `--partial-rollout`); so does a group the engine aborted on its own, and
another group is drawn in its place. Without `--rollout-max-response-len` a response may fill the
context (`--rollout-max-context-len`, else the engine's).

Eval: every `--eval-prompt-data` set, `--n-samples-per-eval-prompt` responses per prompt.

The rollout manager starts a `DefaultRollout` (the function's `lifecycle`), which hands the rollout the run's
`RunContext`; called directly, `generate_rollout` uses this process's rollout state as it stands.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import Any

from slime.rollout.agent_rollout import generate as agent_generate
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.opd import score_with_teacher
from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.utils import progress
from slime.utils.async_utils import run
from slime.utils.data import Dataset, load_dataset
from slime.utils.engine_args import context_limit, engine_api_key
from slime.utils.eval_config import EvalDatasetConfig, eval_datasets
from slime.utils.http_utils import HTTPRequestError, async_post_json, bearer_headers
from slime.utils.misc import load_function, load_tokenizer, maybe_await
from slime.utils.router_generate import generate_into_sample
from slime.utils.run_context import RunContext
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


class RolloutState:
    """What one process keeps between rollouts: tokenizer, concurrency cap, user hooks, eval sets, and the run's
    context (engine URLs to abort; an empty one outside a run)."""

    def __init__(self, args, context: RunContext | None = None):
        self.context = context if context is not None else RunContext()
        self.tokenizer = load_tokenizer(args.hf_checkpoint, args.trust_remote_code)
        num_engines = max(1, args.rollout_num_engines)
        self.max_concurrency = args.sglang_server_concurrency * num_engines
        self.semaphore: asyncio.Semaphore | None = None
        self.custom_generate = (
            load_function(args.custom_generate_function_path) if args.custom_generate_function_path else None
        )
        self.dynamic_filter = (
            load_function(args.dynamic_sampling_filter_path) if args.dynamic_sampling_filter_path else None
        )
        self.eval_datasets: dict[str, Dataset] = {}
        self.context_limits = {evaluation: context_limit(args, evaluation) for evaluation in (False, True)}

    async def ensure_started(self) -> None:
        # Created lazily on the shared loop: a semaphore belongs to one loop.
        if self.semaphore is None:
            self.semaphore = asyncio.Semaphore(self.max_concurrency)


# This process's rollout state. Upstream's signatures (`GenerateState(args)`, `generate_and_rm(args, ...)`) carry no
# state, so plugins and the generate helpers below find it here; the rollouts the manager starts register theirs
# (`start_state`), a direct caller gets one made on first use.
_STATE: RolloutState | None = None


def get_state(args) -> RolloutState:
    """This process's rollout state (made on first use, without a run context, when no rollout registered one)."""
    global _STATE
    if _STATE is None:
        _STATE = RolloutState(args)
    return _STATE


def start_state(args, context: RunContext) -> RolloutState:
    """This process's rollout state for the run of `context`: made once per context and registered, so that
    plugins, the generate helpers and the rollout share it."""
    global _STATE
    if _STATE is None or _STATE.context is not context:
        _STATE = RolloutState(args, context)
    return _STATE


class GenerateState:
    """Upstream's name for the rollout state, for custom generate and rollout functions.

    `GenerateState(args)` returns the `RolloutState` the default rollout uses (`get_state(args)`), with
    upstream's attribute names filled in: `tokenizer`, `semaphore` (at most `--sglang-server-concurrency`
    requests per engine; the default rollout already holds it around a custom generate function),
    `sampling_params` (from the `--rollout-*` flags) and `args`.
    """

    def __new__(cls, args) -> RolloutState:
        state = get_state(args)
        if state.semaphore is None:
            state.semaphore = asyncio.Semaphore(state.max_concurrency)  # binds to the loop that first waits on it
        if getattr(state, "sampling_params", None) is None:
            state.sampling_params = sampling_params_from_args(args)
        state.args = args
        return state


def sampling_params_from_args(args, evaluation: bool = False) -> dict[str, Any]:
    """SGLang sampling params from the `--rollout-*` flags (the `--eval-*` ones override them in eval).

    `max_new_tokens` is `--rollout-max-response-len`; unset, responses are capped only by the context, so it is
    `context_limit`, which `generate` lowers to what the prompt leaves.
    """

    def pick(eval_value, rollout_value):
        return rollout_value if eval_value is None or not evaluation else eval_value

    max_new_tokens = pick(args.eval_max_response_len, args.rollout_max_response_len)
    params = {
        "temperature": pick(args.eval_temperature, args.rollout_temperature),
        "top_p": pick(args.eval_top_p, args.rollout_top_p),
        "top_k": pick(args.eval_top_k, args.rollout_top_k),
        "max_new_tokens": context_limit(args, evaluation) if max_new_tokens is None else max_new_tokens,
        "skip_special_tokens": args.rollout_skip_special_tokens,
        "no_stop_trim": True,
    }
    if evaluation and args.eval_min_new_tokens:
        params["min_new_tokens"] = args.eval_min_new_tokens
    if args.rollout_stop:
        params["stop"] = args.rollout_stop
    if args.rollout_stop_token_ids:
        params["stop_token_ids"] = args.rollout_stop_token_ids
    return params


def _prompt_token_ids(tokenizer, prompt: str | list[dict[str, Any]]) -> list[int]:
    if isinstance(prompt, list):
        # Chat messages that were not templated by the data source: template them now.
        prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


async def generate(args, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False) -> Sample:
    """Generate (or, for a partial rollout, continue) one response through the router.

    Raises:
        ValueError: The prompt leaves no room for a response in the context.
    """
    state = get_state(args)
    params = dict(sampling_params)
    if sample.response_length == 0:
        sample.tokens = _prompt_token_ids(state.tokenizer, sample.prompt)
    else:
        params["max_new_tokens"] -= sample.response_length
        if args.mask_offpolicy_in_partial_rollout and sample.loss_mask:
            sample.loss_mask = [0] * len(sample.loss_mask)
    limit = state.context_limits[evaluation]
    room = limit - len(sample.tokens)
    if sample.response_length == 0 and room <= 0:
        raise ValueError(
            f"sample {sample.index}: the prompt has {len(sample.tokens)} tokens, which leaves no room for a response "
            f"in the context limit of {limit} tokens; drop long prompts with --rollout-max-prompt-len "
            "(--eval-max-prompt-len in eval) or raise --rollout-max-context-len / --sglang-context-length"
        )
    params["max_new_tokens"] = min(params["max_new_tokens"], room)
    if params["max_new_tokens"] <= 0:
        sample.status = Status.TRUNCATED
        return sample

    await generate_into_sample(args, sample, params, state.context)
    return sample


async def generate_and_rm(args, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False):
    """Generate one response and, unless rewards are per group, score it. May return several samples."""
    state = get_state(args)
    async with state.semaphore:
        if state.custom_generate is not None:
            result = await maybe_await(state.custom_generate(args, sample, sampling_params))
        elif args.agent_function_path:
            result = await agent_generate(
                args, sample, sampling_params, state.context_limits[evaluation], run_context=state.context
            )
        else:
            result = await generate(args, sample, sampling_params, evaluation)
    samples = result if isinstance(result, list) else [result]
    # --rollout-sample-hook-path: [async] hook(args, sample, *, rollout_id, evaluation) -> Sample | None (kept).
    for path in args.rollout_sample_hook_path or []:
        hook = load_function(path)
        for i, s in enumerate(samples):
            if s.status != Status.ABORTED:
                replaced = await maybe_await(hook(args, s, rollout_id=s.rollout_id, evaluation=evaluation))
                samples[i] = s if replaced is None else replaced
    result = samples if isinstance(result, list) else samples[0]
    await score_with_teacher(args, samples, evaluation)  # --use-opd: Sample.teacher_log_probs
    if not args.group_rm:
        for s in samples:
            if s.status not in (Status.ABORTED, Status.FAILED) and s.reward is None:  # unfinished: reward 0
                s.reward = await async_rm(args, s)
    return result


async def generate_and_rm_group(
    args, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Sample]:
    """Generate every response of one prompt group concurrently, then score (per group with `--group-rm`)."""
    results = await asyncio.gather(*(generate_and_rm(args, s, sampling_params, evaluation) for s in group))
    samples = [s for r in results for s in (r if isinstance(r, list) else [r])]
    if args.group_rm and not any(s.status == Status.ABORTED for s in samples):
        for s, reward in zip(samples, await batched_async_rm(args, samples), strict=True):
            s.reward = reward
    return samples


async def abort_engines(args, urls: list[str]) -> None:
    """Ask every engine of `urls` to abort all its requests (the router does not forward /abort_request)."""
    headers = bearer_headers(engine_api_key(args))
    for url in urls:
        try:
            await async_post_json(f"{url}/abort_request", {"abort_all": True}, max_retries=0, headers=headers)
        except (HTTPRequestError, ConnectionError) as e:
            logger.warning("abort_request on %s failed: %s", url, e)


def reset_to_prompt(sample: Sample) -> Sample:
    """A copy of the sample as the data source handed it out: prompt only, no response, no reward, trainable."""
    fresh = copy.deepcopy(sample)
    fresh.tokens, fresh.response, fresh.response_length = [], "", 0
    fresh.loss_mask = fresh.rollout_log_probs = fresh.teacher_log_probs = fresh.rollout_routed_experts = None
    fresh.weight_versions, fresh.reward, fresh.status, fresh.remove_sample = [], None, Status.PENDING, False
    return fresh


def _partial_or_fresh(sample: Sample) -> Sample:
    """An aborted sample keeps its partial response, to be continued; any other starts over."""
    if sample.status != Status.ABORTED:
        return reset_to_prompt(sample)
    sample.status, sample.reward = Status.PENDING, None
    return sample


# A rollout gives up once the engines abort this many times --over-sampling-batch-size groups: one pause (e.g. a
# weight update) aborts at most the groups in flight, fewer than two fetches; more means the engines are failing.
_ABORTED_GROUPS_PER_FETCH = 4


def _return_to_data_source(args, groups: list[list[Sample]], data_source) -> int:
    """Put groups this rollout did not use (finished extras, aborted ones) back, served first next time.

    Under `--partial-rollout` aborted samples keep their partial responses; everything else goes
    back as fresh prompts, so no prompt is lost either way.
    """
    reset = _partial_or_fresh if args.partial_rollout else reset_to_prompt
    returned = [[reset(s) for s in group] for group in groups]
    if returned:
        data_source.add_samples(returned)
    return len(returned)


def finish_rollout_batch(
    args, kept: list[list[Sample]], dropped: list[list[Sample]], data_source
) -> list[list[Sample]]:
    """The end of a training rollout, shared by the default and the fully async rollout: the kept groups sorted by
    group index, then the user's `--rollout-sample-filter-path` and `--rollout-all-samples-process-path` hooks.

    Args:
        kept: The groups to train on.
        dropped: The groups `--dynamic-sampling-filter-path` dropped (the all-samples hook sees them too).
        data_source: Handed to the all-samples hook.

    Returns:
        `kept`, sorted.
    """

    def by_group_index(group: list[Sample]) -> int:
        return group[0].group_index if group[0].group_index is not None else 0

    kept.sort(key=by_group_index)
    sample_filter = args.rollout_sample_filter_path
    if sample_filter:  # f(args, groups) sets remove_sample on the samples not to train on
        load_function(sample_filter)(args, kept)
    process_all = args.rollout_all_samples_process_path
    if process_all:  # f(args, groups, data_source), the groups the dynamic filter dropped included
        load_function(process_all)(args, sorted(kept + dropped, key=by_group_index), data_source)
    return kept


async def _generate_train_rollout(args, state: RolloutState, rollout_id: int, data_source) -> RolloutFnTrainOutput:
    await state.ensure_started()
    target = args.rollout_batch_size
    fetch_size = args.over_sampling_batch_size or target
    sampling_params = sampling_params_from_args(args)

    kept: list[list[Sample]] = []
    pending: set[asyncio.Task] = set()
    unused: list[list[Sample]] = []  # groups generated beyond the target, or aborted
    dropped: list[list[Sample]] = []  # groups the dynamic filter dropped
    num_dropped = num_submitted = num_aborted = 0
    max_aborted = _ABORTED_GROUPS_PER_FETCH * fetch_size
    started = time.time()
    progress_key = f"rollout {rollout_id}"
    progress.start(progress_key, f"rollout {rollout_id}", target, "group")
    try:
        while len(kept) < target:
            if len(kept) + len(pending) < target:
                for group in data_source.get_samples(fetch_size):
                    num_submitted += 1
                    for s in group:
                        s.rollout_id = rollout_id
                    pending.add(asyncio.create_task(generate_and_rm_group(args, group, sampling_params)))
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                group = task.result()
                if any(s.status == Status.ABORTED for s in group):
                    # The engine ended a request on its own (a pause for a weight update, an engine error): the
                    # group has no reward to learn from, so it goes back to the data source and another takes its
                    # place, as for the groups this rollout aborts at its end.
                    unused.append(group)
                    num_aborted += 1
                    if num_aborted > max_aborted:
                        raise RuntimeError(
                            f"rollout {rollout_id}: the engines aborted {num_aborted} prompt groups before "
                            f"{target} could be kept; check the engine logs (in $TMPDIR/slime_logs)"
                        )
                    continue
                if len(kept) >= target:
                    unused.append(group)
                    continue
                if state.dynamic_filter is not None:
                    verdict = state.dynamic_filter(args, group)
                    if not (verdict if isinstance(verdict, bool) else verdict.keep):
                        num_dropped += 1
                        dropped.append(group)
                        continue
                kept.append(group)
                progress.advance(progress_key)
    finally:
        progress.finish(progress_key)
        if pending:
            await abort_engines(args, state.context.engine_urls())
            for result in await asyncio.gather(*pending, return_exceptions=True):
                if isinstance(result, list):
                    unused.append(result)
        num_returned = _return_to_data_source(args, unused, data_source)

    kept = finish_rollout_batch(args, kept, dropped, data_source)
    metrics = {
        "rollout/submitted_groups": float(num_submitted),
        "rollout/dropped_groups": float(num_dropped),
        "rollout/returned_groups": float(num_returned),
        "rollout/aborted_groups": float(num_aborted),
        "rollout/generate_time": time.time() - started,
    }
    return RolloutFnTrainOutput(samples=kept, metrics=metrics)


def _eval_dataset(args, state: RolloutState, dataset: EvalDatasetConfig) -> Dataset:
    if dataset.name not in state.eval_datasets:
        state.eval_datasets[dataset.name] = load_dataset(
            dataset.path,
            args,
            tokenizer=state.tokenizer,
            flag=f"eval dataset {dataset.name}",
            input_key=dataset.input_key,
            label_key=dataset.label_key,
            tool_key=dataset.tool_key,
            max_prompt_len=dataset.max_prompt_len,
        )
    return state.eval_datasets[dataset.name]


def _eval_sampling_params(args, dataset: EvalDatasetConfig) -> dict[str, Any]:
    """The eval sampling params with this dataset's own settings (`--eval-config`) applied."""
    params = sampling_params_from_args(args, evaluation=True)
    params |= {"temperature": dataset.temperature, "top_p": dataset.top_p, "top_k": dataset.top_k}
    if dataset.max_response_len is not None:
        params["max_new_tokens"] = dataset.max_response_len
    if dataset.min_new_tokens:
        params["min_new_tokens"] = dataset.min_new_tokens
    return params


async def _generate_eval_rollout(args, state: RolloutState, rollout_id: int) -> RolloutFnEvalOutput:
    await state.ensure_started()
    data: dict[str, dict[str, Any]] = {}
    for dataset in eval_datasets(args):
        sampling_params = _eval_sampling_params(args, dataset)
        n = dataset.n_samples_per_eval_prompt
        extra_metadata = dict(dataset.metadata_overrides) | ({"rm_type": dataset.rm_type} if dataset.rm_type else {})
        samples = []
        for prompt_index, prompt_sample in enumerate(_eval_dataset(args, state, dataset).samples):
            for k in range(n):
                s = copy.deepcopy(prompt_sample)
                s.index, s.group_index, s.rollout_id = prompt_index * n + k, prompt_index, rollout_id
                if extra_metadata:
                    s.metadata = {**(s.metadata if isinstance(s.metadata, dict) else {}), **extra_metadata}
                samples.append(s)
        tasks = [generate_and_rm(args, s, sampling_params, evaluation=True) for s in samples]
        results = []
        progress_key = f"eval {rollout_id} {dataset.name}"
        progress.start(progress_key, f"eval {dataset.name}", len(tasks), "sample")
        try:
            for result in asyncio.as_completed(tasks):
                output = await result
                results.extend(output if isinstance(output, list) else [output])
                progress.advance(progress_key)
        finally:
            progress.finish(progress_key)
        if args.group_rm:
            for s, reward in zip(results, await batched_async_rm(args, results), strict=True):
                s.reward = reward
        results.sort(key=lambda s: s.index)
        data[dataset.name] = {
            "rewards": [s.get_reward_value(dataset.reward_key) for s in results],
            "truncated": [s.status == Status.TRUNCATED for s in results],
            "samples": results,
        }
    return RolloutFnEvalOutput(data=data)


def _rollout(args, state: RolloutState, rollout_id: int, data_source, evaluation: bool):
    if evaluation:
        return run(_generate_eval_rollout(args, state, rollout_id))
    return run(_generate_train_rollout(args, state, rollout_id, data_source))


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    """Default `--rollout-function-path`.

    Args:
        args: Parsed slime arguments; the router's address is read as user functions read it
            (`sglang_router_ip/port`, which the rollout manager writes).
        rollout_id: The rollout step.
        data_source: Source of prompt groups (`get_samples`, `add_samples`).
        evaluation: Run the eval sets instead of a training rollout.

    Returns:
        `RolloutFnTrainOutput` (groups of samples, one per prompt) or `RolloutFnEvalOutput`.
    """
    return _rollout(args, get_state(args), rollout_id, data_source, evaluation)


class DefaultRollout:
    """`generate_rollout` as the rollout manager runs it: with the run's context (the engines it aborts).

    Args:
        args: Parsed slime arguments.
        context: The run's context.
        data_source: The manager's data source (each call is handed it again).
    """

    def __init__(self, args, context: RunContext, data_source):
        self.context = context

    def __call__(self, args, rollout_id: int, data_source, evaluation: bool = False):
        # The state is made at the first call (it loads the tokenizer) and registered again at each one: a test
        # (or plugin) may have reset the process's state meanwhile.
        return _rollout(args, start_state(args, self.context), rollout_id, data_source, evaluation)


generate_rollout.lifecycle = DefaultRollout
