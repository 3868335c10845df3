"""megatron-core GPT built from Megatron flags reproduces HF logits; DDP + optimizer train on CPU.

The HF reference runs in the pytest process; Megatron runs in spawned gloo workers (tests/support/megatron_cpu.py),
the only place the CPU patch is applied. One spawn of 2 workers covers TP=1 (DP=2), TP=2 and EP=2.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from support.megatron_cpu import requires_megatron_core, run_in_processes
from support.megatron_models import (
    MINIMAL_SLIME_FLAGS,
    build_tiny_hf,
    hf_logits,
    megatron_logits,
    model_args_of,
    tiny_qwen2,
)
from support.tiny_model import build_tiny_model
from transformers import Qwen3MoeConfig

pytestmark = requires_megatron_core

TOLERANCE = 1e-4


def tiny_qwen3_moe(path) -> str:
    config = Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False, rope_theta=10000.0,
        pad_token_id=0,
    )  # fmt: skip
    return build_tiny_hf(path, config)


def _worker(rank: int, world_size: int, model_dirs: dict[str, str], input_ids: torch.Tensor) -> dict:
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from slime.backends.megatron_utils.config import config_from_hf, load_hf_config
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights
    from slime.backends.megatron_utils.model import build_model, build_optimizer, initialize_model_parallel

    results: dict = {"logits": {}}
    layouts = [("tp1", dict(tensor_model_parallel_size=1)), ("tp2", dict(tensor_model_parallel_size=2))]
    for layout, sizes in layouts + [("ep2", dict(expert_model_parallel_size=2))]:
        initialize_model_parallel(**sizes)
        for family, path in model_dirs.items():
            if layout == "ep2" and family != "qwen3_moe":
                continue
            if layout == "tp2" and family == "qwen3_moe":
                continue  # MoE with TP needs sequence parallelism; EP=2 covers the expert sharding
            args = config_from_hf(path)
            vars(args).update(sizes)
            model = build_model(args, wrap_with_ddp=False)
            load_hf_weights(model, path)
            model[0].eval()
            vocab = load_hf_config(path)["vocab_size"]
            results["logits"][(layout, family)] = megatron_logits(model[0], input_ids, vocab)

    # Training readiness: DDP + distributed optimizer, DP=2, each rank its own batch.
    initialize_model_parallel(tensor_model_parallel_size=1)
    args = config_from_hf(model_dirs["llama"])
    vars(args).update(lr=1e-2, use_distributed_optimizer=True, clip_grad=1.0, weight_decay=0.0)
    model = build_model(args)
    load_hf_weights(model, model_dirs["llama"])
    optimizer = build_optimizer(args, model)
    tokens = input_ids[rank : rank + 1]  # a different sequence on each data-parallel rank

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        positions = torch.arange(batch.shape[1] - 1).expand(batch.shape[0], -1)
        per_token_loss = chunk(batch[:, :-1], positions, None, labels=batch[:, 1:])
        return per_token_loss, lambda output: (output.mean(), {"loss": output.mean().detach()})

    # Megatron's schedule, as the training actor drives it: two micro-batches per step.
    forward_backward = get_forward_backward_func()
    losses = []
    for _ in range(3):
        model[0].zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter([tokens[:, :7], tokens[:, 5:]]),
            model=model,
            num_microbatches=2,
            seq_length=6,
            micro_batch_size=1,
        )
        finalize_model_grads(model)
        success, grad_norm, _ = optimizer.step()
        losses.append((sum(r["loss"].item() for r in reduced), success, grad_norm))
    results["losses"] = losses
    results["params"] = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_model")
    model_dirs = {
        "llama": str(build_tiny_model(root / "llama", arch="llama")),
        "qwen3": str(build_tiny_model(root / "qwen3", arch="qwen3")),
        "qwen2": tiny_qwen2(root / "qwen2"),
        "qwen3_moe": tiny_qwen3_moe(root / "qwen3_moe"),
    }
    torch.manual_seed(1)
    input_ids = torch.randint(0, 300, (2, 12))
    reference = {family: hf_logits(path, input_ids) for family, path in model_dirs.items()}
    results = run_in_processes(_worker, world_size=2, args=(model_dirs, input_ids))
    return reference, results


@pytest.mark.parametrize(
    "layout,family",
    [
        ("tp1", "llama"),
        ("tp1", "qwen3"),
        ("tp1", "qwen2"),
        ("tp1", "qwen3_moe"),
        ("tp2", "llama"),
        ("tp2", "qwen3"),
        ("tp2", "qwen2"),
        ("ep2", "qwen3_moe"),
    ],
)
def test_megatron_logits_match_hf(runs, layout, family):
    reference, results = runs
    for rank, result in enumerate(results):
        logits = result["logits"][(layout, family)]
        assert logits.shape == reference[family].shape
        diff = (logits - reference[family]).abs().max().item()
        print(f"{layout} {family} rank{rank}: max |megatron - hf| = {diff:.2e}")
        assert diff <= TOLERANCE, f"{layout} {family} rank {rank}: max abs diff {diff:.3e} > {TOLERANCE}"
    # The logits are far from trivial, so the tolerance means something.
    assert reference[family].std() > 1.0


def test_ddp_distributed_optimizer_trains_and_keeps_replicas_equal(runs):
    _, results = runs
    for result in results:
        losses = [loss for loss, _, _ in result["losses"]]
        assert all(success for _, success, _ in result["losses"])
        assert all(grad_norm > 0 for _, _, grad_norm in result["losses"])
        assert losses[-1] < losses[0], losses
    # The two data-parallel ranks saw different batches; averaged grads keep their weights identical.
    first, second = results[0]["params"], results[1]["params"]
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    # ... and the batches really differed (otherwise equal weights would prove nothing).
    assert results[0]["losses"][0][0] != results[1]["losses"][0][0]


# ----------------------------------------------------------------------------------------------
# scripts/models/*.sh and the run-*.sh recipes go through slime's parser into a valid config
# ----------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
MODEL_SCRIPTS = sorted((REPO / "scripts" / "models").glob("*.sh"))
RECIPES = sorted((REPO / "scripts").glob("run-qwen3-4B*.sh"))
# What a recipe adds around MODEL_ARGS that the parser requires; paths need not exist to parse.


@pytest.mark.parametrize("script", MODEL_SCRIPTS, ids=lambda path: path.stem)
def test_model_script_builds_a_valid_transformer_config(script):
    from slime.backends.megatron_utils.config import transformer_config_from_args
    from slime.utils.arguments import parse_args

    args = parse_args(model_args_of(script) + MINIMAL_SLIME_FLAGS)
    config = transformer_config_from_args(args)  # megatron-core validates the combination
    assert config.num_layers == args.num_layers > 0
    assert config.gated_linear_unit and config.normalization == "RMSNorm" and not config.add_bias_linear
    assert args.vocab_size > 100_000
    if config.multi_latent_attention:
        assert config.kv_lora_rank == 512 and config.qk_pos_emb_head_dim == 64
    else:
        assert config.num_attention_heads % config.num_query_groups == 0
    if config.num_moe_experts:
        freq = config.moe_layer_freq
        assert isinstance(freq, list) and len(freq) == config.num_layers and freq[-1] == 1
        assert config.moe_router_topk <= config.num_moe_experts


# GLM-4's script and layer spec: tests/integration/test_megatron_glm4.py.


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_recipe_flags_parse(recipe):
    from slime.utils.arguments import parse_args

    result = subprocess.run(["bash", str(recipe)], env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    args = parse_args(result.stdout.splitlines())
    assert args.train_backend == "megatron" and args.num_layers == 36 and args.qk_layernorm
    assert args.rollout_batch_size * args.n_samples_per_prompt == args.global_batch_size * args.num_steps_per_rollout
    if recipe.stem.endswith("sft"):
        assert args.loss_type == "sft_loss" and args.debug_train_only
    if recipe.stem.endswith("ppo"):
        assert args.use_critic
    if recipe.stem.endswith("async"):
        assert not args.colocate and args.rollout_num_gpus == 4
