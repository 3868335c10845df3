"""The `Sample`: one prompt and one response, the unit that flows from data source to trainer."""

from __future__ import annotations

import base64
import copy
from argparse import Namespace
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Status(str, Enum):
    """Where a sample is in its life. Values mirror SGLang's finish reasons where they overlap."""

    PENDING = "pending"
    COMPLETED = "completed"  # finish_reason "stop"
    TRUNCATED = "truncated"  # finish_reason "length"
    ABORTED = "aborted"  # finish_reason "abort"; may go back to the buffer as a partial rollout
    FAILED = "failed"

    @classmethod
    def from_finish_reason(cls, finish_reason: str) -> Status:
        """Map SGLang's `meta_info.finish_reason.type` to a status."""
        return {"stop": cls.COMPLETED, "length": cls.TRUNCATED, "abort": cls.ABORTED}.get(finish_reason, cls.FAILED)


def _from_known_keys(cls, data: dict[str, Any] | None):
    """`cls(**data)` with the keys `cls` has; a dump from another version may carry more or fewer."""
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in (data or {}).items() if k in known})


@dataclass
class SpecInfo:
    """Speculative-decoding counts summed over a sample's requests (SGLang's `meta_info`, under
    `--sglang-speculative-algorithm`); summed here because a partial rollout spans several requests."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    @property
    def spec_accept_rate(self) -> float:
        """Accepted draft tokens over drafted ones (0 when nothing was drafted)."""
        return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0

    @property
    def spec_accept_length(self) -> float:
        """Tokens produced per verification step (0 before any)."""
        return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0.0

    def add(self, meta_info: dict[str, Any]) -> None:
        """Add one request's counts."""
        self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
        self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
        self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
        self.completion_token_num += meta_info.get("completion_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SpecInfo:
        return _from_known_keys(cls, data)


@dataclass
class PrefixCacheInfo:
    """Prompt tokens the engine found in its prefix cache, summed over a sample's requests."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached prompt tokens over all prompt tokens sent (0 before any request)."""
        return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

    def add(self, meta_info: dict[str, Any]) -> None:
        """Add one request's `cached_tokens` and `prompt_tokens`."""
        self.cached_tokens += meta_info.get("cached_tokens", 0)
        self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> PrefixCacheInfo:
        return _from_known_keys(cls, data)


# SGLang's names for the ragged top-p replay arrays in `meta_info` (the second of each pair is an older spelling).
_TOP_P_IDS_KEYS = ("top_p_token_ids", "top_p_kept_token_ids")
_TOP_P_OFFSETS_KEYS = ("top_p_token_offsets", "top_p_kept_token_offsets")


def _int_array(meta_info: dict[str, Any], keys: tuple[str, ...]) -> list[int] | None:
    """The first of `keys` in `meta_info` as a list of ints; engines send a list or base64 of int32 bytes."""
    for key in keys:
        if key in meta_info:
            value = meta_info[key]
            break
    else:
        return None
    if isinstance(value, str):
        raw = base64.b64decode(value)
        return [int.from_bytes(raw[i : i + 4], "little", signed=True) for i in range(0, len(raw), 4)]
    return [int(v) for v in value]


# A PIL image in `multimodal_inputs` is stored as its PNG bytes under this key, so that a sample's dict is plain
# data that `torch.load(weights_only=True)` reads back (checkpointed buffers, debug rollout dumps).
_PNG_KEY = "__png__"


def _encode_images(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _encode_images(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_encode_images(item) for item in value]
    if type(value).__module__.startswith("PIL."):  # an image, without importing PIL for text-only runs
        import io

        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {_PNG_KEY: buffer.getvalue()}
    return value


def _decode_images(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_PNG_KEY}:
            import io

            from PIL import Image

            with Image.open(io.BytesIO(value[_PNG_KEY])) as image:
                return image.copy()
        return {key: _decode_images(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_decode_images(item) for item in value]
    return value


def _as_list(values, cast) -> list | None:
    """A list of `cast` values from a list, tuple or tensor (None stays None)."""
    if values is None:
        return None
    if hasattr(values, "tolist"):  # a tensor or an array
        values = values.reshape(-1).tolist()
    return [cast(v) for v in values]


@dataclass
class Sample:
    """One prompt with one response.

    Args:
        index: Position of this sample in the whole rollout stream (unique per run).
        group_index: Index of the prompt group; samples of one prompt share it.
        rollout_id: Rollout step that produced the response.
        prompt: The prompt, as text or as a list of chat messages.
        tokens: Prompt token ids followed by response token ids.
        multimodal_inputs: Raw multimodal inputs of the prompt (e.g. `{"images": [...]}`), for the engine.
        multimodal_train_inputs: What the model's processor made of them (e.g. `pixel_values`), for the trainer.
        apply_chat_template_kwargs: Extra keyword arguments for this sample's `apply_chat_template` call.
        response: Decoded response text.
        response_length: Number of response tokens at the end of `tokens`.
        label: Ground truth for the reward function.
        reward: Scalar reward, or a dict of rewards picked from with `--reward-key` (or turned into a scalar by
            `--custom-reward-post-process-path`).
        loss_mask: One entry per response token; 0 excludes the token from the loss (e.g. tool output).
        rollout_log_probs: Log-probs of the response tokens under the engine that sampled them.
        rollout_top_p_token_ids: Top-p replay: for response token i, the ids the engine's nucleus kept are
            `rollout_top_p_token_ids[offsets[i]:offsets[i + 1]]` with `offsets = rollout_top_p_token_offsets`.
        rollout_top_p_token_offsets: `response_length + 1` offsets into `rollout_top_p_token_ids`.
        rollout_routed_experts: MoE routing replay (`--use-rollout-routing-replay`): the experts the engine routed
            each token to, `[len(tokens) - 1, num_hidden_layers, top_k]` (slime.utils.moe_routing).
        weight_versions: Engine weight versions seen while generating (several for partial rollouts).
        status: See `Status`.
        metadata: Free-form per-sample data from the dataset (`--metadata-key`) or user code.
        generate_function_path: This sample's own generate function (dotted path), used instead of
            `--custom-generate-function-path` (an eval dataset's `custom_generate_function_path` sets it).
        custom_rm_path: This sample's own reward function (dotted path), used instead of `--custom-rm-path` /
            `--rm-type`.
        train_metadata: Free-form data forwarded to the trainer.
        remove_sample: Keep the sample in its group but train on none of its tokens.
        teacher_log_probs: Log-probs of the response tokens under a teacher model (on-policy distillation),
            filled in by user code such as a `--custom-reward-post-process-path` function.
        session_id: Identifies the multi-turn or agent session the sample came from (user code sets it).
        lora_adapter: With `--multi-lora-n-adapters`, the index of the adapter the sample belongs to: its requests
            generate with it, its reward is that adapter's and only that adapter trains on it (the data source sets
            it); None otherwise.
        non_generation_time: Seconds the sample spent outside the engine (tool calls, environments), for metrics.
        spec_info: Speculative-decoding counts of its requests.
        prefix_cache_info: Prefix-cache hits of its requests.

    `Sample.Status`, `Sample.SpecInfo` and `Sample.PrefixCacheInfo` are `Status`, `SpecInfo` and
    `PrefixCacheInfo`, under the names upstream code uses. Attributes user code sets beyond these fields
    survive `to_dict` / `from_dict`.
    """

    Status = Status  # upstream code writes `Sample.Status.COMPLETED`
    SpecInfo = SpecInfo
    PrefixCacheInfo = PrefixCacheInfo

    index: int | None = None
    group_index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: torch.Tensor | None = None
    weight_versions: list[str] = field(default_factory=list)
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    session_id: str | None = None
    lora_adapter: int | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def effective_response_length(self) -> int:
        """Response tokens the loss sees: the ones `loss_mask` keeps (all of them without a mask)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    @property
    def unfinished(self) -> bool:
        """Aborted or failed and never scored: it counts as reward 0 and is not trained on."""
        return self.reward is None and self.status in (Status.ABORTED, Status.FAILED)

    def get_reward_value(self, reward_key: str | Namespace | None = None) -> float | dict[str, Any]:
        """The sample's scalar reward; 0 for an `unfinished` sample.

        Args:
            reward_key: The entry to pick when `reward` is a dict (`--reward-key`); ignored for a scalar reward.
                Upstream code passes the parsed arguments instead: their `reward_key` is used then and, when
                it is unset, a dict reward comes back whole (for a `--custom-reward-post-process-path`
                function that reads it).
        """
        whole_dict_if_no_key = reward_key is not None and not isinstance(reward_key, str)
        if whole_dict_if_no_key:
            reward_key = getattr(reward_key, "reward_key", None)
        if isinstance(self.reward, dict):
            if reward_key is None:
                if whole_dict_if_no_key:
                    return self.reward
                raise ValueError(
                    f"sample {self.index} has a dict reward with keys {sorted(self.reward)}; pass --reward-key to pick one"
                )
            if reward_key not in self.reward:
                raise ValueError(
                    f"sample {self.index}: --reward-key {reward_key!r} is not in its reward, which has keys "
                    f"{sorted(self.reward)}; return that key from the reward function or change --reward-key"
                )
            return float(self.reward[reward_key])
        if self.unfinished:
            return 0.0
        if self.reward is None:
            raise ValueError(
                f"sample {self.index} ({Status(self.status).value}) has no reward: the rollout function must "
                "score every sample it returns (--rm-type / --custom-rm-path, or sample.reward in custom code)"
            )
        return float(self.reward)

    def append_response_tokens(
        self,
        args: Namespace | None = None,
        *,
        tokens=None,
        log_probs=None,
        trainable: bool = True,
        meta_info: dict[str, Any] | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append response tokens (a model turn, or tool / environment output) and keep the per-token fields aligned.

        Args:
            args: The run's arguments; read for `sglang_speculative_algorithm` and, when `meta_info` carries
                `routed_experts`, the routing shape (`num_layers` / `moe_router_topk`, else `hf_checkpoint`'s config).
            tokens: The new token ids (a list or a tensor).
            log_probs: The engine's log-prob of each new token; required for trainable tokens, refused for others
                (their entries are 0).
            trainable: False for tokens the model did not sample (tool output): loss mask 0, log-prob 0, and an
                empty top-p span.
            meta_info: The engine's `meta_info` for these tokens: top-p replay arrays and `routed_experts` are
                taken from it, and, with `update_terminal_info`, the finish reason (status), weight version,
                prefix-cache and speculative-decoding counts.
            text: Appended to `response` when given.
            update_terminal_info: Set False for a chunk that does not end the request (streaming).

        Raises:
            ValueError: The inputs do not line up (log-prob count, missing or unexpected log-probs, top-p arrays)
                or the sample's per-token fields no longer match `response_length`.
        """
        tokens = _as_list(tokens, int) or []
        log_probs = _as_list(log_probs, float)
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"sample {self.index}: {len(log_probs)} log_probs for {len(tokens)} tokens")
        if tokens and trainable and log_probs is None:
            raise ValueError(
                f"sample {self.index}: trainable tokens need their log_probs; ask the engine for them "
                '("return_logprob": True, then meta_info.output_token_logprobs) or pass trainable=False'
            )
        if not trainable:
            if log_probs is not None:
                raise ValueError(
                    f"sample {self.index}: trainable=False tokens take no log_probs (they are masked out of the loss)"
                )
            log_probs = [0.0] * len(tokens)
        previous = self.response_length
        if self.rollout_log_probs is None and previous and trainable and tokens:
            raise ValueError(
                f"sample {self.index} has {previous} response tokens but no rollout_log_probs, so trainable tokens "
                "appended now would misalign them; append every response token with append_response_tokens"
            )
        if text is not None:
            self.response += text
        self.tokens = self.tokens + tokens
        self.response_length += len(tokens)
        self.loss_mask = (self.loss_mask if self.loss_mask is not None else [1] * previous) + [int(trainable)] * len(
            tokens
        )
        self.rollout_log_probs = (self.rollout_log_probs or [0.0] * previous) + log_probs
        self._append_top_p(meta_info or {}, len(tokens), trainable, previous)
        if meta_info:
            if "routed_experts" in meta_info:
                self.rollout_routed_experts = _decode_routed_experts(args, meta_info["routed_experts"])
            if update_terminal_info and "finish_reason" in meta_info:
                if getattr(args, "sglang_speculative_algorithm", None):
                    self.spec_info.add(meta_info)
                self.prefix_cache_info.add(meta_info)
                if "weight_version" in meta_info:
                    self.weight_versions.append(str(meta_info["weight_version"]))
                finish = meta_info["finish_reason"]["type"]
                if finish in ("stop", "length", "abort"):
                    self.status = Status.from_finish_reason(finish)
        self._check_response_fields()

    def _append_top_p(self, meta_info: dict[str, Any], count: int, trainable: bool, previous: int) -> None:
        """Extend the top-p replay arrays by `count` tokens: the engine's spans, or empty ones for masked tokens."""
        ids, offsets = _int_array(meta_info, _TOP_P_IDS_KEYS), _int_array(meta_info, _TOP_P_OFFSETS_KEYS)
        if (ids is None) != (offsets is None):
            raise ValueError(f"sample {self.index}: meta_info has only one of the top-p token ids and offsets")
        if ids is None and (self.rollout_top_p_token_offsets is None or not count):
            return
        if self.rollout_top_p_token_offsets is None:  # earlier response tokens had no nucleus: empty spans
            self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets = [], [0] * (previous + 1)
        base = self.rollout_top_p_token_offsets[-1]
        if ids is None or not trainable:
            self.rollout_top_p_token_offsets = self.rollout_top_p_token_offsets + [base] * count
            return
        if len(offsets) != count + 1 or offsets[0] != 0 or offsets[-1] != len(ids):
            raise ValueError(
                f"sample {self.index}: top-p offsets {offsets[:3]}... ({len(offsets)} of them, last "
                f"{offsets[-1] if offsets else None}) do not describe {len(ids)} ids over {count} tokens"
            )
        self.rollout_top_p_token_ids = list(self.rollout_top_p_token_ids) + ids
        self.rollout_top_p_token_offsets = list(self.rollout_top_p_token_offsets) + [base + o for o in offsets[1:]]

    def _check_response_fields(self) -> None:
        lengths = {"loss_mask": self.loss_mask, "rollout_log_probs": self.rollout_log_probs}
        for name, values in lengths.items():
            if values is not None and len(values) != self.response_length:
                raise ValueError(
                    f"sample {self.index}: {name} has {len(values)} entries for {self.response_length} response tokens"
                )
        offsets = self.rollout_top_p_token_offsets
        if offsets is not None and len(offsets) != self.response_length + 1:
            raise ValueError(
                f"sample {self.index}: rollout_top_p_token_offsets has {len(offsets)} entries, not response_length + 1 "
                f"= {self.response_length + 1}"
            )

    def append_response(self, token_ids: list[int], text: str, log_probs: list[float] | None, trainable: bool = True):
        """`append_response_tokens` for callers without log-probs: trainable tokens then record 0 for each, and
        earlier response tokens that had none get 0 too."""
        if trainable:
            if log_probs is None:
                log_probs = [0.0] * len(token_ids)
            if self.rollout_log_probs is None and self.response_length:
                self.rollout_log_probs = [0.0] * self.response_length
        self.append_response_tokens(
            tokens=token_ids, log_probs=log_probs if trainable else None, trainable=trainable, text=text
        )

    def to_dict(self) -> dict[str, Any]:
        """The sample as plain data (enums as values, `spec_info` / `prefix_cache_info` as dicts), attributes user
        code set beyond the fields included."""
        data = asdict(self)
        data["status"] = Status(self.status).value
        data["multimodal_inputs"] = _encode_images(data["multimodal_inputs"])
        names = {f.name for f in fields(self)}
        data |= {k: copy.deepcopy(v) for k, v in vars(self).items() if k not in names}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of `to_dict`; keys that are not fields become attributes again."""
        names = {f.name for f in fields(cls)}
        sample = cls(**{k: v for k, v in data.items() if k in names})
        sample.status = Status(sample.status)
        sample.multimodal_inputs = _decode_images(sample.multimodal_inputs)
        sample.spec_info = SpecInfo.from_dict(data.get("spec_info"))
        sample.prefix_cache_info = PrefixCacheInfo.from_dict(data.get("prefix_cache_info"))
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample


def _decode_routed_experts(args: Namespace | None, text: str) -> torch.Tensor:
    """`meta_info.routed_experts` as a `[rows, layers, top_k]` tensor, shaped by `args` (upstream's Megatron
    `num_layers` / `moe_router_topk`, else the config of `args.hf_checkpoint`)."""
    from slime.utils.moe_routing import decode_routed_experts, routing_shape

    num_layers, top_k = getattr(args, "num_layers", None), getattr(args, "moe_router_topk", None)
    if not (num_layers and top_k):
        checkpoint = getattr(args, "hf_checkpoint", None)
        if checkpoint is None:
            raise ValueError(
                "meta_info carries routed_experts: pass the run's args to append_response_tokens (their num_layers "
                "and moe_router_topk, or hf_checkpoint, give the routing shape)"
            )
        from transformers import AutoConfig

        from slime.utils.misc import load_pretrained

        shape = routing_shape(load_pretrained(AutoConfig, checkpoint, getattr(args, "trust_remote_code", False)))
        if shape is None:
            raise ValueError(f"meta_info carries routed_experts but {checkpoint} is not an MoE model")
        num_layers, top_k = shape
    return decode_routed_experts(text, num_layers, top_k)
