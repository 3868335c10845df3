"""Building blocks for hand-written multi-turn generate functions (`--custom-generate-function-path`).

A multi-turn sample is one token sequence: the prompt, then model turns (loss mask 1, with the engine's
log-probs) interleaved with tool or environment observations (loss mask 0, log-prob 0). Every turn sends
`sample.tokens` to the router as `input_ids`, so the trainer sees exactly the tokens the engine saw and no
re-tokenization can move a turn boundary.

    async def generate(args, sample, sampling_params):
        episode = start_episode(args, sample)
        while not episode.done:
            text = await model_turn(args, episode, sampling_params)
            query = extract_tag(text, "search")
            if query is None or episode.done:
                break
            append_observation(episode, f"<information>{search(query)}</information>")
        return episode.sample

Budgets: the context (`--rollout-max-context-len`, else what the engine holds) caps prompt, turns and
observations together. A turn's `max_new_tokens` is clipped to the room left, an observation that does not
fit is cut and ends the sample TRUNCATED, and `--max-turns` caps the model turns (`Episode.done`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from slime.utils import misc
from slime.utils.engine_args import context_limit
from slime.utils.router_generate import generate_into_sample
from slime.utils.tool_calls import parse_tool_calls
from slime.utils.types import Sample, Status

# A sample in one of these states takes no further turn.
_ENDED = (Status.TRUNCATED, Status.ABORTED, Status.FAILED)


@dataclass
class Episode:
    """A multi-turn sample being generated.

    Args:
        sample: The sample; its `tokens`, `response`, `loss_mask` and `rollout_log_probs` grow with each turn.
        tokenizer: Tokenizes observations (the checkpoint's own tokenizer).
        context_limit: Most prompt + response tokens the sample may reach.
        max_turns: Most model turns (`--max-turns`).
        turns: Model turns taken so far.
    """

    sample: Sample
    tokenizer: Any
    context_limit: int
    max_turns: int
    turns: int = 0

    @property
    def room(self) -> int:
        """Tokens the context still holds."""
        return self.context_limit - len(self.sample.tokens)

    @property
    def done(self) -> bool:
        """No further model turn: the turns are spent, the context is full, or the sample was truncated or aborted."""
        return self.turns >= self.max_turns or self.room <= 0 or self.sample.status in _ENDED


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of `path` (`--hf-checkpoint`), loaded once per process (its own code runs only under
    `--trust-remote-code`)."""
    return misc.load_tokenizer(path, trust_remote_code)


def start_episode(args, sample: Sample, tokenizer: Any = None) -> Episode:
    """Tokenize the prompt into `sample.tokens` and start a multi-turn episode on it.

    A sample that comes back with a partial response (`--partial-rollout`) starts over from its prompt: the turn
    structure of what it had is not known here.

    Args:
        args: Parsed slime arguments (reads `hf_checkpoint`, `max_turns`, the context flags).
        sample: Its `prompt` is text (already templated) or chat messages (templated here).
        tokenizer: Defaults to `--hf-checkpoint`'s.

    Raises:
        ValueError: The prompt leaves no room for a response in the context.
    """
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(args.hf_checkpoint, args.trust_remote_code)
    prompt = sample.prompt
    if isinstance(prompt, list):
        prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    sample.tokens = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    sample.response, sample.response_length, sample.loss_mask, sample.rollout_log_probs = "", 0, [], []
    sample.weight_versions, sample.status, sample.rollout_routed_experts = [], Status.PENDING, None
    episode = Episode(sample, tokenizer, context_limit(args), args.max_turns)
    if episode.room <= 0:
        raise ValueError(
            f"sample {sample.index}: the prompt has {len(sample.tokens)} tokens, which leaves no room for a response "
            f"in the context limit of {episode.context_limit} tokens; drop long prompts with --rollout-max-prompt-len "
            "or raise --rollout-max-context-len / --sglang-context-length"
        )
    return episode


async def model_turn(args, episode: Episode, sampling_params: dict[str, Any]) -> str:
    """Generate one model turn through the router and append it (loss mask 1, with its log-probs).

    `max_new_tokens` is clipped to the room left in the context. The sample's status becomes the turn's finish:
    COMPLETED (EOS or a stop string, which stays in the text with the default `no_stop_trim`), TRUNCATED (the
    turn ran out of tokens: the episode is done) or ABORTED.

    Returns:
        The turn's text ("" when the context was already full).
    """
    sample = episode.sample
    params = dict(sampling_params)
    params["max_new_tokens"] = min(params.get("max_new_tokens", episode.room), episode.room)
    if params["max_new_tokens"] <= 0:
        sample.status = Status.TRUNCATED
        return ""
    text = await generate_into_sample(args, sample, params)
    episode.turns += 1
    return text


def append_observation(episode: Episode, text: str) -> bool:
    """Append tool or environment output (loss mask 0): the model reads it but is not trained on it.

    Returns:
        True when it fits with room left for another turn. Otherwise it is cut to what the context holds, the
        sample becomes TRUNCATED and False comes back.
    """
    sample = episode.sample
    ids = episode.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < episode.room:
        sample.append_response(ids, text, None, trainable=False)
        return True
    ids = ids[: max(episode.room, 0)]
    sample.append_response(ids, episode.tokenizer.decode(ids), None, trainable=False)
    sample.status = Status.TRUNCATED
    return False


def extract_tag(text: str, tag: str) -> str | None:
    """The stripped body of the last complete `<tag>...</tag>` in `text`, or None."""
    bodies = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, re.DOTALL)
    return bodies[-1].strip() if bodies else None


def first_tool_call(text: str, names: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
    """The first Hermes `<tool_call>` in `text` to a tool in `names`, as (name, arguments), or None.

    Parsed by `slime.utils.tool_calls`, as the OpenAI endpoint parses them.
    """
    _, calls = parse_tool_calls(text)
    for call in calls:
        if call.name in names:
            return call.name, json.loads(call.arguments)
    return None
