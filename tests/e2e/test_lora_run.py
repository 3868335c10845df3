"""LoRA GRPO runs of train.py on CPU (`--lora-rank`), on each trainer: the engines serve the adapter being trained.

What rides on the one run: each push sends only the adapter and the engine's log-probs under it equal the trainer's
(`--check-lora-weight-equal`, every push); the samples were generated under the weight version each push set; the
checkpoint holds a PEFT adapter folder, which peft loads. A run with `--lora-train-only` trains the adapter while the
engines keep the base.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
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
