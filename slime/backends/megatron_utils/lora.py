"""LoRA on megatron-core GPT models: one adapter per HF projection, on Megatron's fused, tensor-parallel linears.

The adapter is the one peft would put on the HF model, so a PEFT adapter folder moves between the two trainers and
the engines: each HF projection (q_proj, k_proj, ... down_proj) gets its own A (r x in) and B (out x r), and the
layer's output grows by (alpha / r) * B(A(dropout(x))). Megatron fuses several projections into one linear, so one
Megatron linear carries several adapters whose outputs are laid out as the fused weight's rows are:

    linear_qkv  (column-parallel): q_proj, k_proj, v_proj   per query group [q heads of the group, k, v]
    linear_proj (row-parallel):    o_proj
    linear_fc1  (column-parallel): gate_proj, up_proj       per TP shard [gate shard, up shard]
    linear_fc2  (row-parallel):    down_proj

Tensor parallelism follows the base layer's split, so no adapter is ever gathered in the forward:
- column-parallel: A is replicated, B holds the rows of this rank's output shard (its query groups / its gate and up
  rows). h = A x is computed on every rank and passed through `copy_to_tensor_model_parallel_region` before B: the
  forward is the identity, the backward all-reduces dL/dh over TP, so A's gradient (and the LoRA part of dL/dx) is
  the full sum and the same on every TP rank, as for any replicated parameter of a non-sequence-parallel model.
- row-parallel: A holds the columns of this rank's input shard, B is replicated. The partial A x_shard is summed
  over TP with `reduce_from_tensor_model_parallel_region` (backward: identity), then B is applied on every rank.
Megatron's DDP and finalize_model_grads therefore need nothing extra (they all-reduce over data parallel only); the
split factors carry Megatron's `tensor_model_parallel` / `partition_dim` attributes so the optimizer's grad norm
counts each shard once and `parallel.gather_tensor_parallel` reassembles them.

Typical use (before DDP wraps the chunks, since DDP allocates gradient buffers for what is trainable then):

    chunks = build_model(args, wrap_with_ddp=False)
    load_hf_weights(chunks, args.hf_checkpoint)        # the base: load it before adding adapters
    leaves = apply_lora(chunks, rank=16, alpha=32, dropout=0.0, target_modules=["all-linear"], exclude_modules=None)
    ... wrap in DistributedDataParallel, build the optimizer, train ...
    tensors = dict(adapter_state_to_hf(chunks))        # PEFT saved names, full tensors
    config = adapter_config(16, 32, 0.0, leaves)

Not supported (refused with a ValueError): TransformerEngine's fused linears (build with --transformer-impl local),
sequence parallelism, adapters on MoE experts (gate/up/down of an MoE layer), multi-latent attention, GLM-4's fused
gate_up_proj, and MTP layers (left without adapters, as they are not HF decoder layers).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from slime.backends.megatron_utils.parallel import gather_tensor_parallel, shard_tensor_parallel
from slime.backends.megatron_utils.unwrap import unwrap_model
from slime.utils.lora import ATTENTION_PROJECTIONS, MLP_PROJECTIONS

ATTENTION_TARGETS = ATTENTION_PROJECTIONS
MLP_TARGETS = MLP_PROJECTIONS
ALL_LINEAR = ATTENTION_TARGETS + MLP_TARGETS

# Megatron linear -> (its parent in the layer, the HF module holding the projections, the projections in output order).
_LINEARS = {
    "linear_qkv": ("self_attention", "self_attn", ("q_proj", "k_proj", "v_proj")),
    "linear_proj": ("self_attention", "self_attn", ("o_proj",)),
    "linear_fc1": ("mlp", "mlp", ("gate_proj", "up_proj")),
    "linear_fc2": ("mlp", "mlp", ("down_proj",)),
}
_COLUMN = ("linear_qkv", "linear_fc1")


class LoraAdapter(nn.Module):
    """One HF projection's adapter (this rank's part of it): `lora_A` (r x in) and `lora_B` (out x r)."""

    def __init__(self, hf_name: str, lora_A: torch.Tensor, lora_B: torch.Tensor):
        super().__init__()
        self.hf_name = hf_name  # e.g. "model.layers.3.self_attn.q_proj" (global layer number)
        self.lora_A = nn.Parameter(lora_A)
        self.lora_B = nn.Parameter(lora_B)


class LoraLayer(nn.Module):
    """The adapters of one Megatron linear, attached to it as `.lora`; `forward(x)` is what the linear's output gains.

    Its children are named by HF leaf (`linear_qkv.lora.q_proj.lora_A`); a projection left out of the targets has no
    child and contributes zeros to its rows of the fused output.
    """

    def __init__(self, kind: str, parts: list[tuple[str, int]], scaling: float, dropout: float, tp_group, groups: int):
        super().__init__()
        self.kind = kind  # a key of _LINEARS
        self.parts = parts  # (HF leaf, this rank's output rows of it), in the fused output's order
        self.scaling = scaling
        self.dropout = dropout
        self.tp_group = tp_group
        self.groups = groups  # this rank's query groups (linear_qkv only)
        self.disabled = False

    def _column_delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        deltas = []
        for leaf, rows in self.parts:
            adapter = self._modules.get(leaf)
            if adapter is None:
                deltas.append(x.new_zeros(*x.shape[:-1], rows))
                continue
            inputs = x
            if self.dropout and self.training:
                # x is replicated over TP and so must the mask be (A is replicated): the default generator is seeded
                # alike on every TP rank, as for Megatron's own dropout outside TP regions. Each projection draws its
                # own mask, as peft's separate modules do.
                inputs = F.dropout(x, self.dropout, True)
            h = F.linear(inputs, adapter.lora_A)
            # Identity forward; the backward all-reduces dL/dh, which each rank knows only for its B rows.
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            deltas.append(F.linear(h, adapter.lora_B) * self.scaling)
        if self.kind == "linear_qkv":
            # Megatron's fused QKV rows go per query group: [q heads of the group, k head, v head].
            q, k, v = (delta.unflatten(-1, (self.groups, -1)) for delta in deltas)
            return torch.cat([q, k, v], dim=-1).flatten(-2)
        return torch.cat(deltas, dim=-1)  # linear_fc1: [gate shard, up shard]

    def _row_delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker, reduce_from_tensor_model_parallel_region

        ((leaf, _),) = self.parts
        adapter = self._modules[leaf]
        if self.dropout and self.training:
            # x is this rank's shard of the input: draw its mask from the per-TP-rank stream (as Megatron's attention
            # dropout on sharded heads does), otherwise every shard would get the same mask pattern.
            with get_cuda_rng_tracker().fork():
                x = F.dropout(x, self.dropout, True)
        # The partial products of the input shards sum to A x; B is replicated.
        h = reduce_from_tensor_model_parallel_region(F.linear(x, adapter.lora_A), group=self.tp_group)
        return F.linear(h, adapter.lora_B) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._column_delta(x) if self.kind in _COLUMN else self._row_delta(x)


def _add_lora_output(linear: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    """Forward hook of an adapted linear: (output, bias) -> (output + LoRA delta, bias)."""
    lora = linear.lora
    if lora.disabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + lora(x).to(out.dtype), bias


def _matches(hf_name: str, keys: list[str]) -> bool:
    """peft's rule for a list of module names: the full name, or a suffix starting at a dot."""
    return any(hf_name == key or hf_name.endswith("." + key) for key in keys)


