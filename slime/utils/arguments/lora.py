"""The 'LoRA' group: train a low-rank adapter instead of the full weights (miles' flag names), and its checks."""

from __future__ import annotations

import argparse
import json
import os

from slime.utils.arguments.errors import _fail
from slime.utils.lora import ADAPTER_CONFIG_FILE, ATTENTION_PROJECTIONS, MLP_PROJECTIONS
from slime.utils.moe_routing import routing_shape


def _add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA")
    group.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="Train a LoRA adapter of this rank on the actor (0: train the full weights). The base stays frozen, the "
        "reference model is the base itself, and each weight update pushes only the adapter, which the engines "
        "serve with SGLang's LoRA API. Both trainers; --train-backend megatron needs --transformer-impl local and "
        "adapts q/k/v/o_proj and gate/up/down_proj only (no --sequence-parallel, no MoE expert, GLM-4 MLP or "
        "multi-latent attention q/k/v targets).",
    )
    group.add_argument(
        "--lora-alpha", type=float, default=16.0, help="LoRA scaling numerator: updates scale by alpha/r."
    )
    group.add_argument("--lora-dropout", type=float, default=0.0, help="Dropout on the adapter's input in training.")
    group.add_argument(
        "--target-modules",
        nargs="+",
        default=["all-linear"],
        help="Modules that get an adapter: all-linear (every linear layer but the LM head) or HF leaf names such as "
        "q_proj v_proj (with --train-backend megatron: among q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj).",
    )
    group.add_argument(
        "--exclude-modules",
        nargs="+",
        default=None,
        help="Modules to leave without an adapter: leaf names (o_proj) or module paths (model.layers.1.mlp.down_proj).",
    )
    group.add_argument(
        "--lora-adapter-path",
        default=None,
        help="Start from this PEFT adapter folder (adapter_config.json + adapter_model.safetensors) instead of a "
        "new adapter; its rank and targets must match the flags.",
    )
    group.add_argument(
        "--lora-train-only",
        action="store_true",
        help="Train the adapter while the engines keep generating with the base model: no weight update is pushed "
        "and rollouts request no adapter, so the rollouts are off-policy once the adapter moves (the train/rollout "
        "log-prob gap shows by how much; --use-tis corrects for it).",
    )
    group.add_argument(
        "--check-lora-weight-equal",
        action="store_true",
        help="After every adapter push, check that each engine's log-probs under the adapter equal the trainer's.",
    )
    group.add_argument(
        "--multi-lora-n-adapters",
        type=int,
        default=1,
        help="Train this many adapters on one base, each with its own data and optimizer.",
    )


def _validate_lora(args: argparse.Namespace) -> None:
    """The LoRA flags among themselves and with the rest of the command line."""
    lora_flags_given = [
        flag
        for flag, given in (
            ("--lora-adapter-path", args.lora_adapter_path is not None),
            ("--lora-dropout", args.lora_dropout != 0.0),
            ("--exclude-modules", args.exclude_modules is not None),
            ("--check-lora-weight-equal", args.check_lora_weight_equal),
            ("--lora-train-only", args.lora_train_only),
            ("--target-modules", args.target_modules != ["all-linear"]),
        )
        if given
    ]
    if args.lora_rank == 0:
        if lora_flags_given:
            _fail(f"{', '.join(lora_flags_given)} configure a LoRA adapter; add --lora-rank R (e.g. 16) or drop them.")
        return
    if args.lora_rank < 0:
        _fail(f"--lora-rank must be a positive rank, or 0 to train the full weights (got {args.lora_rank}).")
    if not args.lora_alpha > 0:
        _fail(f"--lora-alpha must be positive (got {args.lora_alpha}); the adapter's updates scale by alpha/rank.")
    if not 0.0 <= args.lora_dropout < 1.0:
        _fail(f"--lora-dropout must be in [0, 1) (got {args.lora_dropout}).")
    if args.lora_train_only and args.check_lora_weight_equal:
        _fail(
            "--lora-train-only keeps the engines on the base model and pushes no adapter, so "
            "--check-lora-weight-equal has nothing to check: drop one."
        )
    if "all-linear" in args.target_modules and len(args.target_modules) > 1:
        _fail(f"--target-modules {' '.join(args.target_modules)}: all-linear stands alone; or list leaf names.")
    if args.lora_adapter_path is not None:
        _validate_adapter_folder(args)
    if args.use_critic:
        _fail("--lora-rank trains the actor's adapter; a PPO critic with LoRA is not implemented: drop --lora-rank.")
    if args.ref_load is not None or args.ref_update_interval is not None:
        flag = "--ref-load" if args.ref_load is not None else "--ref-update-interval"
        _fail(f"with --lora-rank the reference model is the base model (the adapter switched off); drop {flag}.")
    for flag, given in (
        ("--only-train-params-name-list", args.only_train_params_name_list),
        ("--freeze-params-name-list", args.freeze_params_name_list),
    ):
        if given:
            _fail(f"--lora-rank trains the adapter and freezes everything else; drop {flag}.")
    if args.debug_rollout_only:
        _fail(
            "--debug-rollout-only has no trainer to load the adapter onto the engines, which --lora-rank requests "
            "generate with; drop one."
        )
    if args.load and os.path.isfile(os.path.join(args.load, "config.json")):
        if os.path.realpath(args.load) != os.path.realpath(args.hf_checkpoint):
            _fail(
                f"--load {args.load} is a HuggingFace folder other than --hf-checkpoint {args.hf_checkpoint}: with "
                "--lora-rank the engines serve --hf-checkpoint as the base and receive only the adapter, so the "
                f"trainer's base must be the same; pass --hf-checkpoint {args.load}."
            )
    if args.update_weight_transport == "disk" and not args.colocate:
        _fail(
            "--lora-rank pushes the adapter in the request body (it is small); --update-weight-transport disk is not "
            "used for adapters yet: drop it."
        )
    if args.train_backend == "megatron":
        _validate_megatron_lora(args)


