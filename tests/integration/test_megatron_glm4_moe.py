"""GLM-4.5 MoE (HF `Glm4MoeForCausalLM`) on megatron-core: HF logits at TP=1 and EP=2, and a bit-exact weight round
trip (fused or per-expert HF names, router bias, shared experts, the dense first layer).

The tiny model (`build_tiny_model(arch="glm4_moe")`) has random QKV biases, random norms, a non-zero router bias and
two expert groups, so a wrong rotary layout, a skipped bias or a wrong routing rule shows in the logits. Megatron runs in spawned gloo workers
(tests/support/megatron_cpu.py); the HF reference runs in the pytest process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.megatron_cpu import requires_megatron_core, run_in_processes
from support.megatron_models import hf_logits, megatron_logits
from support.tiny_model import build_tiny_model

pytestmark = requires_megatron_core

TOLERANCE = 1e-4


def _worker(rank: int, world_size: int, path: str, input_ids: torch.Tensor) -> dict:
    from slime.backends.megatron_utils.config import config_from_hf, load_hf_config
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights, unused_hf_weights
    from slime.backends.megatron_utils.megatron_to_hf import megatron_state_to_hf
    from slime.backends.megatron_utils.model import build_model, initialize_model_parallel

    results: dict = {"logits": {}, "hf_state": {}, "unused": {}}
    for layout, sizes in {"tp1": {}, "ep2": dict(expert_model_parallel_size=2)}.items():
        initialize_model_parallel(**sizes)
        args = config_from_hf(path)
        vars(args).update(sizes)
        model = build_model(args, wrap_with_ddp=False)
        used = load_hf_weights(model, path)
        model[0].eval()
        results["unused"][layout] = unused_hf_weights(path, used)
        vocab = load_hf_config(path)["vocab_size"]
        results["logits"][layout] = megatron_logits(model[0], input_ids, vocab)
        results["hf_state"][layout] = {name: t.clone() for name, t in megatron_state_to_hf(model, "glm4_moe", vocab)}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(build_tiny_model(tmp_path_factory.mktemp("glm4_moe"), arch="glm4_moe", num_layers=3))
    torch.manual_seed(1)
    input_ids = torch.randint(0, 250, (2, 16))
    reference = hf_logits(path, input_ids)
    results = run_in_processes(_worker, world_size=2, args=(path, input_ids))
    hf_weights = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        hf_weights.update(load_file(file))
    return reference, results, hf_weights


@pytest.mark.parametrize("layout", ["tp1", "ep2"])
def test_glm4_moe_megatron_logits_match_hf(runs, layout):
    reference, results, _ = runs
    assert reference.std() > 1.0  # far from trivial logits, so the tolerance means something
    for rank, result in enumerate(results):
        diff = (result["logits"][layout] - reference).abs().max().item()
        print(f"glm4_moe {layout} rank{rank}: max |megatron - hf| = {diff:.2e}")
        assert diff <= TOLERANCE, f"{layout} rank {rank}: max abs diff {diff:.3e} > {TOLERANCE}"


@pytest.mark.parametrize("layout", ["tp1", "ep2"])
def test_glm4_moe_weights_round_trip_bit_exactly(runs, layout):
    _, results, hf_weights = runs
    assert any("e_score_correction_bias" in name for name in hf_weights)
    assert any("shared_experts" in name for name in hf_weights)
    # HF -> Megatron read every tensor (under EP=2 each rank its own half of the experts)
    assert set.intersection(*(set(result["unused"][layout]) for result in results)) == set()
    for result in results:
        exported = result["hf_state"][layout]
        assert exported.keys() == hf_weights.keys()
        for name, tensor in hf_weights.items():
            assert exported[name].dtype == tensor.dtype, name
            assert torch.equal(exported[name], tensor), name