def _new_factors(
    hf_name: str, rank: int, full_in: int, out_rows: int, seed: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's initialisation: A kaiming-uniform (a=sqrt(5)) over the full input, B zeros (the adapted model starts as
    the base). The generator is seeded from the seed and the HF name, so every rank and every parallel layout gets
    the same A."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{hf_name}".encode()))
    lora_A = torch.empty(rank, full_in)
    nn.init.kaiming_uniform_(lora_A, a=math.sqrt(5), generator=generator)
    lora_B = torch.zeros(out_rows, rank)
    return lora_A.to(like), lora_B.to(like)


def _check_layer(layer: nn.Module, kind: str, leaves: list[str], number: int) -> nn.Module:
    """The Megatron linear `kind` of a decoder layer, or a ValueError saying why it cannot carry these adapters."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    parent_name = _LINEARS[kind][0]
    parent = getattr(layer, parent_name)
    if parent_name == "mlp" and hasattr(parent, "experts"):
        raise ValueError(
            f"--target-modules: layer {number} is an MoE layer; LoRA adapters on expert layers ({' '.join(leaves)}) "
            "are not supported on the Megatron backend. Target attention only: --target-modules q_proj k_proj "
            "v_proj o_proj."
        )
    if parent_name == "mlp" and hasattr(layer, "post_mlp_layernorm"):
        # GLM-4's HF MLP is one gate_up_proj linear, so peft's adapter there is a single pair, not gate + up.
        raise ValueError(
            f"--target-modules {' '.join(leaves)}: GLM-4 fuses gate_proj and up_proj into gate_up_proj in HF; LoRA on "
            "its MLP is not supported on the Megatron backend. Target attention only: --target-modules q_proj k_proj "
            "v_proj o_proj."
        )
    linear = getattr(parent, kind, None)
    if linear is None:
        raise ValueError(
            f"--target-modules {' '.join(leaves)}: layer {number}'s {type(parent).__name__} has no {kind} "
            "(multi-latent attention?); LoRA on the Megatron backend adapts GQA attention and dense MLPs only."
        )
    expected = ColumnParallelLinear if kind in _COLUMN else RowParallelLinear
    if type(linear) is not expected:
        raise ValueError(
            f"layer {number}'s {kind} is a {type(linear).__name__}; LoRA on the Megatron backend supports "
            f"megatron-core's {expected.__name__} only (TransformerEngine's fused layers are not supported): build "
            "the model with --transformer-impl local."
        )
    if hasattr(linear, "lora"):
        raise ValueError(f"layer {number}'s {kind} already has LoRA adapters; apply_lora once per model.")
    if getattr(linear, "gather_output", False) or not getattr(linear, "input_is_parallel", True):
        raise ValueError(f"layer {number}'s {kind}: gathered outputs / scattered inputs are not supported by LoRA.")
    return linear


def _adapt_linear(
    linear: nn.Module, kind: str, layer_number: int, leaves: list[str], config, rank: int, alpha: float,
    dropout: float, seed: int,
) -> None:  # fmt: skip
    """Attach a LoraLayer with adapters for `leaves` (HF leaf names) to one Megatron linear."""
    _, hf_parent, fused = _LINEARS[kind]
    tp_group = linear.tp_group
    tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    weight = linear.weight
    groups = 0
    if kind == "linear_qkv":
        num_groups = config.num_query_groups or config.num_attention_heads
        kv_rows = num_groups * config.kv_channels
        full_rows = {"q_proj": config.num_attention_heads * config.kv_channels, "k_proj": kv_rows, "v_proj": kv_rows}
        groups = num_groups // tp_size
    elif kind == "linear_fc1":
        if not config.gated_linear_unit:
            raise ValueError(
                f"--target-modules {' '.join(leaves)}: this model's MLP is not gated (no gate_proj / up_proj pair); "
                "LoRA on a non-gated linear_fc1 is not supported."
            )
        full_rows = {"gate_proj": linear.output_size // 2, "up_proj": linear.output_size // 2}
    else:
        full_rows = {fused[0]: linear.output_size}

    lora = LoraLayer(
        kind,
        # Column-parallel: each rank holds 1/TP of every projection's rows; row-parallel: all of them.
        [(leaf, full_rows[leaf] // tp_size if kind in _COLUMN else full_rows[leaf]) for leaf in fused],
        scaling=alpha / rank,
        dropout=dropout,
        tp_group=tp_group,
        groups=groups,
    )
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    for leaf in leaves:
        hf_name = f"model.layers.{layer_number}.{hf_parent}.{leaf}"
        full_in = linear.input_size
        lora_A, lora_B = _new_factors(hf_name, rank, full_in, full_rows[leaf], seed, weight)
        if kind in _COLUMN:
            # This rank's rows of the projection: a contiguous block of its HF rows (its query groups' heads, its
            # slice of the gate or up rows), which the forward places into the fused layout.
            lora_B = lora_B.chunk(tp_size, dim=0)[tp_rank].clone()
        else:
            lora_A = lora_A.chunk(tp_size, dim=1)[tp_rank].clone()
        adapter = LoraAdapter(hf_name, lora_A, lora_B)
        if kind in _COLUMN:
            set_tensor_model_parallel_attributes(adapter.lora_B, True, 0, 1)
        else:
            set_tensor_model_parallel_attributes(adapter.lora_A, True, 1, 1)
        lora.add_module(leaf, adapter)
    linear.lora = lora
    linear.register_forward_hook(_add_lora_output, with_kwargs=True)


def apply_lora(
    model_chunks: list[nn.Module],
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: list[str],
    exclude_modules: list[str] | None = None,
    seed: int = 0,
) -> list[str]:
    """Freeze the model and add LoRA adapters to the targeted linears of every decoder layer of every chunk.

    Args:
        model_chunks: the chunks of `build_model(args, wrap_with_ddp=False)` (Float16Module allowed, DDP not: wrap
            after this, since Megatron's DDP allocates gradient buffers for the parameters trainable at wrap time).
        rank: the LoRA rank r (`--lora-rank`).
        alpha: the scaling numerator (`--lora-alpha`); outputs gain (alpha / r) * B A x.
        dropout: dropout on the adapter input in training (`--lora-dropout`).
        target_modules: `["all-linear"]` or HF leaf names (`--target-modules`).
        exclude_modules: HF module names left without an adapter, matched as peft does: a leaf name (`o_proj`) or a
            path suffix (`model.layers.1.mlp.down_proj`) (`--exclude-modules`).
        seed: seeds A's initialisation (the same values on every rank and parallel layout).

    Returns:
        the HF leaf names that got adapters on this rank, sorted (for `adapter_config`).

    Raises:
        ValueError: an unknown target (naming --target-modules), targets that leave nothing to adapt, sequence
            parallelism, DDP-wrapped chunks, or a layer kind LoRA does not support (MoE experts, TransformerEngine).
    """
    from megatron.core.distributed import DistributedDataParallel

    if rank <= 0:
        raise ValueError(f"--lora-rank must be positive (got {rank}).")
    flag = f"--target-modules {' '.join(target_modules)}"
    wanted = list(ALL_LINEAR) if list(target_modules) == ["all-linear"] else list(target_modules)
    unknown = [name for name in wanted if name not in ALL_LINEAR]
    if unknown or not wanted:
        raise ValueError(
            f"{flag}: {' '.join(unknown) or 'nothing'} matches no linear layer the Megatron backend adapts; use "
            f"all-linear or HF leaf names from: {' '.join(ALL_LINEAR)}."
        )
    exclude = list(exclude_modules or [])
    chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
    for chunk in chunks:
        if isinstance(chunk, DistributedDataParallel):
            raise ValueError(
                "apply_lora before wrapping the chunks in DistributedDataParallel (build_model(args, "
                "wrap_with_ddp=False)): DDP only allocates gradients for what is trainable when it wraps."
            )
        if unwrap_model(chunk).config.sequence_parallel:
            raise ValueError(
                "LoRA on the Megatron backend does not support --sequence-parallel (the adapters' inputs and "
                "gradients would need sequence-parallel gathers); drop --sequence-parallel."
            )

    # Check every layer before changing any, so a refusal leaves the model as it was.
    plan = []
    for chunk in chunks:
        gpt = unwrap_model(chunk)
        # Only the decoder: MTP layers are not HF decoder layers, so peft's adapter has nothing for them.
        for layer in gpt.decoder.layers:
            number = layer.layer_number - 1  # Megatron's is global (pipeline offset included) and 1-based
            for kind, (_, hf_parent, fused) in _LINEARS.items():
                leaves = [
                    leaf
                    for leaf in fused
                    if leaf in wanted and not _matches(f"model.layers.{number}.{hf_parent}.{leaf}", exclude)
                ]
                if leaves:
                    plan.append((gpt.config, _check_layer(layer, kind, leaves, number), kind, number, leaves))
    if not plan:
        raise ValueError(f"{flag} with --exclude-modules {' '.join(exclude)} leaves no layer to adapt.")

    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
    adapted: set[str] = set()
    for config, linear, kind, number, leaves in plan:
        _adapt_linear(linear, kind, number, leaves, config, rank, alpha, dropout, seed)
        adapted.update(leaves)
    return sorted(adapted)


def _adapters(model_chunks: list[nn.Module]) -> Iterator[tuple[nn.Module, str, LoraAdapter]]:
    """(chunk, local module name, adapter) in module order: the same order on every rank of a stage."""
    for chunk in model_chunks if isinstance(model_chunks, list) else [model_chunks]:
        for name, module in chunk.named_modules():
            if isinstance(module, LoraAdapter):
                yield chunk, name, module


def _saved_name(adapter: LoraAdapter, factor: str) -> str:
    return f"base_model.model.{adapter.hf_name}.{factor}.weight"


def adapter_state_to_hf(model_chunks: list[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (PEFT saved name, full tensor) for this rank's pipeline stage, e.g.
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, with global layer numbers.

    A collective over tensor parallelism: every TP rank must iterate to the end. The tensors are copies.
    """
    for chunk, name, adapter in _adapters(model_chunks):
        for factor in ("lora_A", "lora_B"):
            full = gather_tensor_parallel(f"{name}.{factor}", getattr(adapter, factor), chunk)
            yield _saved_name(adapter, factor), full.detach().clone()


def load_adapter_from_hf(model_chunks: list[nn.Module], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy a PEFT adapter's tensors (saved names, full tensors) into the adapters `apply_lora` created, each rank
    taking its shard. Tensors of layers on other pipeline stages are ignored.

    Raises:
        KeyError: a tensor this rank's adapters need is missing.
        ValueError: a tensor's shape does not match (another rank or targets).
    """
    _copy_into_adapters(model_chunks, tensors, "the adapter", full_tensors=True)


def adapter_sharded_state_dict(model_chunks: list[nn.Module]) -> dict:
    """This rank's adapters as megatron-core dist-checkpoint `ShardedTensor`s, keyed by PEFT saved name (global
    layer numbers): each split factor along its tensor-parallel axis, each replicated one as a replica.

    Megatron's own `sharded_state_dict` of an adapted linear would take the adapters for replicated tensors and keep
    only TP rank 0's shard of the split ones. The tensors are the parameters themselves, so an optimizer's
    `sharded_state_dict` maps its state onto these keys; and since a key names the full HF tensor, a checkpoint of
    them loads under another parallel layout.
    """
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    state = {}
    for _, _, adapter in _adapters(model_chunks):
        for factor in ("lora_A", "lora_B"):
            param, key = getattr(adapter, factor), _saved_name(adapter, factor)
            if getattr(param, "tensor_model_parallel", False):
                state[key] = make_tp_sharded_tensor_for_checkpoint(param, key, tp_axis=param.partition_dim)
            else:
                state[key] = make_sharded_tensor_for_checkpoint(param, key)
    return state


def load_adapter_shards(model_chunks: list[nn.Module], shards: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's shards (`adapter_sharded_state_dict`'s keys, as dist-checkpoint loading returns them) into
    the adapters.

    Raises:
        KeyError: an adapter of this rank is missing from `shards`.
    """
    _copy_into_adapters(model_chunks, shards, "the checkpoint", full_tensors=False)


def _copy_into_adapters(
    model_chunks: list[nn.Module], tensors: Mapping[str, torch.Tensor], source: str, full_tensors: bool
) -> None:
    """Copy `tensors` (by PEFT saved name) into this rank's adapters: full tensors are cut to this rank's
    tensor-parallel shard first, shards go in as they are. `source` names where they came from in the error."""
    for chunk, name, adapter in _adapters(model_chunks):
        for factor in ("lora_A", "lora_B"):
            key = _saved_name(adapter, factor)
            if key not in tensors:
                raise KeyError(f"{source} has no {key}; was it trained with other --target-modules?")
            param = getattr(adapter, factor)
            value = tensors[key]
            if full_tensors:
                value = shard_tensor_parallel(f"{name}.{factor}", value, param, chunk)
            with torch.no_grad():
                param.copy_(value.to(dtype=param.dtype, device=param.device))


@contextlib.contextmanager
def disable_adapters(model_chunks: list[nn.Module]) -> Iterator[None]:
    """Within the block the model computes the base model's outputs (the reference model under LoRA).

    Only each layer's switch is flipped; `requires_grad` stays as it is, so DDP and the optimizer see no change.
    """
    layers = [
        module
        for chunk in (model_chunks if isinstance(model_chunks, list) else [model_chunks])
        for module in chunk.modules()
        if isinstance(module, LoraLayer)
    ]
    states = [layer.disabled for layer in layers]
    for layer in layers:
        layer.disabled = True
    try:
        yield
    finally:
        for layer, state in zip(layers, states, strict=True):
            layer.disabled = state


def adapter_config(
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: list[str],
    exclude_modules: list[str] | None = None,
    base_model_name_or_path: str | None = None,
) -> dict:
    """An `adapter_config.json` dict that `peft.PeftModel.from_pretrained` loads.

    Args:
        target_modules: HF leaf names (`apply_lora`'s return value) or `["all-linear"]` (written as the leaf names).
        exclude_modules: as given to `apply_lora`; kept so peft skips the same modules.
    """
    targets = ALL_LINEAR if list(target_modules) == ["all-linear"] else target_modules
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(targets),
        "exclude_modules": sorted(exclude_modules) if exclude_modules else None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
