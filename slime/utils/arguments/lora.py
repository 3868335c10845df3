"""The 'LoRA' group: train a low-rank adapter instead of the full weights (miles' flag names), and its checks."""

from __future__ import annotations

import argparse
import json
import os

from slime.utils.arguments.errors import _fail
from slime.utils.arguments.rollout import DEFAULT_DATA_SOURCE_PATH, DEFAULT_ROLLOUT_FUNCTION_PATH
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
        help="Train this many LoRA adapters on one base in one job (with --lora-rank; FSDP): adapter k has its own "
        "prompts (--multi-lora-prompt-data), reward (--multi-lora-rm-path) and optimizer, the engines serve all of "
        "them at once as slime-policy-0 .. slime-policy-{K-1}, and metrics come per adapter "
        "(rollout/adapter_<k>/..., train/adapter_<k>/...). Each step every adapter draws --rollout-batch-size "
        "prompts and takes --num-steps-per-rollout optimizer steps of --global-batch-size samples.",
    )
    group.add_argument(
        "--multi-lora-prompt-data",
        nargs="+",
        default=None,
        action=_AdapterPromptFiles,
        help="One prompt file per adapter (.jsonl or .parquet, read with --input-key, --label-key etc.), in adapter "
        "order; takes the place of --prompt-data under --multi-lora-n-adapters.",
    )
    group.add_argument(
        "--multi-lora-rm-path",
        nargs="+",
        default=None,
        help="One reward function per adapter (dotted paths, the signature of --custom-rm-path), in adapter order; "
        "default: the run's reward (--rm-type / --custom-rm-path) for every adapter.",
    )


class _AdapterPromptFiles(argparse.Action):
    """`--multi-lora-prompt-data` also stands in for `--prompt-data`, which the data checks ask of every run; the LoRA
    checks refuse a different `--prompt-data` beside it."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        if getattr(namespace, "prompt_data", None) is None:
            namespace.prompt_data = values[0]


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
    count = args.multi_lora_n_adapters
    multi_flags_given = [
        flag
        for flag, given in (
            ("--multi-lora-prompt-data", args.multi_lora_prompt_data is not None),
            ("--multi-lora-rm-path", args.multi_lora_rm_path is not None),
        )
        if given
    ]
    if count < 1:
        _fail(f"--multi-lora-n-adapters is a number of adapters, at least 1 (got {count}).")
    if count == 1 and multi_flags_given:
        _fail(f"{', '.join(multi_flags_given)} configure several adapters; add --multi-lora-n-adapters K or drop them.")
    if count > 1:
        lora_flags_given.append(f"--multi-lora-n-adapters {count}")
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
    if count > 1:
        _validate_multi_lora(args)
    if args.train_backend == "megatron":
        _validate_megatron_lora(args)


def _validate_multi_lora(args: argparse.Namespace) -> None:
    """`--multi-lora-n-adapters K` (K >= 2): one prompt file (and reward, when given) per adapter, and refused what
    would train or serve only one adapter, or none."""
    count = args.multi_lora_n_adapters
    files = args.multi_lora_prompt_data
    if files is None:
        _fail(f"--multi-lora-n-adapters {count} needs each adapter's prompts: --multi-lora-prompt-data P1 .. P{count}.")
    for flag, values in (("--multi-lora-prompt-data", files), ("--multi-lora-rm-path", args.multi_lora_rm_path)):
        if values is not None and len(values) != count:
            what = "file" if flag.endswith("data") else "reward path"
            _fail(
                f"{flag} got {len(values)} {what}{'s' if len(values) != 1 else ''} ({' '.join(values)}) for "
                f"--multi-lora-n-adapters {count}: give one per adapter, in adapter order."
            )
    if args.prompt_data != files[0]:
        _fail(
            f"--prompt-data {args.prompt_data} beside --multi-lora-prompt-data: each adapter reads its own file of "
            "--multi-lora-prompt-data; drop --prompt-data."
        )
    instead = "train one adapter per job (drop --multi-lora-n-adapters)"
    refused = [
        (args.train_backend == "megatron", "--train-backend megatron", "use --train-backend fsdp, or " + instead),
        (args.lora_train_only, "--lora-train-only", "drop --lora-train-only (the engines serve every adapter)"),
        (
            args.lora_adapter_path is not None,
            "--lora-adapter-path",
            "start from new adapters (drop --lora-adapter-path), or " + instead,
        ),
        (
            args.eval_prompt_data or args.eval_config,
            "eval datasets (--eval-prompt-data / --eval-config)",
            "drop them; the per-adapter rollout/adapter_<k>/reward figures track each adapter",
        ),
        (
            args.rollout_function_path != DEFAULT_ROLLOUT_FUNCTION_PATH,
            f"--rollout-function-path {args.rollout_function_path} (and with it the fully async rollout)",
            "use the default rollout (it runs once per adapter, on that adapter's prompts), or " + instead,
        ),
        (
            args.data_source_path != DEFAULT_DATA_SOURCE_PATH or not args.rollout_global_dataset,
            "--data-source-path / --disable-rollout-global-dataset",
            "give each adapter's prompts with --multi-lora-prompt-data",
        ),
        (
            args.custom_convert_samples_to_train_data_path,
            "--custom-convert-samples-to-train-data-path",
            "drop it (the trainer needs each sample's adapter from the default conversion), or " + instead,
        ),
        (args.agent_function_path, "--agent-function-path", "use --custom-generate-function-path, or " + instead),
        (
            args.save_hf,
            "--save-hf",
            "drop it; each checkpoint holds every adapter as a PEFT folder, <--save>/iter_XXXXXXX/adapter/"
            "slime-policy-<k>",
        ),
        (
            args.check_lora_weight_equal or args.check_weight_update_equal,
            "--check-lora-weight-equal / --check-weight-update-equal",
            "drop it, or " + instead,
        ),
        (args.debug_train_only, "--debug-train-only", "drop it, or " + instead),
        (
            args.use_dynamic_global_batch_size,
            "--use-dynamic-global-batch-size",
            "drop it (each adapter trains its own global batches of --global-batch-size), or " + instead,
        ),
    ]
    for given, what, fix in refused:
        if given:
            _fail(f"--multi-lora-n-adapters {count} does not support {what}: {fix}.")
    per_batch = _engine_option(args, "max_loras_per_batch")
    if per_batch is not None and int(per_batch) < count:
        _fail(
            f"--sglang-max-loras-per-batch {per_batch} is below --multi-lora-n-adapters {count}: the engines must "
            f"hold every adapter in one batch; raise it to {count} or drop it."
        )


def _engine_option(args: argparse.Namespace, name: str):
    """A forwarded `--sglang-<name>` value as the user gave it (None when not given)."""
    options = args.sglang_server_args
    return options.get(name, options.get(name.replace("_", "-")))


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
