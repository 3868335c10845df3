"""LoRA GRPO runs of train.py on CPU (`--lora-rank`), on each trainer: the engines serve the adapter being trained.

What rides on the one run: each push sends only the adapter and the engine's log-probs under it equal the trainer's
(`--check-lora-weight-equal`, every push); the samples were generated under the weight version each push set; the
checkpoint holds a PEFT adapter folder, which peft loads. A run with `--lora-train-only` trains the adapter while the
engines keep the base. A run with `--multi-lora-n-adapters 2` trains two adapters on two prompt files with two
rewards, the engines serving both.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from peft import PeftModel
from support.engines import cpu_engine_process
from support.runs import run_training, saved_samples, small_run_flags, write_addition_prompts
from transformers import AutoModelForCausalLM


@pytest.mark.parametrize(
    "backend", [["--train-backend", "fsdp"], ["--train-backend", "megatron", "--transformer-impl", "local"]],
    ids=["fsdp", "megatron"],
)  # fmt: skip
def test_train_py_trains_a_lora_adapter_the_engines_serve(tiny_model_dir, tmp_path, backend):
    save = tmp_path / "run"
    rows = run_training(
        "train.py", save,
        *small_run_flags(tiny_model_dir, write_addition_prompts(tmp_path / "prompts.jsonl"), save),
        "--num-rollout", "2", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "5e-2",
        "--use-kl-loss", "--kl-loss-coef", "0.1", "--check-lora-weight-equal", "--save-interval", "2", *backend,
    )  # fmt: skip
    assert len(rows) == 2
    # The first push (version 1) came before rollout 0, the second after its step: each rollout ran on its version.
    for rollout_id, version in ((0, "1"), (1, "2")):
        samples = saved_samples(save, rollout_id)
        assert samples and all(s.weight_versions == [version] for s in samples), [s.weight_versions for s in samples]
    config = json.loads((save / "iter_0000001" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(save / "iter_0000001" / "adapter"))
    lora_b = [p for n, p in adapted.named_parameters() if ".lora_B." in n]
    assert lora_b and max(p.abs().max().item() for p in lora_b) > 0  # trained: peft starts B at zero


def test_lora_train_only_trains_the_adapter_while_the_engines_keep_the_base(tiny_model_dir, tmp_path):
    save = tmp_path / "run"
    rows = run_training(
        "train.py", save,
        *small_run_flags(tiny_model_dir, write_addition_prompts(tmp_path / "prompts.jsonl"), save),
        "--num-rollout", "2", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "5e-2", "--lora-train-only",
        "--save-interval", "2", "--custom-rm-path", "support.rewards.alternating_reward",  # advantages never 0
    )  # fmt: skip
    assert len(rows) == 2
    # Nothing was pushed: every sample came from the weights the engines started with (SGLang's "default" label).
    for rollout_id in (0, 1):
        samples = saved_samples(save, rollout_id)
        assert samples and all(s.weight_versions == ["default"] for s in samples), [s.weight_versions for s in samples]
    # Rollout 0: the new adapter (B = 0) is the base, so trainer and engines agree; rollout 1: the adapter has moved
    # and the engines still generate with the base.
    gaps = [row["train/train_rollout_logprob_abs_diff"] for row in rows]
    assert gaps[0] < 1e-4 < gaps[1], gaps
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        str(save / "iter_0000001" / "adapter"),
    )
    assert max(p.abs().max().item() for n, p in adapted.named_parameters() if ".lora_B." in n) > 0


def test_multi_lora_trains_two_adapters_on_their_own_prompts_and_rewards(tiny_model_dir, tmp_path):
    save = tmp_path / "run"
    files = [
        write_addition_prompts(tmp_path / "a.jsonl", range(1, 4)),
        write_addition_prompts(tmp_path / "b.jsonl", range(6, 9)),
    ]
    rewards = ["support.adapter_rewards.second_of_each_group", "support.adapter_rewards.first_of_each_group"]
    rows = run_training(
        "train.py", save, *small_run_flags(tiny_model_dir, files[0], save),
        "--num-rollout", "2", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "5e-2", "--save-interval", "2",
        "--use-kl-loss", "--kl-loss-coef", "0.1", "--multi-lora-n-adapters", "2",
        "--multi-lora-prompt-data", *map(str, files), "--multi-lora-rm-path", *rewards,
    )  # fmt: skip
    assert len(rows) == 2
    for row in rows:  # per-adapter figures beside the overall ones
        for name in ("rollout/reward", "train/loss", "train/pg_loss"):
            head, rest = name.split("/")
            assert {name, f"{head}/adapter_0/{rest}", f"{head}/adapter_1/{rest}"} <= row.keys(), sorted(row)
    # Each adapter's samples: its own file's prompts, scored by its own reward, 4 per rollout.
    samples = saved_samples(save, 0) + saved_samples(save, 1)
    for adapter, (low, high) in enumerate(((1, 3), (6, 8))):
        own = [s for s in samples if s.lora_adapter == adapter]
        assert len(own) == 8
        texts = [s.prompt if isinstance(s.prompt, str) else s.prompt[-1]["content"] for s in own]
        assert all(int(re.search(r"What is (\d+) \+", text)[1]) in range(low, high + 1) for text in texts), texts
        assert all(s.reward == (float((s.index // 2) % 2) if adapter == 0 else 1 - (s.index // 2) % 2) for s in own)

    folder = save / "iter_0000001" / "adapter"
    names = ["slime-policy-0", "slime-policy-1"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = [PeftModel.from_pretrained(base, str(folder / name), adapter_name=name) for name in names[:1]]
    loaded[0].load_adapter(str(folder / names[1]), adapter_name=names[1])
    weights = {n: p for n, p in loaded[0].named_parameters() if ".lora_B." in n}
    gaps = [(weights[n] - weights[n.replace(names[0], names[1])]).abs().max().item() for n in weights if names[0] in n]
    assert max(gaps) > 1e-3  # the two adapters trained apart (B starts at zero in both)

    # One engine serving both adapters answers the same prompt differently under each name (greedy).
    with cpu_engine_process(tiny_model_dir, "--enable-lora", "--max-lora-rank", "4") as (client, _):
        for name in names:
            client.load_lora_adapter(name, str(folder / name))
        prompt = samples[0].tokens[: len(samples[0].tokens) - samples[0].response_length]
        answers = []
        for name in names:
            output = client.generate(
                {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 8},
                 "return_logprob": True, "lora_path": name}
            )  # fmt: skip
            answers.append([(round(lp, 4), token) for lp, token, _ in output["meta_info"]["output_token_logprobs"]])
        assert answers[0] != answers[1], answers
