"""MoE routing replay (R3): the experts an engine routed each token to, carried to the trainer and replayed there.

Wire format (SGLang's `return_routed_experts`): `meta_info["routed_experts"]` is the base64 of an int32 array
`[T - 1, num_hidden_layers, top_k]` for a request whose prompt + output is `T` tokens: one row per token the
engine ran through the model (the last sampled token never is). Rows of dense layers hold zeros.

On the trainer a sequence of `T` tokens needs `T` rows; `routing_rows` completes it with a filler routing
(experts 0..k-1) for the rows no engine produced. Those rows never change a trained log-prob: under causal
attention a token's routing only changes that token's own hidden states and the logit it emits, and the last
token's logit predicts nothing.

`HFRouters` hooks the top-k routers of a HuggingFace MoE model (Qwen2/3-MoE, Mixtral, OLMoE, ...): it records
what they chose (the CPU engine) or makes them take given experts (the FSDP trainer), keeping the router's own
weights for those experts so the router still gets gradients.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

# experts per model stay below 2**15; int16 halves what a rollout carries through Ray
ROUTING_DTYPE = torch.int16


def routing_shape(hf_config: Mapping | object) -> tuple[int, int] | None:
    """(num_hidden_layers, top_k) of an MoE model's HF config (a dict or a `PretrainedConfig`); None if dense."""
    get = hf_config.get if isinstance(hf_config, Mapping) else lambda key: getattr(hf_config, key, None)
    text = get("text_config")
    if text is not None:
        return routing_shape(text)
    top_k = get("num_experts_per_tok")
    experts = get("num_experts") or get("num_local_experts") or get("n_routed_experts")
    if not top_k or not experts:
        return None
    return int(get("num_hidden_layers")), int(top_k)


def encode_routed_experts(routed: torch.Tensor) -> str:
    """`[rows, layers, top_k]` expert ids as SGLang sends them: base64 of int32 bytes."""
    return base64.b64encode(routed.to(torch.int32).numpy().tobytes()).decode("ascii")


def decode_routed_experts(text: str, num_layers: int, top_k: int) -> torch.Tensor:
    """Inverse of `encode_routed_experts`: a `[rows, num_layers, top_k]` `ROUTING_DTYPE` tensor.

    Raises:
        ValueError: `text` is not base64 of a whole number of `[num_layers, top_k]` int32 rows.
    """
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError) as error:
        raise ValueError(f"meta_info.routed_experts is not base64: {error}") from None
    per_row = num_layers * top_k * 4
    if len(raw) % per_row:
        raise ValueError(
            f"meta_info.routed_experts has {len(raw)} bytes, not a whole number of rows of {num_layers} layers x "
            f"{top_k} experts (int32); the engine serves a different model than --hf-checkpoint"
        )
    flat = torch.from_numpy(np.frombuffer(raw, dtype=np.int32).copy())
    return flat.view(-1, num_layers, top_k).to(ROUTING_DTYPE)


def routing_rows(routed: torch.Tensor, length: int) -> torch.Tensor:
    """`[length, layers, top_k]` int64 routing of a `length`-token sequence: the engine's rows, then filler rows.

    Raises:
        ValueError: More rows than tokens (the routing belongs to another sequence).
    """
    routed = torch.as_tensor(routed)
    if routed.shape[0] > length:
        raise ValueError(
            f"the routing has {routed.shape[0]} rows for a sequence of {length} tokens; an engine routes at most "
            "one row per token"
        )
    _, num_layers, top_k = routed.shape
    rows = filler_rows(length, num_layers, top_k)
    rows[: routed.shape[0]] = routed.long()
    return rows


def filler_rows(length: int, num_layers: int, top_k: int) -> torch.Tensor:
    """`[length, layers, top_k]` int64 routing to experts 0..k-1: for tokens whose routing changes nothing trained."""
    return torch.arange(top_k).expand(length, num_layers, top_k).clone()


_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_routers(model: nn.Module) -> dict[int, nn.Module]:
    """The `*TopKRouter` / `*TopkRouter` module of each layer, by layer number."""
    found = {}
    for name, module in model.named_modules():
        match = _LAYER_NUMBER.search(name + ".")
        if match and type(module).__name__.lower().endswith("topkrouter"):
            found[int(match.group(1))] = module
    return found


def has_topk_routers(model: nn.Module) -> bool:
    """Whether `model` has routers `HFRouters` can hook."""
    return bool(_layer_routers(model))


class HFRouters:
    """The top-k routers of a HuggingFace MoE model, hooked to record or replay their choices.

    A router here is a module named `*TopKRouter` (or `*TopkRouter`) that returns (logits, weights, experts) for the
    flattened tokens, weights being softmax(logits) at the chosen experts, renormalized unless `norm_topk_prob` is
    false (Qwen-MoE, Mixtral, OLMoE); or, for a router with an `e_score_correction_bias` (DeepSeek-V3, GLM-4.5),
    sigmoid(logits) at the chosen experts, renormalized likewise, times `routed_scaling_factor`. The first replay
    through each router checks that rule against the router's own choice.

    Args:
        model: The model (or an FSDP-wrapped one).
        num_layers: The config's `num_hidden_layers`: the layer axis of recorded and replayed routings.

    Raises:
        ValueError: The model has no such router.
    """

    def __init__(self, model: nn.Module, num_layers: int):
        found = _layer_routers(model)
        if not found:
            raise ValueError(
                f"{type(model).__name__} has no top-k MoE router (a module named *TopKRouter under layers.N); "
                "routing replay needs an MoE model"
            )
        self.layers = sorted(found)
        self.num_layers = num_layers
        self.recorded: dict[int, torch.Tensor] = {}
        self.replay: torch.Tensor | None = None  # [tokens, num_hidden_layers, top_k]
        self._checked: set[int] = set()
        for layer, module in found.items():
            module.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def hook(module: nn.Module, inputs, output):
            logits, weights, experts = output
            self.recorded[layer] = experts.detach()
            if self.replay is None:
                return None
            target = self.replay[:, layer].to(experts.device)
            if target.shape != experts.shape:
                raise ValueError(
                    f"routing replay: layer {layer} routes {tuple(experts.shape)} (tokens, top_k) but the replayed "
                    f"routing gives {tuple(target.shape)}"
                )
            if layer not in self._checked:
                mine = _expert_weights(module, logits, experts, weights.dtype)
                if not torch.allclose(mine, weights, rtol=1e-4, atol=1e-6):
                    raise ValueError(
                        f"routing replay does not know how {type(module).__name__} weighs its experts "
                        "(softmax over the logits, or a scaled sigmoid, at the chosen experts, renormalized); it "
                        "supports the Qwen-MoE / Mixtral / OLMoE / DeepSeek-V3 / GLM-4.5 routers"
                    )
                self._checked.add(layer)
            return logits, _expert_weights(module, logits, target, weights.dtype), target

        return hook

    def take(self) -> torch.Tensor:
        """What the last forward routed: `[tokens, num_layers, top_k]` int32, zeros at dense layers."""
        first = self.recorded[self.layers[0]]
        out = torch.zeros(first.shape[0], self.num_layers, first.shape[1], dtype=torch.int32)
        for layer, experts in self.recorded.items():
            out[:, layer] = experts.cpu()
        return out


def _expert_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if hasattr(router, "e_score_correction_bias"):  # the bias only picks experts; the weights are the plain scores
        weights = torch.sigmoid(logits.float()).gather(1, experts.long())
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * router.routed_scaling_factor).to(dtype)
    weights = torch.softmax(logits.float(), dim=-1).gather(1, experts.long())
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype)
