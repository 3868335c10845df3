"""examples/on_policy_distillation/run-opd.sh end to end: a student trained toward a different teacher gets closer."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from support.opd import chat_prompt_ids, teacher_forward_log_probs
from support.runs import REPO, rollout_rows, saved_samples, write_addition_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

EXAMPLE = REPO / "examples" / "on_policy_distillation"


def fixed_sequences(student_dir, prompts: list[str], new_tokens: int = 8) -> list[tuple[list[int], int]]:
    """(prompt + continuation, prompt length) per prompt: chat-templated prompts continued by the initial
    student with a fixed seed, the contexts the KL is measured on before and after training."""
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    model = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    sequences = []
    for prompt in prompts:
        ids = chat_prompt_ids(tokenizer, prompt)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens, top_k=0
            )
        sequences.append((out[0].tolist(), len(ids)))
    return sequences


def reverse_kl_to_teacher(student_dir, teacher_dir, sequences: list[tuple[list[int], int]]) -> float:
    """Exact KL(student || teacher) over the whole vocabulary at every response position of `sequences`, averaged."""
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    kls = []
    with torch.no_grad():
        for tokens, prompt_length in sequences:
            ids = torch.tensor([tokens])
            positions = slice(prompt_length - 1, len(tokens) - 1)  # the logits that predict the response tokens
            log_s = student(input_ids=ids).logits[0, positions].log_softmax(-1)
            log_t = teacher(input_ids=ids).logits[0, positions].log_softmax(-1)
            kls.append((log_s.exp() * (log_s - log_t)).sum(-1))
    return torch.cat(kls).mean().item()


@pytest.mark.slow
def test_train_py_distils_the_student_toward_the_teacher(tiny_model_dir, teacher_dir, tmp_path):
    """examples/on_policy_distillation/run-opd.sh as a user runs it: it serves the teacher with a CPU engine."""
    prompt_file = write_addition_prompts(tmp_path / "prompts.jsonl")
    prompts = [json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines()]
    sequences = fixed_sequences(tiny_model_dir, prompts)
    kl_before = reverse_kl_to_teacher(tiny_model_dir, teacher_dir, sequences)
    num_rollout, save = 10, tmp_path / "run"
    env = dict(
        os.environ, MODEL=str(tiny_model_dir), TEACHER=str(teacher_dir), DATA=str(prompt_file), OUT=str(save),
        NUM_ROLLOUT=str(num_rollout),
    )  # fmt: skip
    flags = [
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
        "--num-steps-per-rollout", "2", "--lr", "1e-2",
        "--save-interval", str(num_rollout), "--save-hf", str(save / "hf_{rollout_id}"),
    ]  # fmt: skip
    result = subprocess.run(
        ["bash", str(EXAMPLE / "run-opd.sh"), *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=400
    )
    assert result.returncode == 0, f"run-opd.sh failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    history = rollout_rows(save)
    kl_after = reverse_kl_to_teacher(save / f"hf_{num_rollout - 1}", teacher_dir, sequences)
    trajectory = [round(row["train/opd_reverse_kl"], 3) for row in history]
    print(f"KL(student || teacher) on fixed prompts: {kl_before:.4f} -> {kl_after:.4f}; per-rollout {trajectory}")
    assert [row["rollout_id"] for row in history] == list(range(num_rollout))
    # Measured: 2.54 -> 0.61-0.69 of it over three rollout seeds; the trainer's own estimate falls too.
    assert kl_after < 0.85 * kl_before
    assert sum(trajectory[-3:]) < sum(trajectory[:3])

    # What the real rollout stored is the teacher's forward pass, and pure distillation scored every sample 0.
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    samples = saved_samples(save, num_rollout - 1)
    assert samples and all(s.reward == 0.0 for s in samples)
    for s in samples:
        expected = teacher_forward_log_probs(teacher, s.tokens, s.response_length, 1.0)
        assert s.teacher_log_probs == pytest.approx(expected, abs=1e-4)
