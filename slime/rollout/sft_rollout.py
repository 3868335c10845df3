"""Supervised fine-tuning as a rollout: read conversations instead of generating, train on the assistant turns.

    --rollout-function-path slime.rollout.sft_rollout.generate_rollout --input-key messages
    --loss-type sft_loss --calculate-per-token-loss --disable-compute-advantages-and-returns --debug-train-only

Every prompt from the data source is a chat conversation (a list of `{"role", "content"}` messages).
It becomes one training sequence, rendered with the tokenizer's chat template. The sample's response
starts at the first assistant token and runs to the end of the conversation; `loss_mask` is 1 exactly
on the tokens of assistant turns, so system, user and tool messages in between are context only.

Assistant turns are located by rendering growing prefixes of the conversation with the chat template
(slime/utils/mask_utils.py, shared with custom generate functions).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.utils import progress
from slime.utils.mask_utils import tokenize_conversation
from slime.utils.misc import load_tokenizer
from slime.utils.types import Sample, Status


@functools.lru_cache(maxsize=4)
def load_chat_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of `--hf-checkpoint`, which must carry a chat template."""
    tokenizer = load_tokenizer(path, trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer of --hf-checkpoint {path} has no chat template; sft_rollout renders conversations "
            "with it to find the assistant turns. Use a checkpoint whose tokenizer_config.json (or "
            "chat_template.jinja) defines one"
        )
    return tokenizer


def _preview(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_conversation(prompt: Any, args: Any, sample: Sample) -> list[dict[str, Any]]:
    where = f"sample {sample.index} (prompt group {sample.group_index})"
    if isinstance(prompt, str) and args.apply_chat_template:
        raise ValueError(
            f"{where}: the prompt is already rendered text because --apply-chat-template is set; drop "
            "--apply-chat-template, sft_rollout renders the conversation itself"
        )
    is_conversation = (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(message, dict) and "role" in message for message in prompt)
    )
    if not is_conversation:
        raise ValueError(
            f"{where}: sft_rollout needs the field named by --input-key ({args.input_key!r}) to hold a conversation, "
            f"a non-empty list of {{'role', 'content'}} messages, but found {type(prompt).__name__}: "
            f"{_preview(prompt)}. Point --input-key at the messages column"
        )
    return prompt


def sft_sample(args: Any, tokenizer: Any, sample: Sample, rollout_id: int) -> Sample:
    """Fill `sample` (whose prompt is a conversation) as a finished SFT sample, in place.

    Args:
        args: Parsed arguments; reads `input_key`, `apply_chat_template_kwargs`.
        tokenizer: A Hugging Face tokenizer with a chat template.
        sample: A sample from the data source; `metadata["tools"]` is passed to the template when present.
        rollout_id: The rollout step, recorded on the sample.

    Returns:
        The same sample with tokens, response, response_length, loss_mask, reward 0 and status completed.
    """
    messages = _check_conversation(sample.prompt, args, sample)
    try:
        tokens, mask, response = tokenize_conversation(
            tokenizer, messages, sample.metadata.get("tools"), args.apply_chat_template_kwargs
        )
    except ValueError as e:
        raise ValueError(f"sample {sample.index} (prompt group {sample.group_index}): {e}") from e
    first_trainable = mask.index(1)
    sample.tokens = tokens
    sample.response = response
    sample.response_length = len(tokens) - first_trainable
    sample.loss_mask = mask[first_trainable:]
    sample.rollout_log_probs = None
    sample.reward = 0.0
    sample.status = Status.COMPLETED
    sample.rollout_id = rollout_id
    return sample


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> RolloutFnTrainOutput:
    """SFT `--rollout-function-path`: the next `--rollout-batch-size` conversations, tokenized for training.

    Needs no inference engine, so it runs under `--debug-train-only`.

    Args:
        args: Parsed slime arguments (`hf_checkpoint`, `rollout_batch_size`, `input_key`,
            `apply_chat_template_kwargs`).
        rollout_id: The rollout step.
        data_source: Source of prompt groups (`get_samples`); each prompt is a conversation.
        evaluation: Not supported: SFT has no generation to evaluate.

    Returns:
        `RolloutFnTrainOutput` with `--rollout-batch-size` groups (one per conversation, `--n-samples-per-prompt`
        identical copies) and the mean number of trainable tokens per sample.
    """
    if evaluation:
        raise ValueError(
            "slime.rollout.sft_rollout.generate_rollout has no evaluation mode; set --eval-function-path to a "
            "generating rollout (e.g. slime.rollout.sglang_rollout.generate_rollout, which needs engines) or drop "
            "--eval-prompt-data / --eval-interval"
        )
    if not args.hf_checkpoint:
        raise ValueError("sft_rollout needs --hf-checkpoint for the tokenizer and its chat template")
    tokenizer = load_chat_tokenizer(args.hf_checkpoint, args.trust_remote_code)
    started = time.time()
    groups = data_source.get_samples(args.rollout_batch_size)
    progress_key = f"rollout {rollout_id}"
    progress.start(progress_key, f"sft rollout {rollout_id}", len(groups), "group")
    try:
        for group in groups:
            first = sft_sample(args, tokenizer, group[0], rollout_id)
            # Copies of one conversation tokenize identically: reuse the first one's result.
            for sample in group[1:]:
                sample.tokens, sample.loss_mask = list(first.tokens), list(first.loss_mask)
                sample.response, sample.response_length = first.response, first.response_length
                sample.rollout_log_probs, sample.reward, sample.status = None, 0.0, Status.COMPLETED
                sample.rollout_id = rollout_id
            progress.advance(progress_key)
    finally:
        progress.finish(progress_key)
    samples = [sample for group in groups for sample in group]
    metrics = {
        "rollout/trainable_tokens": sum(sum(s.loss_mask) for s in samples) / max(len(samples), 1),
        "rollout/generate_time": time.time() - started,
    }
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)
