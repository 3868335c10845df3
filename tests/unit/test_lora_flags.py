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
        ([*LOCAL, "--multi-lora-n-adapters", "2", "--multi-lora-prompt-data", "p.jsonl", "q.jsonl"],
         "--multi-lora-n-adapters 2 does not support --train-backend megatron: use --train-backend fsdp"),
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


def fsdp_args(*extra: str):
    return parse_args(
        ["--train-backend", "fsdp", "--hf-checkpoint", "/nonexistent", "--num-rollout", "1",
         "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8", *extra]
    )  # fmt: skip


MULTI = ["--lora-rank", "4", "--multi-lora-n-adapters", "2", "--multi-lora-prompt-data", "a.jsonl", "b.jsonl"]


def test_multi_lora_flags_parse_and_name_the_adapters():
    from slime.utils.lora import policy_adapters, rollout_adapter
    from slime.utils.types import Sample

    args = fsdp_args(*MULTI, "--multi-lora-rm-path", "m.r0", "m.r1")
    assert args.multi_lora_prompt_data == ["a.jsonl", "b.jsonl"] and args.multi_lora_rm_path == ["m.r0", "m.r1"]
    assert policy_adapters(args) == ["slime-policy-0", "slime-policy-1"]
    assert rollout_adapter(args, Sample(lora_adapter=1)) == "slime-policy-1"
    with pytest.raises(ValueError, match="has lora_adapter None"):
        rollout_adapter(args, Sample(index=3))
    single = fsdp_args("--prompt-data", "a.jsonl", "--lora-rank", "4")
    assert policy_adapters(single) == ["slime-policy"] and rollout_adapter(single, Sample()) == "slime-policy"


@pytest.mark.reliability(
    "a --multi-lora-n-adapters combination that would train or serve one adapter (or none)",
    "refused at parse time naming the user's values and what to use instead",
)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt-data", "a.jsonl", "--multi-lora-n-adapters", "2"], "add --lora-rank"),
        (["--prompt-data", "a.jsonl", "--lora-rank", "4", "--multi-lora-n-adapters", "0"], "at least 1 (got 0)"),
        (["--lora-rank", "4", "--multi-lora-prompt-data", "a.jsonl"], "add --multi-lora-n-adapters K"),
        (["--prompt-data", "a.jsonl", "--lora-rank", "4", "--multi-lora-n-adapters", "2"],
         "--multi-lora-n-adapters 2 needs each adapter's prompts: --multi-lora-prompt-data P1 .. P2"),
        (["--lora-rank", "4", "--multi-lora-n-adapters", "2", "--multi-lora-prompt-data", "a.jsonl"],
         "--multi-lora-prompt-data got 1 file (a.jsonl) for --multi-lora-n-adapters 2"),
        ([*MULTI, "--multi-lora-rm-path", "m.r0", "m.r1", "m.r2"],
         "--multi-lora-rm-path got 3 reward paths (m.r0 m.r1 m.r2) for --multi-lora-n-adapters 2"),
        ([*MULTI, "--prompt-data", "c.jsonl"], "--prompt-data c.jsonl beside --multi-lora-prompt-data"),
        ([*MULTI, "--lora-train-only"], "does not support --lora-train-only"),
        ([*MULTI, "--eval-prompt-data", "e", "e.jsonl"], "does not support eval datasets"),
        ([*MULTI, "--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async"],
         "fully async rollout"),
        ([*MULTI, "--data-source-path", "x.Source"], "does not support --data-source-path"),
        ([*MULTI, "--custom-convert-samples-to-train-data-path", "x.f"], "--custom-convert-samples-to-train-data-path"),
        ([*MULTI, "--agent-function-path", "x.agent"], "does not support --agent-function-path"),
        ([*MULTI, "--save-hf", "/tmp/hf"], "adapter/slime-policy-<k>"),
        ([*MULTI, "--check-lora-weight-equal"], "does not support --check-lora-weight-equal"),
        ([*MULTI, "--advantage-estimator", "ppo"], "a PPO critic with LoRA is not implemented"),
        ([*MULTI, "--lora-adapter-path", "/x"], "is not a PEFT adapter folder"),
        ([*MULTI, "--sglang-max-loras-per-batch", "1"], "--sglang-max-loras-per-batch 1 is below --multi-lora-n-adapters 2"),
        ([*MULTI, "--use-dynamic-global-batch-size"], "does not support --use-dynamic-global-batch-size"),
    ],
)  # fmt: skip
def test_what_multi_lora_cannot_do_is_refused(flags, message):
    with pytest.raises(ArgumentValidationError, match=re.escape(message)):
        fsdp_args(*flags)


def test_multi_lora_data_source_keeps_one_stream_per_adapter_across_a_resume(tmp_path):
    import json as json_module

    from slime.rollout.data_source import MultiLoraDataSource

    files = []
    for name, count in (("a", 3), ("b", 5)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json_module.dumps({"input": f"{name}{i}", "label": i}) + "\n" for i in range(count)))
        files.append(str(path))
    flags = ["--lora-rank", "4", "--multi-lora-n-adapters", "2", "--multi-lora-prompt-data", *files]
    args = fsdp_args(*flags, "--input-key", "input", "--label-key", "label", "--save", str(tmp_path / "s"))
    source = MultiLoraDataSource(args)
    assert len(source) == 5  # --num-epoch counts passes over the largest file
    drawn = [source.sources[k].get_samples(2) for k in (0, 1)]
    assert [[g[0].prompt for g in groups] for groups in drawn] == [["a0", "a1"], ["b0", "b1"]]
    samples = [s for groups in drawn for g in groups for s in g]
    assert [s.lora_adapter for s in samples] == [0] * 4 + [1] * 4
    assert len({s.index for s in samples}) == 8 and len({s.group_index for s in samples}) == 4
    source.sources[1].add_samples([drawn[1][1]])  # put back: served first next time, still adapter 1's
    source.save(0)

    resumed = MultiLoraDataSource(fsdp_args(*flags, "--input-key", "input", "--load", str(tmp_path / "s")))
    resumed.load()
    assert [g[0].prompt for g in resumed.sources[0].get_samples(2)] == ["a2", "a0"]  # wraps into epoch 1
    again = resumed.sources[1].get_samples(2)
    assert [g[0].prompt for g in again] == ["b1", "b2"] and {s.lora_adapter for g in again for s in g} == {1}


def test_each_adapters_shard_takes_its_own_global_batches():
    from slime.backends.fsdp_utils.lora import adapter_shards

    data = {"tokens": list(range(8)), "lora_adapters": [1, 1, 0, 0, 1, 1, 0, 0], "num_steps": 4, "other": "x"}
    shards = adapter_shards(data, 3)
    assert [s["tokens"] for s in shards] == [[2, 3, 6, 7], [0, 1, 4, 5], []]
    assert [s["num_steps"] for s in shards] == [2, 2, 0] and shards[0]["other"] == "x"
    with pytest.raises(
        ValueError, match=re.escape("optimizer step 0 of the rollout holds the samples of adapters [0, 1]")
    ):
        adapter_shards(dict(data, num_steps=2), 2)
