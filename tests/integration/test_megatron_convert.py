"""HF <-> Megatron weight conversion: layouts, per-family names, pipeline offsets and the CLI tools.

Name expectations are written by hand from the HF models' real parameter names (transformers'
modeling files and hub checkpoints), not derived from the code under test.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.scripts import run_script

from slime.backends.megatron_utils.config import SUPPORTED_FAMILIES, config_from_hf, parse_layer_freq, resolve_family
from slime.backends.megatron_utils.weight_mapping import (
    ModelDims,
    convert_hf_tensors_to_megatron,
    convert_megatron_tensor_to_hf,
    hf_names_for,
    merge_from_hf,
    split_to_hf,
)

REPO = Path(__file__).resolve().parents[2]
requires_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="needs megatron-core (pip install -e .[megatron])"
)


def dims(family: str, **overrides) -> ModelDims:
    values = dict(
        family=family, num_layers=4, hidden_size=4, num_attention_heads=6, num_query_groups=2, head_dim=3,
        vocab_size=10,
    )  # fmt: skip
    values.update(overrides)
    return ModelDims(**values)


# ----------------------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------------------


def test_qkv_fusion_is_grouped_q_then_k_then_v():
    d = dims("llama")  # 6 q heads, 2 kv groups -> 3 q heads per group, head_dim 3, hidden 4
    q = torch.arange(18 * 4).reshape(18, 4).float()
    k = 1000 + torch.arange(6 * 4).reshape(6, 4).float()
    v = 2000 + torch.arange(6 * 4).reshape(6, 4).float()
    # Expected, by hand: group g holds q heads 3g..3g+2 (rows 9g..9g+8), then k head g, then v head g.
    expected_rows = []
    for g in range(2):
        expected_rows += [q[9 * g + r] for r in range(9)]
        expected_rows += [k[3 * g + r] for r in range(3)]
        expected_rows += [v[3 * g + r] for r in range(3)]
    expected = torch.stack(expected_rows)

    fused = merge_from_hf([q, k, v], "qkv", d)
    assert torch.equal(fused, expected)
    back = split_to_hf(fused, "qkv", d)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v]))

    # Biases (1-D) follow the same row order.
    bias = merge_from_hf([q[:, 0], k[:, 0], v[:, 0]], "qkv", d)
    assert torch.equal(bias, expected[:, 0])


def test_gate_up_vocab_and_swapped_halves():
    d = dims("mimo")
    gate, up = torch.randn(5, 4), torch.randn(5, 4)
    fc1 = merge_from_hf([gate, up], "gate_up", d)
    assert torch.equal(fc1[:5], gate) and torch.equal(fc1[5:], up)
    assert all(torch.equal(a, b) for a, b in zip(split_to_hf(fc1, "gate_up", d), [gate, up]))

    table = torch.randn(10, 4)
    padded = merge_from_hf([table], "vocab", d, rows=16)
    assert padded.shape == (16, 4) and torch.equal(padded[:10], table) and not padded[10:].any()
    assert torch.equal(split_to_hf(padded, "vocab", d)[0], table)

    eh_proj = torch.randn(4, 8)  # Megatron: [embedding half | hidden half]; MiMo's input_proj: [hidden | embedding]
    (input_proj,) = split_to_hf(eh_proj, "swap_halves", d)
    assert torch.equal(input_proj[:, :4], eh_proj[:, 4:]) and torch.equal(input_proj[:, 4:], eh_proj[:, :4])
    assert torch.equal(merge_from_hf([input_proj], "swap_halves", d), eh_proj)


def test_convert_round_trip_through_a_state_dict():
    d = dims("qwen2")
    hf = {
        "model.layers.1.self_attn.q_proj.bias": torch.randn(18),
        "model.layers.1.self_attn.k_proj.bias": torch.randn(6),
        "model.layers.1.self_attn.v_proj.bias": torch.randn(6),
    }
    name = "module.module.decoder.layers.1.self_attention.linear_qkv.bias"
    fused = convert_hf_tensors_to_megatron(name, hf.__getitem__, d)
    back = dict(convert_megatron_tensor_to_hf(name, fused, d))
    assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)


# ----------------------------------------------------------------------------------------------
# Names per family
# ----------------------------------------------------------------------------------------------

L3 = "model.layers.3."
NAME_CASES = [
    # family, Megatron name, expected HF names, kind
    ("llama", "embedding.word_embeddings.weight", ["model.embed_tokens.weight"], "vocab"),
    ("llama", "module.module.output_layer.weight", ["lm_head.weight"], "vocab"),
    ("llama", "decoder.final_layernorm.weight", ["model.norm.weight"], "copy"),
    (
        "llama",
        "module.decoder.layers.3.self_attention.linear_qkv.weight",
        [L3 + "self_attn.q_proj.weight", L3 + "self_attn.k_proj.weight", L3 + "self_attn.v_proj.weight"],
        "qkv",
    ),
    ("llama", "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", [L3 + "input_layernorm.weight"], "copy"),
    ("llama", "decoder.layers.3.input_layernorm.weight", [L3 + "input_layernorm.weight"], "copy"),
    ("llama", "decoder.layers.3.mlp.linear_fc1.layer_norm_weight", [L3 + "post_attention_layernorm.weight"], "copy"),
    ("llama", "decoder.layers.3.pre_mlp_layernorm.weight", [L3 + "post_attention_layernorm.weight"], "copy"),
    ("llama", "decoder.layers.3.self_attention.linear_proj.weight", [L3 + "self_attn.o_proj.weight"], "copy"),
    (
        "llama",
        "decoder.layers.3.mlp.linear_fc1.weight",
        [L3 + "mlp.gate_proj.weight", L3 + "mlp.up_proj.weight"],
        "gate_up",
    ),
    ("llama", "decoder.layers.3.mlp.linear_fc2.weight", [L3 + "mlp.down_proj.weight"], "copy"),
    (
        "qwen2",
        "decoder.layers.3.self_attention.linear_qkv.bias",
        [L3 + "self_attn.q_proj.bias", L3 + "self_attn.k_proj.bias", L3 + "self_attn.v_proj.bias"],
        "qkv",
    ),
    ("qwen3", "decoder.layers.3.self_attention.q_layernorm.weight", [L3 + "self_attn.q_norm.weight"], "copy"),
    ("qwen3", "decoder.layers.3.self_attention.k_layernorm.weight", [L3 + "self_attn.k_norm.weight"], "copy"),
    ("qwen3_moe", "decoder.layers.3.mlp.router.weight", [L3 + "mlp.gate.weight"], "copy"),
    (
        "qwen3_moe",
        "decoder.layers.3.mlp.experts.local_experts.17.linear_fc1.weight",
        [L3 + "mlp.experts.17.gate_proj.weight", L3 + "mlp.experts.17.up_proj.weight"],
        "gate_up",
    ),
    ("qwen3_moe", "decoder.layers.3.mlp.experts.linear_fc2.weight17", [L3 + "mlp.experts.17.down_proj.weight"], "copy"),
    ("glm4", "decoder.layers.3.mlp.linear_fc1.weight", [L3 + "mlp.gate_up_proj.weight"], "copy"),
    ("glm4", "decoder.layers.3.post_self_attn_layernorm.weight", [L3 + "post_self_attn_layernorm.weight"], "copy"),
    ("glm4", "decoder.layers.3.post_mlp_layernorm.weight", [L3 + "post_mlp_layernorm.weight"], "copy"),
    (
        "deepseek_v3",
        "decoder.layers.3.self_attention.linear_q_down_proj.weight",
        [L3 + "self_attn.q_a_proj.weight"],
        "copy",
    ),
    (
        "deepseek_v3",
        "decoder.layers.3.self_attention.linear_q_up_proj.layer_norm_weight",
        [L3 + "self_attn.q_a_layernorm.weight"],
        "copy",
    ),
    (
        "deepseek_v3",
        "decoder.layers.3.self_attention.q_layernorm.weight",
        [L3 + "self_attn.q_a_layernorm.weight"],
        "copy",
    ),
    (
        "deepseek_v3",
        "decoder.layers.3.self_attention.linear_q_up_proj.weight",
        [L3 + "self_attn.q_b_proj.weight"],
        "copy",
    ),
    ("deepseek_v3", "decoder.layers.3.self_attention.linear_q_proj.weight", [L3 + "self_attn.q_proj.weight"], "copy"),
    (
        "deepseek_v3",
        "decoder.layers.3.self_attention.linear_kv_down_proj.weight",
        [L3 + "self_attn.kv_a_proj_with_mqa.weight"],
        "copy",
    ),
    (
        "deepseek_v3",
        "decoder.layers.3.self_attention.kv_layernorm.weight",
        [L3 + "self_attn.kv_a_layernorm.weight"],
        "copy",
    ),
    (
        "deepseek_v3",
        "decoder.layers.3.self_attention.linear_kv_up_proj.weight",
        [L3 + "self_attn.kv_b_proj.weight"],
        "copy",
    ),
    ("deepseek_v3", "decoder.layers.3.mlp.router.expert_bias", [L3 + "mlp.gate.e_score_correction_bias"], "copy"),
    (
        "deepseek_v3",
        "decoder.layers.3.mlp.shared_experts.linear_fc1.weight",
        [L3 + "mlp.shared_experts.gate_proj.weight", L3 + "mlp.shared_experts.up_proj.weight"],
        "gate_up",
    ),
    (
        "deepseek_v3",
        "decoder.layers.3.mlp.experts.linear_fc2.weight255",
        [L3 + "mlp.experts.255.down_proj.weight"],
        "copy",
    ),
    ("deepseek_v3", "mtp.layers.0.eh_proj.weight", ["model.layers.4.eh_proj.weight"], "copy"),  # after 4 layers
    ("deepseek_v3", "mtp.layers.0.final_layernorm.weight", ["model.layers.4.shared_head.norm.weight"], "copy"),
    ("mimo", "mtp.layers.0.enorm.weight", ["model.mtp_layers.0.token_layernorm.weight"], "copy"),
    ("mimo", "mtp.layers.0.hnorm.weight", ["model.mtp_layers.0.hidden_layernorm.weight"], "copy"),
    ("mimo", "mtp.layers.0.eh_proj.weight", ["model.mtp_layers.0.input_proj.weight"], "swap_halves"),
    ("mimo", "mtp.layers.0.final_layernorm.weight", ["model.mtp_layers.0.final_layernorm.weight"], "copy"),
    (
        "mimo",
        "mtp.layers.0.transformer_layer.self_attention.linear_qkv.bias",
        [f"model.mtp_layers.0.self_attn.{p}_proj.bias" for p in "qkv"],
        "qkv",
    ),
    ("mimo", "decoder.layers.3.mlp.linear_fc2.weight", [L3 + "mlp.down_proj.weight"], "copy"),
]


@pytest.mark.parametrize("family,name,expected,kind", NAME_CASES)
def test_megatron_to_hf_names(family, name, expected, kind):
    assert hf_names_for(name, dims(family)) == (expected, kind)


def test_tied_output_layer_maps_to_the_embedding():
    assert hf_names_for("output_layer.weight", dims("qwen3", tied_embeddings=True))[0] == ["model.embed_tokens.weight"]


def test_unknown_family_names_it_and_the_supported_ones():
    with pytest.raises(ValueError) as error:
        resolve_family("mamba")
    assert "'mamba'" in str(error.value)
    assert all(family in str(error.value) for family in SUPPORTED_FAMILIES)
    # A family transformers has but slime's Megatron does not build yet says why, and what to use instead.
    with pytest.raises(ValueError, match="does not build gpt_oss models yet: they have attention sinks.*fsdp"):
        resolve_family("gpt-oss")


def test_family_aliases():
    assert resolve_family("Qwen2.5") == "qwen2"
    assert resolve_family("qwen3-moe") == "qwen3_moe"
    assert resolve_family("kimi_k2") == "deepseek_v3"
    assert resolve_family("DeepSeek-V3") == "deepseek_v3"


def test_unmapped_parameter_names_the_family_and_parameter():
    with pytest.raises(ValueError, match=r"deepseek_v3.*linear_qkv\.weight"):
        hf_names_for("decoder.layers.0.self_attention.linear_qkv.weight", dims("deepseek_v3"))


# ----------------------------------------------------------------------------------------------
# Flags from HF configs
# ----------------------------------------------------------------------------------------------


def test_config_from_hf_deepseek_v3():
    config = {
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "intermediate_size": 18432,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
        "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "vocab_size": 129280, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
        "tie_word_embeddings": False, "hidden_act": "silu",
    }  # fmt: skip
    args = config_from_hf(config)
    assert args.multi_latent_attention and args.q_lora_rank == 1536 and args.qk_pos_emb_head_dim == 64
    assert args.moe_layer_freq == [0, 0, 0] + [1] * 58
    assert args.moe_shared_expert_intermediate_size == 2048
    assert args.moe_router_enable_expert_bias and args.moe_router_score_function == "sigmoid"
    assert (args.moe_router_num_groups, args.moe_router_group_topk) == (8, 4)
    assert (args.rope_type, args.rotary_scaling_factor, args.original_max_position_embeddings) == ("yarn", 40, 4096)
    assert args.untie_embeddings_and_output_weights


def test_config_from_hf_glm4_and_qwen3_moe():
    glm4_config = {
        "model_type": "glm4", "num_hidden_layers": 40, "hidden_size": 4096, "intermediate_size": 13696,
        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "partial_rotary_factor": 0.5,
        "attention_bias": True, "vocab_size": 151552, "rms_norm_eps": 1e-5, "rope_theta": 10000,
    }  # fmt: skip
    glm4 = config_from_hf(glm4_config)
    assert glm4.add_qkv_bias and glm4.rotary_percent == 0.5 and glm4.rotary_interleaved
    assert glm4.post_self_attn_layernorm and glm4.post_mlp_layernorm and glm4.num_query_groups == 2
    # transformers 5 writes num_local_experts; hub configs say num_experts. Both work.
    moe = {
        "model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_local_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": 300,
        "mlp_only_layers": [0], "decoder_sparse_step": 1,
    }  # fmt: skip
    args = config_from_hf(moe)
    assert args.num_experts == 8 and args.moe_router_topk == 2 and args.moe_layer_freq == [0, 1, 1, 1]
    assert args.moe_router_pre_softmax is False and args.qk_layernorm


def test_parse_layer_freq_forms():
    assert parse_layer_freq("([0]*3+[1]*2)") == [0, 0, 0, 1, 1]
    assert parse_layer_freq("'([1]*3)'") == [1, 1, 1]
    assert parse_layer_freq([0, 1]) == [0, 1]
    assert parse_layer_freq(2) == 2
    with pytest.raises(ValueError, match="moe-layer-freq"):
        parse_layer_freq("every other")


# ----------------------------------------------------------------------------------------------
# Pipeline parallelism: each stage converts its own global layers (2 gloo workers)
# ----------------------------------------------------------------------------------------------


def _pipeline_worker(rank: int, world_size: int, hf_dir: str) -> dict:
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights
    from slime.backends.megatron_utils.megatron_to_hf import megatron_state_to_hf
    from slime.backends.megatron_utils.model import build_model, initialize_model_parallel

    initialize_model_parallel(pipeline_model_parallel_size=2)
    args = config_from_hf(hf_dir)
    args.pipeline_model_parallel_size = 2
    model = build_model(args, wrap_with_ddp=False)
    used = load_hf_weights(model, hf_dir)
    exported = {name: tensor.clone() for name, tensor in megatron_state_to_hf(model, "llama", args.vocab_size)}
    return {"used": used, "exported": exported}


@requires_megatron
def test_pipeline_stages_load_and_export_their_own_layers(tiny_model_dir):
    from support.megatron_cpu import run_in_processes

    first, second = run_in_processes(_pipeline_worker, world_size=2, args=(str(tiny_model_dir),))
    reference = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    # 2 layers over 2 stages: stage 0 has the embedding and layer 0, stage 1 layer 1, the norm and the head.
    assert "model.embed_tokens.weight" in first["exported"] and "lm_head.weight" in second["exported"]
    assert all(".layers.1." not in name for name in first["exported"])
    assert all(".layers.0." not in name for name in second["exported"])
    assert first["used"] == set(first["exported"]) and second["used"] == set(second["exported"])
    merged = {**first["exported"], **second["exported"]}
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[name], reference[name]) for name in reference)


# ----------------------------------------------------------------------------------------------
# The CLI tools, run as a user would (CPU, one process, gloo)
# ----------------------------------------------------------------------------------------------


def run_tool(script: str, *args: str) -> subprocess.CompletedProcess:
    """The tool as `python tools/SCRIPT ARGS`, forked from the preloaded fork server (support.scripts)."""
    return run_script(f"tools/{script}", *args)


def run_tool_in_a_fresh_interpreter(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / script), *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def assert_same_hf_folder(original: Path, converted: Path) -> None:
    before, after = load_file(str(original / "model.safetensors")), load_file(str(converted / "model.safetensors"))
    assert before.keys() == after.keys()
    for name in before:
        assert after[name].dtype == before[name].dtype, name
        assert torch.equal(after[name], before[name]), name
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (converted / file).read_bytes() == (original / file).read_bytes(), file


@requires_megatron
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_hf_to_torch_dist_to_hf_is_bit_exact(tmp_path, arch):
    from support.tiny_model import build_tiny_model

    hf_dir = build_tiny_model(tmp_path / "hf", arch=arch)
    result = run_tool("convert_hf_to_torch_dist.py", "--hf-checkpoint", str(hf_dir), "--save", str(tmp_path / "dist"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "dist" / "latest_checkpointed_iteration.txt").read_text() == "0"
    assert (tmp_path / "dist" / "iter_0000000" / ".metadata").is_file()

    result = run_tool(
        "convert_torch_dist_to_hf.py",
        "--input-dir", str(tmp_path / "dist" / "iter_0000000"),
        "--output-dir", str(tmp_path / "back"),
        "--origin-hf-dir", str(hf_dir),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_hf_folder(Path(hf_dir), tmp_path / "back")


@requires_megatron
def test_convert_to_hf_takes_the_training_command_line(tmp_path):
    from support.tiny_model import build_tiny_model

    hf_dir = build_tiny_model(tmp_path / "hf", arch="llama")
    result = run_tool("convert_hf_to_torch_dist.py", "--hf-checkpoint", str(hf_dir), "--save", str(tmp_path / "dist"))
    assert result.returncode == 0, result.stderr[-3000:]
    model_args = ["--num-layers", "2", "--hidden-size", "64", "--swiglu", "--normalization", "RMSNorm"]
    training_only = [
        "--rollout-batch-size",
        "8",
        "--tensor-model-parallel-size",
        "2",
        "--sglang-mem-fraction-static",
        "0.7",
    ]
    result = run_tool(
        "convert_to_hf.py", *model_args, *training_only,
        "--load", str(tmp_path / "dist"), "--hf-checkpoint", str(hf_dir), "--output-dir", str(tmp_path / "export"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_hf_folder(Path(hf_dir), tmp_path / "export")


def test_tool_rejects_an_unknown_family(tmp_path, tiny_model_dir):
    # One run exactly as a user types it: a fresh interpreter, the repository on PYTHONPATH.
    result = run_tool_in_a_fresh_interpreter(
        "convert_hf_to_torch_dist.py", "--hf-checkpoint", str(tiny_model_dir), "--save", str(tmp_path / "x"),
        "--model-name", "mamba",
    )  # fmt: skip
    assert result.returncode != 0
    assert "unknown model family 'mamba'" in result.stderr and "qwen3" in result.stderr
    assert not (tmp_path / "x").exists()


@requires_megatron
@pytest.mark.reliability(
    "conversion tools pointed at a folder of the user's (--save, --output-dir)",
    "refused before any conversion, naming the folder; it is left untouched",
)
def test_tools_refuse_a_folder_they_did_not_write(tmp_path, tiny_model_dir):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    result = run_tool("convert_hf_to_torch_dist.py", "--hf-checkpoint", str(tiny_model_dir), "--save", str(mine))
    assert result.returncode != 0 and f"--save {mine}" in result.stderr, result.stderr[-2000:]
    result = run_tool(
        "convert_torch_dist_to_hf.py",
        "--input-dir", str(tmp_path / "no_checkpoint_needed"),
        "--output-dir", str(mine),
        "--origin-hf-dir", str(tiny_model_dir),
    )  # fmt: skip
    assert result.returncode != 0 and f"--output-dir {mine}" in result.stderr, result.stderr[-2000:]
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"
