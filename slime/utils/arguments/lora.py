"""The 'LoRA' group: train a low-rank adapter instead of the full weights (miles' flag names), and its checks."""

from __future__ import annotations

import argparse
import json
import os

from slime.utils.arguments.errors import _fail
from slime.utils.lora import ADAPTER_CONFIG_FILE


def _add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA")
    group.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="Train a LoRA adapter of this rank on the actor (0: train the full weights). The base stays frozen, the "
        "reference model is the base itself, and each weight update pushes only the adapter, which the engines "
        "serve with SGLang's LoRA API. FSDP only.",
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
        "q_proj v_proj.",
    )
    group.add_argument(
        "--exclude-modules", nargs="+", default=None, help="Leaf names of modules to leave without an adapter."
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
        help="Train the adapter while the engines keep generating with the base model.",
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
