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

A sample's own `generate_function_path` / `custom_rm_path` take the place of `--custom-generate-function-path` /
`--custom-rm-path`. A generate function that returns no sample for a prompt has its group dropped, with a warning
naming it, and counted in `rollout/empty_groups`.

Upstream's names for the parts are kept: `GenerateState`, `generate_rollout_async`, `eval_rollout`, `abort` and
`get_model_url`.

The rollout manager starts a `DefaultRollout` (the function's `lifecycle`), which hands the rollout the run's
`RunContext`; called directly, `generate_rollout` uses this process's rollout state as it stands.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import inspect
import logging
import time
from collections.abc import Iterator
from typing import Any

from slime.rollout.agent_rollout import generate as agent_generate
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.filter_hub.base_types import MetricGatherer, call_dynamic_filter, should_drop_dynamic_filter_output
from slime.rollout.opd import score_with_teacher
from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.utils import progress
from slime.utils.async_utils import run
from slime.utils.data import Dataset, VisionPrompter, load_dataset, load_vision_prompter
from slime.utils.engine_args import context_limit, engine_api_key
from slime.utils.eval_config import EvalDatasetConfig, eval_datasets
from slime.utils.http_utils import HTTPRequestError, async_post_json, bearer_headers
from slime.utils.misc import load_function, load_tokenizer, maybe_await
from slime.utils.processing_utils import load_processor
from slime.utils.router_generate import generate_into_sample
from slime.utils.run_context import RunContext, router_url
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


class RolloutState:
    """What one process keeps between rollouts: tokenizer (and processor), concurrency cap, user hooks, eval sets,
    the run's context (engine URLs to abort; an empty one outside a run), and the groups of the rollout in flight.

    Upstream's `GenerateState` names: `args`, `tokenizer`, `processor`, `semaphore`, `sampling_params`,
    `group_sampling_seeds`, `dp_rank_context()`, `pendings` (the in-flight group tasks), `remaining_batch_size`
    (groups submitted and not dropped), `aborted`, `submit_generate_tasks(groups)` and `reset()`.
    """

    def __init__(self, args, context: RunContext | None = None):
        self.args = args
        self.context = context if context is not None else RunContext()
        self.tokenizer = load_tokenizer(args.hf_checkpoint, args.trust_remote_code)
        num_engines = max(1, args.rollout_num_engines)
        self.max_concurrency = args.sglang_server_concurrency * num_engines
        self.semaphore: asyncio.Semaphore | None = None
        self.sampling_params = sampling_params_from_args(args)
        # --sglang-enable-deterministic-inference: the k-th response of every prompt is sampled with seed
        # --rollout-seed + k, so a rerun reproduces the rollout.
        self.group_sampling_seeds: list[int] | None = (
            [args.rollout_seed + k for k in range(args.n_samples_per_prompt)]
            if getattr(args, "sglang_enable_deterministic_inference", False)
            else None
        )
        self.dp_counts = [0] * (getattr(args, "sglang_dp_size", None) or 1)
        self.custom_generate = (
            load_function(args.custom_generate_function_path) if args.custom_generate_function_path else None
        )
        self.dynamic_filter = (
            load_function(args.dynamic_sampling_filter_path) if args.dynamic_sampling_filter_path else None
        )
        self.eval_datasets: dict[str, Dataset] = {}
        self.context_limits = {evaluation: context_limit(args, evaluation) for evaluation in (False, True)}
        self.reset()

    async def ensure_started(self) -> None:
        # Created lazily on the shared loop: a semaphore belongs to one loop.
        if self.semaphore is None:
            self.semaphore = asyncio.Semaphore(self.max_concurrency)

    @functools.cached_property
    def processor(self) -> Any:
        """The model's multimodal processor, or None for a text-only model (`load_processor`, on first use)."""
        return load_processor(self.args.hf_checkpoint, trust_remote_code=self.args.trust_remote_code)

    @functools.cached_property
    def vision(self) -> VisionPrompter | None:
        """The image side of a vision-language model (`load_vision_prompter`, on first use), or None."""
        return load_vision_prompter(self.args.hf_checkpoint, self.args.trust_remote_code)

    @contextlib.contextmanager
    def dp_rank_context(self) -> Iterator[int]:
        """Hold the least busy of the engine's `--sglang-dp-size` data-parallel ranks while generating; yields it,
        for a plugin's payload `data_parallel_rank` (slime's own requests leave the choice to the engine)."""
        rank = self.dp_counts.index(min(self.dp_counts))
        self.dp_counts[rank] += 1
        try:
            yield rank
        finally:
            self.dp_counts[rank] -= 1

    def reset(self) -> None:
        """Forget the rollout in flight (between rollouts)."""
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task] = set()
        self.aborted = False

    def submit_generate_tasks(self, samples: list[list[Sample]]) -> None:
        """Start generating and scoring each prompt group of `samples` as one task in `pendings`."""
        for group in samples:
            task = generate_and_rm_group(self.args, group, self.sampling_params.copy(), evaluation=False)
            self.pendings.add(asyncio.ensure_future(task))
        self.remaining_batch_size += len(samples)


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

    `GenerateState(args)` returns the `RolloutState` the default rollout uses (`get_state(args)`), which carries
    upstream's attribute names (see `RolloutState`); the default rollout already holds `semaphore` (at most
    `--sglang-server-concurrency` requests per engine) around a custom generate function.
    """

    def __new__(cls, args) -> RolloutState:
        state = get_state(args)
        if state.semaphore is None:
            state.semaphore = asyncio.Semaphore(state.max_concurrency)  # binds to the loop that first waits on it
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


def prepare_generate(
    args, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> dict[str, Any] | None:
    """Ready `sample` for a generate request and return the sampling params to send, shared by `generate` and the
    streamed `generate_streaming`.

    A fresh sample gets its prompt tokenized (images expanded to their visual tokens for a vision-language model);
    a partial one (`--partial-rollout`) keeps its tokens and asks only for what its earlier part left (with
    `--mask-offpolicy-in-partial-rollout`, that part stops being trained on). `max_new_tokens` is lowered to the
    room the context leaves.

    Returns:
        The sampling params, or None when no room is left: the sample is then TRUNCATED and nothing is to be sent.

    Raises:
        ValueError: The prompt leaves no room for a response in the context, or it has images and the model is
            text-only.
    """
    state = get_state(args)
    params = dict(sampling_params)
    if sample.response_length == 0:
        sample.tokens = _prompt_token_ids(state.tokenizer, sample.prompt)
        images = (sample.multimodal_inputs or {}).get("images")
        if images:  # the engine and the trainer see each image's placeholder expanded to its visual tokens
            if state.vision is None:
                raise ValueError(f"sample {sample.index} has images but {args.hf_checkpoint} is a text-only model")
            sample.tokens, sample.multimodal_train_inputs = state.vision.prepare(sample.tokens, images)
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
        return None
    return params


async def generate(args, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False) -> Sample:
    """Generate (or, for a partial rollout, continue) one response through the router (`prepare_generate`, then
    `generate_into_sample`).

    Raises:
        ValueError: The prompt leaves no room for a response in the context.
    """
    params = prepare_generate(args, sample, sampling_params, evaluation)
    if params is not None:
        await generate_into_sample(args, sample, params, get_state(args).context)
    return sample


def generate_function_name(args, sample: Sample) -> str:
    """What generates `sample`, for messages: its own `generate_function_path`, `--custom-generate-function-path`,
    `--agent-function-path` or the built-in `generate`."""
    path = sample.generate_function_path or args.custom_generate_function_path or args.agent_function_path
    return path or f"{__name__}.generate"


async def _generate(args, state: RolloutState, sample: Sample, sampling_params: dict[str, Any], evaluation: bool):
    """Dispatch to the sample's own generate function, `--custom-generate-function-path`, the agent or `generate`."""
    custom = load_function(sample.generate_function_path) if sample.generate_function_path else state.custom_generate
    if custom is not None:
        if "evaluation" in inspect.signature(custom).parameters:
            return await maybe_await(custom(args, sample, sampling_params, evaluation=evaluation))
        return await maybe_await(custom(args, sample, sampling_params))
    if args.agent_function_path:
        return await agent_generate(
            args, sample, sampling_params, state.context_limits[evaluation], run_context=state.context
        )
    return await generate(args, sample, sampling_params, evaluation)


