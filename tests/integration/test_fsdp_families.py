"""The 2026 families the Megatron backend refuses (Qwen3-Next, Qwen3.5, GLM-5, DeepSeek-V3.2, MiniMax-M2, gpt-oss),
on the FSDP trainer and the CPU engine: the trainer's packed log-probs equal a plain HF forward of each sample on its own (a
linear-attention layer's state must not flow from one packed sample into the next), and a training step pushed
to an engine serving the family makes it compute what the trainer's weights compute."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from support.engines import cpu_engine_process, engine_prompt_log_probs
from support.fsdp import CAPTURE_HOOK, CAPTURED, make_args, make_rollout, new_actor, plain_response_log_probs
from support.tiny_model import NEW_FAMILIES, build_tiny_model
from transformers import AutoModelForCausalLM

from slime.backends.fsdp_utils.model import gather_full_state_dict
from slime.utils.arguments import ArgumentValidationError, parse_args

PROBE = [5, 17, 42, 99, 123, 7, 250, 31, 64, 12, 200, 3]

pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


def prompt_log_probs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)


def greedy(model, tokens: list[int], steps: int) -> list[int]:
    """HF's own cached greedy decoding (up to an EOS)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), max_new_tokens=steps, do_sample=False, use_cache=True)
    return out[0, len(tokens) :].tolist()


@pytest.mark.parametrize("family", sorted(NEW_FAMILIES))
def test_fsdp_trains_each_family_and_the_engine_serves_its_weights(tmp_path, family):
    model_dir = build_tiny_model(tmp_path / family, arch=family)
    rollout_id = 200 + sorted(NEW_FAMILIES).index(family)
    data = make_rollout(8, seed=rollout_id)
    with cpu_engine_process(model_dir) as (client, url):
        actor = new_actor(make_args(model_dir, "--lr", "1e-2", "--rollout-data-postprocess-path", CAPTURE_HOOK))
        actor.connect_rollout_engines([client], [url])
        actor.train(rollout_id, data)
        before = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        packed_gap = max(
            (trainer - plain_response_log_probs(before, tokens, response)).abs().max().item()
            for tokens, response, trainer in zip(
                data["tokens"], data["response_lengths"], CAPTURED[rollout_id]["log_probs"], strict=True
            )
        )
        trained = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        trained.load_state_dict(gather_full_state_dict(actor.model))
        expected = prompt_log_probs(trained, PROBE)
        stale_gap = (engine_prompt_log_probs(client, PROBE) - expected).abs().max().item()
        actor.update_weights()
        engine_gap = (engine_prompt_log_probs(client, PROBE) - expected).abs().max().item()
        # decoding with the engine's cache (a recurrent state, a sliding window, an indexer's keys) = HF's
        sampling = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        engine_greedy = client.generate({"input_ids": PROBE[:5], "sampling_params": sampling})["output_ids"]
        # Requests of different lengths at once: prefilled together, or joining a running batch (whose caches merge,
        # or, for a family whose cache cannot be left-padded, wait for it), each answers as it would alone.
        prompts = [PROBE[:3], PROBE[:9], PROBE[2:7]]
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(
                pool.map(
                    lambda p: client.generate({"input_ids": p, "sampling_params": sampling})["output_ids"], prompts
                )
            )
    expected_greedy = greedy(trained, PROBE[:5], 8)
    assert expected_greedy and engine_greedy[: len(expected_greedy)] == expected_greedy
    for prompt, answer in zip(prompts, answers, strict=True):
        expected = greedy(trained, prompt, 8)
        assert expected and answer[: len(expected)] == expected, (prompt, answer, expected)
    # Cached decoding and a full re-run of the sequence agree (the trainer's forward is the latter).
    with torch.no_grad():
        rerun = trained(input_ids=torch.tensor([PROBE[:5] + expected_greedy]), use_cache=False).logits[0, 4:-1]
    assert rerun.argmax(-1).tolist() == expected_greedy
    print(f"{family}: packed {packed_gap:.2e}, stale {stale_gap:.2e}, engine after the push {engine_gap:.2e}")
    assert packed_gap < 1e-5
    assert stale_gap > 1e-2  # the step changed what the weights compute, so the push had something to carry
    assert engine_gap < 1e-4


@pytest.mark.reliability(
    "--train-backend megatron with a Qwen3-Next / Qwen3.5 / GLM-5 / DeepSeek-V3.2 / MiniMax-M2 / gpt-oss checkpoint",
    "refused at parse time, naming the family, the layers Megatron lacks, and --train-backend fsdp",
)
def test_megatron_refuses_the_families_it_cannot_build(tmp_path):
    model_dir = build_tiny_model(tmp_path / "qwen3_next", arch="qwen3_next")
    flags = ["--hf-checkpoint", str(model_dir), "--prompt-data", "x.jsonl", "--num-rollout", "1", "--rollout-batch-size", "2",
             "--n-samples-per-prompt", "2"]  # fmt: skip
    with pytest.raises(ArgumentValidationError, match="qwen3_next models yet: they have gated delta-net"):
        parse_args([*flags, "--train-backend", "megatron"])
    assert parse_args(flags).train_backend == "fsdp"
    with pytest.raises(ArgumentValidationError, match="--freeze-indexer: .* qwen3_next model, which has no DSA"):
        parse_args([*flags, "--freeze-indexer"])


def test_freeze_indexer_keeps_the_dsa_indexer_as_loaded(tmp_path):
    model_dir = build_tiny_model(tmp_path / "glm_moe_dsa", arch="glm_moe_dsa")
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    actor = new_actor(make_args(model_dir, "--lr", "1e-2", "--freeze-indexer"))
    actor.train(210, make_rollout(8, seed=210))
    trained = gather_full_state_dict(actor.model)
    indexer = [name for name in loaded if ".indexer." in name]
    assert indexer and all(torch.equal(trained[name], loaded[name]) for name in indexer)
    changed = [name for name in loaded if not torch.equal(trained[name], loaded[name])]
    assert any("self_attn.q_a_proj" in name for name in changed) and any("mlp" in name for name in changed)
