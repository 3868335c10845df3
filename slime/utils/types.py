"""The `Sample`: one prompt and one response, the unit that flows from data source to trainer."""

from __future__ import annotations

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


@dataclass
class Sample:
    """One prompt with one response.

    Args:
        index: Position of this sample in the whole rollout stream (unique per run).
        group_index: Index of the prompt group; samples of one prompt share it.
        rollout_id: Rollout step that produced the response.
        prompt: The prompt, as text or as a list of chat messages.
        tokens: Prompt token ids followed by response token ids.
        response: Decoded response text.
        response_length: Number of response tokens at the end of `tokens`.
        label: Ground truth for the reward function.
        reward: Scalar reward, or a dict of rewards picked from with `--reward-key`.
        loss_mask: One entry per response token; 0 excludes the token from the loss (e.g. tool output).
        rollout_log_probs: Log-probs of the response tokens under the engine that sampled them.
        rollout_routed_experts: MoE routing replay (`--use-rollout-routing-replay`): the experts the engine routed
            each token to, `[len(tokens) - 1, num_hidden_layers, top_k]` (slime.utils.moe_routing).
        weight_versions: Engine weight versions seen while generating (several for partial rollouts).
        status: See `Status`.
        metadata: Free-form per-sample data from the dataset (`--metadata-key`) or user code.
        train_metadata: Free-form data forwarded to the trainer.
        remove_sample: Keep the sample in its group but train on none of its tokens.
        teacher_log_probs: Log-probs of the response tokens under a teacher model (on-policy distillation),
            filled in by user code such as a `--custom-reward-post-process-path` function.
        session_id: Identifies the multi-turn or agent session the sample came from (user code sets it).
        non_generation_time: Seconds the sample spent outside the engine (tool calls, environments), for metrics.

    `Sample.Status` is `Status`, under the name upstream code uses.
    """

    Status = Status  # upstream code writes `Sample.Status.COMPLETED`

    index: int | None = None
    group_index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: torch.Tensor | None = None
    weight_versions: list[str] = field(default_factory=list)
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    train_metadata: dict[str, Any] | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

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

    def append_response(self, token_ids: list[int], text: str, log_probs: list[float] | None, trainable: bool = True):
        """Append generated (or tool-output, with `trainable=False`) tokens to the response."""
        self.tokens = self.tokens + list(token_ids)
        self.response += text
        self.response_length += len(token_ids)
        self.loss_mask = (self.loss_mask or []) + [int(trainable)] * len(token_ids)
        if log_probs is None:
            log_probs = [0.0] * len(token_ids)
        self.rollout_log_probs = (self.rollout_log_probs or []) + list(log_probs)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if "status" in kwargs:
            kwargs["status"] = Status(kwargs["status"])
        return cls(**kwargs)