async def generate_and_rm(args, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False):
    """Generate one response and, unless rewards are per group, score it. May return several samples (or none).

    After `abort` it generates nothing: the sample comes back ABORTED.
    """
    state = get_state(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Status.ABORTED
            return sample
        with state.dp_rank_context():
            result = await _generate(args, state, sample, sampling_params, evaluation)
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
    """Generate every response of one prompt group concurrently, then score (per group with `--group-rm`).

    A generate function may return no sample for a prompt: the group then comes back empty, with a warning, and
    the rollout drops it.
    """
    seeds = get_state(args).group_sampling_seeds
    params = [
        dict(sampling_params, sampling_seed=seeds[k % len(seeds)]) if seeds else sampling_params
        for k in range(len(group))
    ]
    results = await asyncio.gather(*(generate_and_rm(args, s, p, evaluation) for s, p in zip(group, params)))
    samples = [s for r in results for s in (r if isinstance(r, list) else [r])]
    if not samples and group:
        logger.warning(
            "%s returned no samples for prompt group %s (sample index %s); the group is dropped",
            generate_function_name(args, group[0]),
            group[0].group_index,
            [s.index for s in group],
        )
    if args.group_rm and samples and not any(s.status == Status.ABORTED for s in samples):
        for s, value in zip(samples, await batched_async_rm(args, samples), strict=True):
            s.reward = value
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
    fresh.rollout_top_p_token_ids = fresh.rollout_top_p_token_offsets = None
    fresh.weight_versions, fresh.reward, fresh.status, fresh.remove_sample = [], None, Status.PENDING, False
    fresh.spec_info, fresh.prefix_cache_info = Sample.SpecInfo(), Sample.PrefixCacheInfo()
    return fresh


def _partial_or_fresh(sample: Sample) -> Sample:
    """An aborted sample keeps its partial response, to be continued; any other starts over."""
    if sample.status != Status.ABORTED:
        return reset_to_prompt(sample)
    sample.status, sample.reward = Status.PENDING, None
    return sample


# A rollout gives up once the engines abort this many times --over-sampling-batch-size groups: one pause (e.g. a
# weight update) aborts at most the groups in flight, fewer than two fetches; more means the engines are failing.
# The same bound holds for groups a generate function returns no sample for.
_ABORTED_GROUPS_PER_FETCH = 4


def prepare_for_return(args, groups: list[list[Sample]]) -> list[list[Sample]]:
    """Groups a rollout did not use (finished extras, aborted ones) as they go back to the data source: under
    `--partial-rollout` aborted samples keep their partial responses, everything else becomes a fresh prompt, so no
    prompt is lost either way. A group its generate function grew (several samples per prompt sample) goes back as
    the prompt samples it was made from."""
    reset = _partial_or_fresh if args.partial_rollout else reset_to_prompt
    returned = []
    for group in groups:
        if len(group) == args.n_samples_per_prompt:
            returned.append([reset(s) for s in group])
            continue
        # A generate function that makes several samples of each prompt sample (upstream's multi_agent) made them
        # from copies of the ones it was handed: those, one per index, are the prompts to put back.
        by_index = {s.index: reset_to_prompt(s) for s in group}
        if len(by_index) == args.n_samples_per_prompt:
            returned.append(sorted(by_index.values(), key=lambda s: s.index))
        else:
            logger.warning(
                "a finished group of %d samples (indices %s) is not %d prompt samples (--n-samples-per-prompt); "
                "it cannot go back to the data source and is not reused",
                len(group), sorted(by_index), args.n_samples_per_prompt,
            )  # fmt: skip
    return returned


def _return_to_data_source(args, groups: list[list[Sample]], data_source) -> int:
    """`prepare_for_return` the groups and add them to `data_source`, served first next time; returns how many."""
    returned = prepare_for_return(args, groups)
    if returned:
        data_source.add_samples(returned)
    return len(returned)


async def abort(args, rollout_id: int) -> list[list[Sample]]:
    """End the rollout in flight: tasks still queued generate nothing, the engines abort their requests, and the
    groups of `GenerateState(args).pendings` are awaited.

    Returns:
        Those groups, ready to go back to the data source (`prepare_for_return`); under `--partial-rollout` a
        partial response records the rollout it started in as `metadata["start_rollout_id"]`.
    """
    state = get_state(args)
    state.aborted = True
    if state.pendings:
        await abort_engines(args, state.context.engine_urls())
    results = await asyncio.gather(*state.pendings, return_exceptions=True)
    state.pendings = set()
    groups = [r for r in results if isinstance(r, list) and r]
    if args.partial_rollout:  # where a continued response began, as upstream records it
        for s in (s for group in groups for s in group if s.response_length):
            s.metadata.setdefault("start_rollout_id", rollout_id)
    return prepare_for_return(args, groups)


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


async def generate_rollout_async(args, rollout_id: int, data_source) -> tuple[RolloutFnTrainOutput, list[list[Sample]]]:
    """One training rollout of the default rollout function (see the module docstring).

    Groups are drawn `--over-sampling-batch-size` at a time while fewer than `--rollout-batch-size` are still in the
    running; `--dynamic-sampling-filter-path` judges each finished group (`call_dynamic_filter`; a
    `keep_when_insufficient` verdict keeps it when the batch could not be filled otherwise). A group the engines
    aborted, or one its generate function returned no sample for, is set aside and another is drawn.

    Args:
        args: Parsed slime arguments.
        rollout_id: The rollout step.
        data_source: The data source, or its `get_samples` (upstream's form).

    Returns:
        The kept groups with the rollout's metrics, and the groups to put back into the data source. If the rollout
        fails, those go back into the data source (when it is reachable) before the error propagates.

    Raises:
        RuntimeError: The engines aborted, or the generate function emptied, too many groups.
    """
    state = get_state(args)
    await state.ensure_started()
    state.reset()
    # The groups it submits are generated with these, read anew each rollout (a plugin may change args between).
    state.args, state.sampling_params = args, sampling_params_from_args(args)
    source = getattr(data_source, "__self__", data_source)  # upstream passes the bound `data_source.get_samples`
    get_samples = source.get_samples if hasattr(source, "get_samples") else data_source
    target = args.rollout_batch_size
    fetch_size = args.over_sampling_batch_size or target
    metric_gatherer = MetricGatherer()
    kept: list[list[Sample]] = []
    unused: list[list[Sample]] = []  # groups generated beyond the target, or aborted
    dropped: list[list[Sample]] = []  # groups the dynamic filter dropped
    num_dropped = num_submitted = num_aborted = num_empty = 0
    max_set_aside = _ABORTED_GROUPS_PER_FETCH * fetch_size
    started = time.time()
    progress_key = f"rollout {rollout_id}"
    progress.start(progress_key, f"rollout {rollout_id}", target, "group")
    try:
        while len(kept) < target:
            while state.remaining_batch_size < target:
                groups = get_samples(fetch_size)
                if not groups:
                    raise RuntimeError(f"rollout {rollout_id}: the data source returned no prompt group")
                for s in (s for group in groups for s in group):
                    s.rollout_id = rollout_id
                state.submit_generate_tasks(groups)
                num_submitted += len(groups)
            done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                group = task.result()
                if not group or any(s.status == Status.ABORTED for s in group):
                    # Empty: generate_and_rm_group warned, naming the generate function. Aborted: the engine ended
                    # a request on its own (a pause for a weight update, an engine error), so the group has no
                    # reward to learn from and goes back to the data source. Either way another takes its place.
                    state.remaining_batch_size -= 1
                    if group:
                        unused.append(group)
                        num_aborted += 1
                    else:
                        num_empty += 1
                    if max(num_aborted, num_empty) > max_set_aside:
                        raise RuntimeError(
                            f"rollout {rollout_id}: the engines aborted {num_aborted} prompt groups and the generate "
                            f"function returned no sample for {num_empty} (see the warnings naming it) before "
                            f"{target} could be kept; check the engine logs (in $TMPDIR/slime_logs), and return at "
                            "least one Sample per prompt from a custom generate function"
                        )
                    continue
                if len(kept) >= target:
                    unused.append(group)
                    continue
                verdict = call_dynamic_filter(state.dynamic_filter, args, group)
                if should_drop_dynamic_filter_output(
                    verdict, remaining_batch_size=state.remaining_batch_size, target_data_size=target
                ):
                    metric_gatherer.on_dynamic_filter_drop(verdict.reason)
                    state.remaining_batch_size -= 1
                    num_dropped += 1
                    dropped.append(group)
                    continue
                kept.append(group)
                progress.advance(progress_key)
    except BaseException:
        # A failed rollout loses no prompt: what it drew goes back first, so a retried rollout draws it again.
        returned = prepare_for_return(args, unused) + await abort(args, rollout_id)
        if returned and hasattr(source, "add_samples"):
            source.add_samples(returned)
        raise
    else:
        returned = prepare_for_return(args, unused) + await abort(args, rollout_id)
    finally:
        progress.finish(progress_key)
        state.reset()

    kept = finish_rollout_batch(args, kept, dropped, source)
    metrics = {
        "rollout/submitted_groups": float(num_submitted),
        "rollout/dropped_groups": float(num_dropped),
        "rollout/returned_groups": float(len(returned)),
        "rollout/aborted_groups": float(num_aborted),
        "rollout/empty_groups": float(num_empty),
        "rollout/generate_time": time.time() - started,
    }
    return RolloutFnTrainOutput(samples=kept, metrics=metrics | metric_gatherer.collect()), returned


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


async def eval_rollout(args, rollout_id: int) -> tuple[RolloutFnEvalOutput, list[list[Sample]]]:
    """Every `--eval-prompt-data` / `--eval-config` set, `n_samples_per_eval_prompt` responses per prompt.

    A dataset's `custom_generate_function_path` and `custom_rm_path` (`--eval-config` fields) become each sample's
    own.

    Returns:
        The eval output and, as upstream's signature has it, an empty list of groups to return to the data source.
    """
    state = get_state(args)
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
                s.generate_function_path = dataset.custom_generate_function_path
                s.custom_rm_path = dataset.custom_rm_path
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
            for s, value in zip(results, await batched_async_rm(args, results), strict=True):
                s.reward = value
        results.sort(key=lambda s: s.index)
        data[dataset.name] = {
            "rewards": [s.get_reward_value(dataset.reward_key) for s in results],
            "truncated": [s.status == Status.TRUNCATED for s in results],
            "samples": results,
        }
    return RolloutFnEvalOutput(data=data), []


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
    if evaluation:
        output, _ = run(eval_rollout(args, rollout_id))
        return output
    output, returned = run(generate_rollout_async(args, rollout_id, data_source))
    if returned:
        data_source.add_samples(returned)
    return output


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
        start_state(args, self.context)
        return generate_rollout(args, rollout_id, data_source, evaluation)


generate_rollout.lifecycle = DefaultRollout


def get_model_url(args, model_name: str, endpoint: str = "/generate") -> str:
    """URL of `endpoint` on the router serving `model_name`: `args.sglang_model_routers[model_name]` (a
    `(host, port)`, upstream's multi-model deployments), else the run's router."""
    routers = getattr(args, "sglang_model_routers", None) or {}
    if model_name in routers:
        host, port = routers[model_name]
        base = f"http://{host}:{port}"
    else:
        base = router_url(args, _STATE.context if _STATE is not None else None)
    return f"{base}/{endpoint.lstrip('/')}"
