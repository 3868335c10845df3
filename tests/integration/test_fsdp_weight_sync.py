"""FSDP trainer -> CPU engine weight sync, both transports, against a real engine server process.

After a training step changes the weights, `update_weights` must make the engine compute what
the trainer's weights compute: prompt log-probs within 1e-4 and the same greedy continuation.
The expected values come from a plain HF model given the trainer's gathered weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.engines import cpu_engine_process, engine_prompt_log_probs
from support.fsdp import make_rollout
from transformers import AutoModelForCausalLM

from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
from slime.backends.fsdp_utils.model import gather_full_state_dict
from slime.backends.sglang_utils.http_client import EngineClient
from slime.utils.arguments import parse_args

PROBE = [5, 17, 42, 99, 123, 7, 250, 31, 64, 12, 200, 3]


pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


@pytest.fixture
def engine(tiny_model_dir):
    with cpu_engine_process(tiny_model_dir) as client_and_url:
        yield client_and_url


def make_args(model_dir, *extra: str):
    return parse_args(
        [
            "--hf-checkpoint",
            str(model_dir),
            "--prompt-data",
            "unused.jsonl",
            "--num-rollout",
            "2",
            "--rollout-batch-size",
            "8",
            "--n-samples-per-prompt",
            "1",
            "--loss-type",
            "sft_loss",
            "--lr",
            "1e-2",
            # ~40 kB buckets: the ~0.4 MB model goes over in several of them
            "--update-weight-buffer-size",
            "40000",
            *extra,
        ]
    )


def trainer_model(actor, model_dir) -> torch.nn.Module:
    """A plain HF model holding the trainer's current (gathered) weights."""
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    plain.load_state_dict(gather_full_state_dict(actor.model))
    return plain


def plain_prompt_log_probs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)


def plain_greedy(model, tokens: list[int], steps: int) -> list[int]:
    tokens = list(tokens)
    for _ in range(steps):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[-steps:]


def engine_greedy(client: EngineClient, tokens: list[int], steps: int) -> list[int]:
    response = client.generate(
        {"input_ids": tokens, "sampling_params": {"max_new_tokens": steps, "temperature": 0.0, "ignore_eos": True}}
    )
    return response["output_ids"]


def check_engine_matches_trainer(actor, client: EngineClient, model_dir) -> float:
    """Assert the engine reproduces the trainer's log-probs and greedy tokens; return the log-prob gap."""
    plain = trainer_model(actor, model_dir)
    gap = (engine_prompt_log_probs(client, PROBE) - plain_prompt_log_probs(plain, PROBE)).abs().max().item()
    assert gap < 1e-4, gap
    assert engine_greedy(client, PROBE[:5], 8) == plain_greedy(plain, PROBE[:5], 8)
    return gap


@pytest.mark.parametrize("colocate", [True, False], ids=["tensor", "distributed"])
def test_update_weights_makes_engine_match_trainer(tiny_model_dir, engine, colocate):
    client, url = engine
    args = make_args(tiny_model_dir, *(["--colocate", "--check-weight-update-equal"] if colocate else []))
    actor = FSDPTrainRayActor(1, 0, None, None)
    actor.init(args, "actor")
    actor.connect_rollout_engines([client], [url])
    assert client.get_model_info()["weight_version"] == "default"

    for expected_version in ("1", "2"):
        actor.train(int(expected_version), make_rollout(8, seed=int(expected_version)))
        stale = engine_prompt_log_probs(client, PROBE) - plain_prompt_log_probs(
            trainer_model(actor, tiny_model_dir), PROBE
        )
        assert stale.abs().max().item() > 1e-2  # the step really changed what the trainer computes
        actor.update_weights()
        gap = check_engine_matches_trainer(actor, client, tiny_model_dir)
        assert client.get_model_info()["weight_version"] == expected_version
        assert actor.check_weights_equal()["max_abs_diff"] < 1e-4
        print(f"{'tensor' if colocate else 'distributed'} update {expected_version}: log-prob gap {gap:.2e}")


@pytest.mark.reliability(
    "a weight update the engine refuses (a parameter name it does not have)",
    "the trainer raises with the engine's own message; the engine is not left paused and keeps its weights",
)
def test_failed_update_leaves_engine_serving(tiny_model_dir, engine):
    from slime.backends.weight_sync import SharedMemoryTransport, WeightUpdater
    from slime.utils.http_utils import find_free_port

    client, url = engine
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    before = engine_prompt_log_probs(client, PROBE)
    updater = WeightUpdater(rank=0)
    updater.connect(SharedMemoryTransport(gpus_per_engine=1), [client], [url])
    bucket = [("model.layers.0.mlp.no_such_proj.weight", torch.zeros(4, 4))]
    with pytest.raises(RuntimeError, match="no_such_proj"):
        updater.push([bucket])
    assert updater.version == 0
    assert client.get_server_info()["internal_states"][0]["paused"] is False
    assert torch.equal(engine_prompt_log_probs(client, PROBE), before)