def _validate_megatron_lora(args: argparse.Namespace) -> None:
    """What LoRA on megatron-core (slime/backends/megatron_utils/lora.py) cannot do, refused before a model is built.

    The model's kind (MoE, GLM-4, multi-latent attention) is read from the model flags when given, else from
    --hf-checkpoint's config.json; when neither tells, building the model refuses what it cannot adapt.
    """
    impl = getattr(args, "transformer_impl", None)
    if impl != "local":
        given = f"--transformer-impl {impl}" if impl else "Megatron's default --transformer-impl transformer_engine"
        _fail(
            f"--lora-rank with --train-backend megatron adapts megatron-core's own linear layers, not "
            f"TransformerEngine's ({given}): pass --transformer-impl local."
        )
    if args.sequence_parallel:
        _fail(
            "--lora-rank with --train-backend megatron does not support --sequence-parallel (the adapters' inputs "
            "and gradients would need sequence-parallel gathers): drop --sequence-parallel."
        )
    if args.context_parallel_size > 1:
        _fail(
            f"--context-parallel-size {args.context_parallel_size} needs TransformerEngine attention, and --lora-rank "
            "with --train-backend megatron needs --transformer-impl local: drop --context-parallel-size."
        )
    adaptable = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
    flag = f"--target-modules {' '.join(args.target_modules)}"
    unknown = [name for name in args.target_modules if name != "all-linear" and name not in adaptable]
    if unknown:
        _fail(
            f"{flag}: the Megatron backend adapts only {' '.join(adaptable)} (or all-linear), not "
            f"{' '.join(unknown)}; name those, or use --train-backend fsdp."
        )
    excluded = args.exclude_modules or []
    if any("." in name for name in excluded):
        return  # module paths may leave out exactly the layers that cannot carry adapters: building the model tells
    targeted = set(adaptable if args.target_modules == ["all-linear"] else args.target_modules) - set(excluded)
    mlp = [name for name in MLP_PROJECTIONS if name in targeted]
    qkv = [name for name in ATTENTION_PROJECTIONS[:3] if name in targeted]
    model, moe, glm4, mla = _megatron_model_kind(args)
    if mlp and moe:
        _fail(
            f"{flag}: {model} is an MoE model, and LoRA on its expert layers ({' '.join(mlp)}) is not supported with "
            "--train-backend megatron: pass --target-modules q_proj k_proj v_proj o_proj, or use --train-backend fsdp."
        )
    if mlp and glm4:
        _fail(
            f"{flag}: {model} is GLM-4, whose HF MLP fuses gate_proj and up_proj into gate_up_proj; LoRA on its MLP "
            "is not supported with --train-backend megatron: pass --target-modules q_proj k_proj v_proj o_proj, or "
            "use --train-backend fsdp."
        )
    if qkv and mla:
        _fail(
            f"{flag}: {model} uses multi-latent attention, which has no {' '.join(qkv)}; with --train-backend "
            "megatron target o_proj (and the MLP of dense layers) only, or use --train-backend fsdp."
        )


def _megatron_model_kind(args: argparse.Namespace) -> tuple[str, bool, bool, bool]:
    """(how to name the model, MoE, GLM-4, multi-latent attention) as the Megatron trainer will build it: from the
    model flags when given (`--num-layers`), else from --hf-checkpoint's config.json (all False when unreadable)."""
    if getattr(args, "num_layers", None) is not None:
        return (
            "the model of the model flags",
            bool(getattr(args, "num_experts", None)),
            bool(getattr(args, "post_mlp_layernorm", False)),
            bool(getattr(args, "multi_latent_attention", False)),
        )
    path = os.path.join(args.hf_checkpoint or "", "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return "", False, False, False
    if not isinstance(config, dict):
        return "", False, False, False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    model = f"--hf-checkpoint {args.hf_checkpoint}"
    return model, routing_shape(config) is not None, text.get("model_type") == "glm4", "kv_lora_rank" in text


def _validate_adapter_folder(args: argparse.Namespace) -> None:
    """`--lora-adapter-path` holds a PEFT adapter of the rank, alpha and targets the flags give (the engines are
    started from the flags)."""
    path = args.lora_adapter_path
    config_file = os.path.join(path, ADAPTER_CONFIG_FILE)
    if not os.path.isfile(config_file):
        _fail(
            f"--lora-adapter-path {path} is not a PEFT adapter folder (no adapter_config.json); point it at a "
            "folder saved by peft's save_pretrained or by slime (<checkpoint>/adapter)."
        )
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as error:
        _fail(f"--lora-adapter-path {path}: adapter_config.json is not readable JSON ({error}).")
    if not isinstance(config, dict):
        _fail(f"--lora-adapter-path {path}: adapter_config.json is not a JSON object.")
    differ = [
        f"{flag} {given} (the folder's: {saved})"
        for flag, given, saved in (
            ("--lora-rank", args.lora_rank, config.get("r")),
            ("--lora-alpha", args.lora_alpha, config.get("lora_alpha")),
        )
        if saved != given
    ]
    saved_targets = config.get("target_modules")
    if args.target_modules != ["all-linear"] and isinstance(saved_targets, list):
        leaf_names = sorted({name.rsplit(".", 1)[-1] for name in saved_targets})
        if leaf_names != sorted(args.target_modules):
            differ.append(f"--target-modules {' '.join(args.target_modules)} (the folder's: {' '.join(leaf_names)})")
    if differ:
        _fail(f"--lora-adapter-path {path} holds another adapter than the flags describe: {'; '.join(differ)}.")
