"""`--lora-rank` under `--train-backend megatron` parses, and what LoRA on megatron-core cannot do is refused at parse
time, naming the flag and the fix (slime/utils/arguments/lora.py). The FSDP flag checks are in
tests/integration/test_fsdp_lora.py; the Megatron actor's LoRA runs in tests/integration/test_megatron_lora_actor.py."""

from __future__ import annotations

import json
import re

import pytest

from slime.utils.arguments import ArgumentValidationError, parse_args

LOCAL = ["--transformer-impl", "local"]
MOE_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "4"]


def megatron_args(hf_checkpoint, *extra: str):
    return parse_args(
        ["--train-backend", "megatron", "--hf-checkpoint", str(hf_checkpoint), "--prompt-data", "p.jsonl",
         "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1", "--lora-rank", "4", *extra]
    )  # fmt: skip


def hf_folder(path, **config) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_lora_flags_parse_under_megatron(tmp_path):
    dense = hf_folder(tmp_path / "dense", model_type="qwen3", num_hidden_layers=2)
    args = megatron_args(
        dense, *LOCAL, "--lora-alpha", "8", "--lora-dropout", "0.1", "--target-modules", "q_proj", "down_proj",
        "--exclude-modules", "model.layers.1.mlp.down_proj", "--check-lora-weight-equal",
    )  # fmt: skip
    assert (args.lora_rank, args.lora_alpha, args.lora_dropout) == (4, 8.0, 0.1)
    assert args.target_modules == ["q_proj", "down_proj"] and args.exclude_modules == ["model.layers.1.mlp.down_proj"]
    assert args.check_lora_weight_equal
    # An MoE model: attention targets, or the MLP's left out by leaf name, are fine.
    moe = hf_folder(tmp_path / "moe", model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, num_hidden_layers=2)
    megatron_args(moe, *LOCAL, "--target-modules", "q_proj", "k_proj", "v_proj", "o_proj")
    megatron_args(moe, *LOCAL, "--exclude-modules", "gate_proj", "up_proj", "down_proj")
    megatron_args(tmp_path / "absent", *LOCAL, *MOE_FLAGS, "--target-modules", "o_proj")


@pytest.mark.reliability(
    "a LoRA flag combination the Megatron trainer cannot run", "refused at parse time naming the flag and the fix"
)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "pass --transformer-impl local"),
        (["--transformer-impl", "transformer_engine"], "transformer_engine): pass --transformer-impl local"),
        ([*LOCAL, "--sequence-parallel"], "does not support --sequence-parallel"),
        ([*LOCAL, "--context-parallel-size", "2"], "--context-parallel-size 2 needs TransformerEngine attention"),
        ([*LOCAL, "--target-modules", "q_proj", "qkv_proj"], "not qkv_proj; name those, or use --train-backend fsdp"),
        ([*LOCAL, *MOE_FLAGS], "is an MoE model, and LoRA on its expert layers (gate_proj up_proj down_proj)"),
        ([*LOCAL, *MOE_FLAGS, "--target-modules", "q_proj", "up_proj"], "(up_proj) is not supported"),
        ([*LOCAL, "--multi-lora-n-adapters", "2"], "--multi-lora-n-adapters 2 is not supported"),
    ],
)  # fmt: skip
def test_what_megatron_lora_cannot_do_is_refused(tmp_path, flags, message):
    dense = hf_folder(tmp_path / "dense", model_type="llama", num_hidden_layers=2)
    with pytest.raises(ArgumentValidationError, match=re.escape(message)):
        megatron_args(dense, *flags)


@pytest.mark.parametrize(
    ("config", "flags", "message"),
    [
        (
            {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2},
            [],
            "is an MoE model, and LoRA on its expert layers",
        ),
        ({"model_type": "glm4", "num_hidden_layers": 2}, ["--target-modules", "gate_proj"], "gate_up_proj"),
        (
            {"model_type": "deepseek_v3", "kv_lora_rank": 512, "num_hidden_layers": 2},
            ["--target-modules", "q_proj", "o_proj"],
            "uses multi-latent attention, which has no q_proj",
        ),
    ],
    ids=["moe", "glm4", "mla"],
)
def test_the_hf_checkpoints_model_kind_is_checked(tmp_path, config, flags, message):
    folder = hf_folder(tmp_path / "model", **config)
    with pytest.raises(ArgumentValidationError, match=re.escape(message)) as refused:
        megatron_args(folder, *LOCAL, *flags)
    assert f"--hf-checkpoint {folder}" in str(refused.value) and "--target-modules" in str(refused.value)
    # Module paths in --exclude-modules may leave out just the layers that cannot carry adapters: the model decides.
    megatron_args(folder, *LOCAL, *flags, "--exclude-modules", "model.layers.1.mlp.gate_proj")
