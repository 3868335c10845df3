"""LoRA adapters of the CPU engine: read and check PEFT adapters, and apply them per row of a batch.

An adapter is PEFT's saved format: `adapter_config.json` and, for every targeted `nn.Linear`, the tensors
`base_model.model.<module>.lora_A.weight` ([r, in]) and `base_model.model.<module>.lora_B.weight` ([out, r]).
The model is never changed: a forward hook on each targeted Linear adds `scaling * (x @ A.T) @ B.T` to the
output rows whose request uses that adapter, so one batch can mix rows of several adapters with base rows,
and full-weight updates and memory release leave the adapters alone.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load as load_safetensors

from slime.backends.cpu_engine.weights import all_finite, read_regular_file
from slime.utils.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

SAVED_PREFIX = "base_model.model."
# PEFT's spelling of "every linear layer but the output one", and SGLang's (for --lora-target-modules).
ALL_LINEAR = ("all-linear", "all")

# adapter_config.json fields that change the forward pass in ways not implemented here; each is accepted only
# at a neutral value (null, false, {} or []).
_UNSUPPORTED_CONFIG = {
    "fan_in_fan_out": "weights stored transposed (Conv1D layers)",
    "use_dora": "DoRA",
    "lora_bias": "a bias on lora_B",
    "use_qalora": "QALoRA",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "layers_to_transform": "a subset of layers",
    "layers_pattern": "a subset of layers",
    "modules_to_save": "fully trained modules",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "LoRA on bare parameters",
    "layer_replication": "replicated layers",
    "alora_invocation_tokens": "activated LoRA",
    "arrow_config": "Arrow routing",
    "use_bdlora": "block-diagonal LoRA",
    "kasa_config": "KaSA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
}


@dataclass(eq=False)
class LoraAdapter:
    """A checked adapter, ready to apply.

    Args:
        name: The name requests use in `lora_path`.
        source: The folder it was read from, or `name` for tensors sent in a request.
        rank: `r`.
        scaling: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`.
        weights: HF module name -> (A [r, in], B [out, r]).
    """

    name: str
    source: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LinearLayout:
    """The modules of a model as adapters see them.

    Args:
        shapes: Module name -> (in_features, out_features) of every `nn.Linear` an adapter may target.
        others: Module name -> why an adapter may not target it (the output embedding, an embedding, ...).
    """

    shapes: dict[str, tuple[int, int]]
    others: dict[str, str]

    @property
    def leaf_names(self) -> set[str]:
        return {name.rpartition(".")[2] for name in self.shapes}


def linear_layout(model: torch.nn.Module) -> LinearLayout:
    """What `LinearLayout` says about `model`: every `nn.Linear` but the output embedding and MoE experts."""
    output = model.get_output_embeddings()
    shapes, others = {}, {}
    for name, module in model.named_modules():
        if not name:
            continue
        if module is output:
            others[name] = "the output embedding (lm_head)"
        elif isinstance(module, torch.nn.Linear) and ".experts." in f".{name}.":
            # Their inputs are tokens gathered per expert, so their rows are no batch rows.
            others[name] = "an MoE expert"
        elif isinstance(module, torch.nn.Linear):
            shapes[name] = (module.in_features, module.out_features)
        else:
            others[name] = f"a {type(module).__name__}, not an nn.Linear"
    return LinearLayout(shapes, others)


def check_target_modules(target_modules: list[str], layout: LinearLayout) -> None:
    """Refuse a `--lora-target-modules` list that names no Linear leaf of the model; ValueError naming it."""
    if any(name in ALL_LINEAR for name in target_modules):
        if len(target_modules) > 1:
            raise ValueError(f"--lora-target-modules {' '.join(target_modules)}: give 'all-linear' alone or leaf names")
        return
    unknown = sorted(set(target_modules) - layout.leaf_names)
    if unknown:
        raise ValueError(
            f"--lora-target-modules {' '.join(unknown)}: no nn.Linear of this model is named so; "
            f"its Linear leaf names are {sorted(layout.leaf_names)} (or pass all-linear)"
        )


@dataclass(frozen=True)
class AdapterConfig:
    """What the engine reads from `adapter_config.json`.

    Args:
        rank: `r`.
        scaling: The factor applied to `B @ A`.
        target_modules: Module names or suffixes, or None for PEFT's "all-linear".
        exclude_modules: Module names or suffixes left out of `target_modules`.
    """

    rank: int
    scaling: float
    target_modules: list[str] | None
    exclude_modules: list[str]


def _is_neutral(value: Any) -> bool:
    return value is None or value is False or value == {} or value == []


def parse_adapter_config(config: Any, max_rank: int | None = None) -> AdapterConfig:
    """Check a PEFT LoRA `adapter_config.json` object and read the fields the engine uses.

    Args:
        config: The decoded JSON.
        max_rank: The engine's `--max-lora-rank`; None for no limit.

    Raises:
        ValueError: naming the field and what to send instead.
    """
    if not isinstance(config, dict):
        raise ValueError(
            f"the adapter config must be a JSON object ({ADAPTER_CONFIG_FILE}), got {type(config).__name__}"
        )
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"adapter config peft_type={peft_type!r}: only LoRA adapters (peft_type 'LORA') are served")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"adapter config r={rank!r} must be a positive integer (the LoRA rank)")
    if max_rank is not None and rank > max_rank:
        raise ValueError(
            f"adapter config r={rank} exceeds this engine's --max-lora-rank {max_rank}; "
            f"restart the engine with --max-lora-rank {rank} or use an adapter of rank <= {max_rank}"
        )
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ValueError(f"adapter config lora_alpha={alpha!r} must be a finite number")
    bias = config.get("bias", "none")
    if bias != "none":
        raise ValueError(f"adapter config bias={bias!r} is not supported (trained biases); only bias 'none' is")
    for key, what in _UNSUPPORTED_CONFIG.items():
        if not _is_neutral(config.get(key)):
            raise ValueError(
                f"adapter config {key}={config[key]!r} ({what}) is not supported by the CPU engine, which serves "
                "plain LoRA on nn.Linear layers; save the adapter without it, or merge it into the model's weights "
                "and load those with /update_weights_from_disk"
            )
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ValueError(f"adapter config use_rslora={rslora!r} must be true or false")
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets in ALL_LINEAR:
        modules = None
    elif isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
        modules = list(targets)
    else:
        raise ValueError(
            f"adapter config target_modules={targets!r} must be a non-empty list of module names (e.g. "
            "['q_proj', 'v_proj']) or 'all-linear'; regular expressions are not supported"
        )
    exclude = config.get("exclude_modules") or []
    if not isinstance(exclude, list) or not all(isinstance(e, str) and e for e in exclude):
        raise ValueError(
            f"adapter config exclude_modules={exclude!r} must be null or a list of module names; "
            "regular expressions are not supported"
        )
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    return AdapterConfig(rank=rank, scaling=scaling, target_modules=modules, exclude_modules=exclude)


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith(f".{pattern}")


def resolve_targets(config: AdapterConfig, layout: LinearLayout, allowed: list[str] | None = None) -> set[str]:
    """The module names an adapter targets, as PEFT matches them: a name equal to a target or ending in `.<target>`,
    and none of `exclude_modules`.

    Args:
        config: From `parse_adapter_config`.
        layout: The model's `linear_layout`.
        allowed: The engine's `--lora-target-modules` (Linear leaf names); None or 'all-linear' allows all.

    Raises:
        ValueError: for a target that matches nothing, matches a module that is no servable Linear, or is
            outside `allowed`.
    """

    def kept(names) -> list[str]:
        return [n for n in names if not any(_matches(n, e) for e in config.exclude_modules)]

    if config.target_modules is None:
        targets = set(kept(layout.shapes))
    else:
        targets = set()
        for target in config.target_modules:
            matched = [n for n in (*layout.shapes, *layout.others) if _matches(n, target)]
            if not matched:
                raise ValueError(
                    f"adapter config target_modules names {target!r}, which matches no module of this model; "
                    f"its Linear leaf names are {sorted(layout.leaf_names)}"
                )
            matched = kept(matched)
            refused = [n for n in matched if n in layout.others]
            if refused:
                raise ValueError(
                    f"adapter config target_modules names {target!r}, which matches {refused[0]!r}, "
                    f"{layout.others[refused[0]]}; the CPU engine applies LoRA to nn.Linear layers only "
                    "(no embeddings, no lm_head): drop it from target_modules"
                )
            targets.update(matched)
    if allowed is not None and not any(name in ALL_LINEAR for name in allowed):
        outside = sorted({name.rpartition(".")[2] for name in targets} - set(allowed))
        if outside:
            raise ValueError(
                f"the adapter targets {outside}, outside this engine's --lora-target-modules {' '.join(allowed)}; "
                f"restart the engine with those modules added (or --lora-target-modules all-linear), "
                "or use an adapter without them"
            )
    return targets


def _module_of(tensor_name: str) -> tuple[str, str]:
    """PEFT's saved name -> (HF module name, "A" or "B")."""
    for kind in ("A", "B"):
        suffix = f".lora_{kind}.weight"
        if tensor_name.startswith(SAVED_PREFIX) and tensor_name.endswith(suffix):
            module = tensor_name[len(SAVED_PREFIX) : -len(suffix)]
            if module:
                return module, kind
    raise ValueError(
        f"adapter tensor {tensor_name!r} is not named as PEFT saves LoRA weights "
        f"({SAVED_PREFIX}<module>.lora_A.weight / .lora_B.weight); only plain LoRA weights are accepted"
    )


def build_adapter(
    name: str,
    source: str,
    config: Any,
    named_tensors: list[tuple[str, torch.Tensor]],
    layout: LinearLayout,
    max_rank: int | None = None,
    allowed: list[str] | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoraAdapter:
    """Check an adapter completely and return it; nothing is kept from one that fails.

    Args:
        name: Its `lora_name`.
        source: Where it came from, for `loaded_adapters`.
        config: The `adapter_config.json` object.
        named_tensors: (PEFT saved name, tensor) pairs.
        layout: The model's `linear_layout`.
        max_rank: `--max-lora-rank`, None for no limit.
        allowed: `--lora-target-modules`, None for all.
        dtype: The model's dtype; each tensor is copied into it once, before its values are checked (so a view of
            memory another process writes, such as a shared-memory segment, cannot change after the check).

    Raises:
        ValueError: naming the field, tensor or module at fault and the fix.
    """
    parsed = parse_adapter_config(config, max_rank)
    targets = resolve_targets(parsed, layout, allowed)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in named_tensors:
        module, kind = _module_of(tensor_name)
        if module not in targets:
            why = (
                f"which is {layout.others[module]}"
                if module in layout.others
                else "which adapter config target_modules does not target"
                if module in layout.shapes
                else "which is no module of this model"
            )
            raise ValueError(f"adapter tensor {tensor_name!r} is for {module!r}, {why}")
        if kind in parts.setdefault(module, {}):
            raise ValueError(f"adapter tensor {tensor_name!r} is given twice")
        if not tensor.dtype.is_floating_point:
            raise ValueError(
                f"adapter tensor {tensor_name!r} has dtype {tensor.dtype}; LoRA weights are floating point"
            )
        in_features, out_features = layout.shapes[module]
        expected = (parsed.rank, in_features) if kind == "A" else (out_features, parsed.rank)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"adapter tensor {tensor_name!r} has shape {list(tensor.shape)}, expected {list(expected)} "
                f"(lora_A is [r, in_features], lora_B [out_features, r], r={parsed.rank} from the config)"
            )
        owned = tensor.to(dtype, copy=True).contiguous()
        if not all_finite(owned):
            raise ValueError(f"adapter tensor {tensor_name!r} holds NaN or infinite values")
        parts[module][kind] = owned
    missing = [f"{SAVED_PREFIX}{m}.lora_{k}.weight" for m in sorted(targets) for k in "AB" if k not in parts.get(m, {})]
    if missing:
        raise ValueError(
            f"the adapter lacks {len(missing)} tensor(s) of the modules its config targets, e.g. {missing[:4]}; "
            "send both lora_A and lora_B of every targeted module"
        )
    weights = {module: (pair["A"], pair["B"]) for module, pair in parts.items()}
    return LoraAdapter(name=name, source=source, rank=parsed.rank, scaling=parsed.scaling, weights=weights)


def read_adapter_folder(path: str | Path, max_bytes: int) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """Read a PEFT adapter folder: (config object, (name, tensor) pairs). Only regular files are opened,
    only safetensors are read (never a pickle), and none larger than `max_bytes` (`LoraStore.max_adapter_bytes`).

    Raises:
        ValueError: naming the path and what it should hold.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"lora_path {str(path)!r} is not a directory; pass a PEFT adapter folder ({ADAPTER_CONFIG_FILE} + {ADAPTER_WEIGHTS_FILE})"
        )
    weights_file = folder / ADAPTER_WEIGHTS_FILE
    if not weights_file.exists() and (folder / "adapter_model.bin").exists():
        raise ValueError(
            f"lora_path {str(path)!r} holds adapter_model.bin, a pickle, which the engine never loads; "
            "save the adapter with save_pretrained(..., safe_serialization=True) to get adapter_model.safetensors"
        )
    raw_config = read_regular_file(folder / ADAPTER_CONFIG_FILE, max_bytes=2**20)
    try:
        config = json.loads(raw_config)
    except ValueError as error:
        raise ValueError(f"{folder / ADAPTER_CONFIG_FILE} is not valid JSON: {error}") from None
    raw_weights = read_regular_file(weights_file, max_bytes)
    try:
        tensors = load_safetensors(raw_weights)
    except Exception as error:  # SafetensorError: bad header, truncated
        raise ValueError(f"{weights_file} is not a readable safetensors file ({error})") from None
    return config, list(tensors.items())


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """What an adapter adds to a Linear's output for input `x`: `scaling * (x @ A.T) @ B.T`."""
    return F.linear(F.linear(x, a), b) * scaling


class LoraStore:
    """The adapters an engine holds, and the forward hooks that apply them to the rows of a batch.

    Used on the engine's worker thread; the engine reads and changes `adapters` under its own lock.

    Args:
        model: The served model (never changed).
        max_rank: `--max-lora-rank`; None for no limit.
        target_modules: `--lora-target-modules`; None for all Linear layers.
        max_per_batch: `--max-loras-per-batch`: most distinct adapters in one running batch.
        max_loaded: `--max-loaded-loras`: most adapters held at once.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_rank: int | None = None,
        target_modules: list[str] | None = None,
        max_per_batch: int = 8,
        max_loaded: int = 16,
    ):
        self.layout = linear_layout(model)
        self.max_loaded = max_loaded
        if target_modules is not None:
            check_target_modules(target_modules, self.layout)
        self.max_rank = max_rank
        self.target_modules = target_modules
        self.max_per_batch = max_per_batch
        self.dtype = model.dtype
        self.adapters: dict[str, LoraAdapter] = {}
        self._modules = dict(model.named_modules())
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        # For the forward running now: (row index or None for every row, adapter), and the batch's row count.
        self._plan: list[tuple[torch.Tensor | None, LoraAdapter]] = []
        self._rows = 0

    def build(self, name: str, source: str, config: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> LoraAdapter:
        """`build_adapter` against this engine's model and flags (safe on any thread)."""
        return build_adapter(
            name, source, config, named_tensors, self.layout, self.max_rank, self.target_modules, self.dtype
        )

    def max_adapter_bytes(self) -> int:
        """The largest adapter file this engine could accept: every Linear targeted at the highest rank allowed,
        in 8-byte floats, plus room for the header. Anything larger is refused before it is read."""
        total = 0
        for in_features, out_features in self.layout.shapes.values():
            rank = min(self.max_rank or in_features, in_features, out_features)
            total += rank * (in_features + out_features) * 8
        return total + 2**20

    def loaded(self) -> dict[str, str]:
        """name -> source of every adapter held."""
        return {name: adapter.source for name, adapter in self.adapters.items()}

    def check_free(self, name: str) -> None:
        """ValueError when an adapter named `name` is loaded (SGLang's rule: unload it first)."""
        held = self.adapters.get(name)
        if held is not None:
            raise ValueError(
                f"an adapter named {name!r} is already loaded (from {held.source}); "
                "unload it first (/unload_lora_adapter) or pick another lora_name"
            )
        if len(self.adapters) >= self.max_loaded:
            raise ValueError(
                f"the engine already holds {len(self.adapters)} adapters (--max-loaded-loras {self.max_loaded}); "
                "unload one first (/unload_lora_adapter)"
            )

    def add(self, adapter: LoraAdapter) -> None:
        """Hold `adapter` and hook the modules it targets; ValueError when its name is taken."""
        self.check_free(adapter.name)
        self.adapters[adapter.name] = adapter
        self._sync_hooks()

    def remove(self, name: str) -> None:
        del self.adapters[name]
        self._sync_hooks()

    def _sync_hooks(self) -> None:
        """Hook exactly the modules some held adapter targets: no cost on the others."""
        wanted = {module for adapter in self.adapters.values() for module in adapter.weights}
        for module in set(self._hooks) - wanted:
            self._hooks.pop(module).remove()
        for module in wanted - set(self._hooks):
            self._hooks[module] = self._modules[module].register_forward_hook(self._hook(module))

    def _hook(self, module_name: str):
        def add_adapters(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if not self._plan:
                return None
            x = args[0]
            for index, adapter in self._plan:
                pair = adapter.weights.get(module_name)
                if pair is not None:
                    output = self._add(output, x, pair, adapter.scaling, index)
            return output

        return add_adapters

    def _add(
        self,
        output: torch.Tensor,
        x: torch.Tensor,
        pair: tuple[torch.Tensor, torch.Tensor],
        scaling: float,
        index: torch.Tensor | None,
    ) -> torch.Tensor:
        if index is None:
            return output + lora_delta(x, *pair, scaling)
        shape = output.shape
        if x.shape[0] != self._rows:
            # Some layers (MoE routers) see the batch flattened to [rows * tokens, features].
            if x.shape[0] % self._rows:
                raise RuntimeError(f"a LoRA layer got {x.shape[0]} input rows for a batch of {self._rows}")
            x = x.reshape(self._rows, -1, x.shape[-1])
            output = output.reshape(self._rows, -1, shape[-1])
        delta = lora_delta(x.index_select(0, index), *pair, scaling)
        return output.index_add(0, index, delta).reshape(shape)

    @contextlib.contextmanager
    def rows(self, names: list[str | None]) -> Iterator[None]:
        """Within the block, every forward adds to row i the adapter `names[i]` (None: the base model)."""
        groups: dict[str, list[int]] = {}
        for row, name in enumerate(names):
            if name is not None:
                groups.setdefault(name, []).append(row)
        if len(groups) == 1 and len(next(iter(groups.values()))) == len(names):
            self._plan = [(None, self.adapters[next(iter(groups))])]  # one adapter for all: no gather
        else:
            self._plan = [(torch.tensor(rows), self.adapters[name]) for name, rows in groups.items()]
        self._rows = len(names)
        try:
            yield
        finally:
            self._plan, self._rows = [], 0
