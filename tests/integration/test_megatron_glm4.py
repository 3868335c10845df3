"""GLM-4 on megatron-core (slime/plugins/models/glm4.py): HF logits at TP=1/2 and bit-exact weight round trips.

GLM-4 differs from Llama in ways a wrong spec or converter would hide in a trivial model, so the tiny
model here has random norm weights (the two post norms must not be swapped or skipped), random QKV
biases and attention strong enough that the partial, interleaved rotary matters. Megatron runs in
spawned gloo workers (tests/support/megatron_cpu.py); the HF reference runs in the pytest process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.megatron_cpu import requires_megatron_core, run_in_processes
from support.megatron_models import MINIMAL_SLIME_FLAGS, build_tiny_hf, hf_logits, megatron_logits, model_args_of
from transformers import AutoModelForCausalLM, Glm4Config

pytestmark = requires_megatron_core

TOLERANCE = 1e-4
VOCAB = 300
GLM4_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "models" / "glm4-9B.sh"


def tiny_glm4(path) -> str:
    """A random Glm4ForCausalLM: rotary on 8 of 16 head dims, GQA, QKV bias, untied output layer."""
    config = Glm4Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )  # fmt: skip
    path = build_tiny_hf(path, config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):
                param.normal_(0.0, 0.5)
            elif param.dim() == 1:  # every RMSNorm: distinct weights, so swapped norms change the output
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    model.save_pretrained(path)
    return path


def _worker(rank: int, world_size: int, path: str, input_ids: torch.Tensor, script_flags: list[str]) -> dict:
    from slime.backends.megatron_utils.config import config_from_hf, transformer_config_from_args
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights, unused_hf_weights
    from slime.backends.megatron_utils.megatron_to_hf import megatron_state_to_hf
    from slime.backends.megatron_utils.model import build_model, gpt_layer_spec, initialize_model_parallel, unwrap_model
    from slime.plugins.models.glm4 import Glm4TransformerLayer
    from slime.utils.arguments import parse_args

    def build(tp: int, **overrides):
        initialize_model_parallel(tensor_model_parallel_size=tp)
        args = config_from_hf(path)
        vars(args).update(tensor_model_parallel_size=tp, **overrides)
        model = build_model(args, wrap_with_ddp=False)
        used = load_hf_weights(model, path)
        model[0].eval()
        return model, used

    results: dict = {"logits": {}, "hf_state": {}}
    for tp in (1, 2):
        model, used = build(tp)
        layers = unwrap_model(model[0]).decoder.layers
        results[f"layer_types_tp{tp}"] = {type(layer).__name__ for layer in layers}
        assert all(isinstance(layer, Glm4TransformerLayer) for layer in layers)
        results[f"unused_tp{tp}"] = unused_hf_weights(path, used)
        results["logits"][tp] = megatron_logits(model[0], input_ids, VOCAB)
        results["hf_state"][tp] = {name: t.clone() for name, t in megatron_state_to_hf(model, "glm4", VOCAB)}

    # Controls: the same weights with the rotary laid out Llama-style, or rotating whole heads, must
    # give clearly different logits, else the equality above would not show the rotary is right.
    controls = {"not_interleaved": dict(rotary_interleaved=False), "full_rotary": dict(rotary_percent=1.0)}
    for control, overrides in controls.items():
        model, _ = build(1, **overrides)
        results["logits"][control] = megatron_logits(model[0], input_ids, VOCAB)

    # scripts/models/glm4-9B.sh, through slime's parser, names the GLM-4 spec (TP=1 state from above).
    args = parse_args(script_flags)
    block = gpt_layer_spec(args, transformer_config_from_args(args))
    results["script_layer_specs"] = [spec.module.__name__ for spec in block.layer_specs]
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tiny_glm4(tmp_path_factory.mktemp("glm4") / "glm4")
    torch.manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, 16))
    reference = hf_logits(path, input_ids)
    script_flags = model_args_of(GLM4_SCRIPT) + MINIMAL_SLIME_FLAGS
    results = run_in_processes(_worker, world_size=2, args=(path, input_ids, script_flags))
    hf_weights = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        hf_weights.update(load_file(file))
    return reference, results, hf_weights


@pytest.mark.parametrize("tp", [1, 2])
def test_glm4megatron_logits_match_hf(runs, tp):
    reference, results, _ = runs
    assert reference.std() > 1.0  # far from trivial logits, so the tolerance means something
    for rank, result in enumerate(results):
        assert result[f"layer_types_tp{tp}"] == {"Glm4TransformerLayer"}
        logits = result["logits"][tp]
        assert logits.shape == reference.shape
        diff = (logits - reference).abs().max().item()
        print(f"glm4 tp{tp} rank{rank}: max |megatron - hf| = {diff:.2e}")
        assert diff <= TOLERANCE, f"tp{tp} rank {rank}: max abs diff {diff:.3e} > {TOLERANCE}"


@pytest.mark.parametrize("control", ["not_interleaved", "full_rotary"])
def test_wrong_rotary_layout_is_detected(runs, control):
    reference, results, _ = runs
    diff = (results[0]["logits"][control] - reference).abs().max().item()
    print(f"glm4 {control}: max |megatron - hf| = {diff:.2e}")
    assert diff > 100 * TOLERANCE


@pytest.mark.parametrize("tp", [1, 2])
def test_glm4_weights_round_trip_bit_exactly(runs, tp):
    _, results, hf_weights = runs
    assert any("post_self_attn_layernorm" in name for name in hf_weights)
    assert any("gate_up_proj" in name for name in hf_weights)
    for result in results:
        assert result[f"unused_tp{tp}"] == []  # HF -> Megatron read every tensor
        exported = result["hf_state"][tp]
        assert exported.keys() == hf_weights.keys()
        for name, tensor in hf_weights.items():
            assert exported[name].dtype == tensor.dtype, name
            assert torch.equal(exported[name], tensor), name


def test_glm4_script_builds_glm4_layer_specs(runs):
    _, results, _ = runs
    # Built in the workers (the block spec needs the pipeline-parallel state): one GLM-4 layer per layer.
    assert results[0]["script_layer_specs"] == ["Glm4TransformerLayer"] * 40


def test_glm4_script_without_spec_is_refused():
    from slime.backends.megatron_utils.config import transformer_config_from_args
    from slime.backends.megatron_utils.model import gpt_layer_spec
    from slime.utils.arguments import parse_args

    # Without --spec, megatron-core's own layers would silently drop the post norms: refused instead.
    flags = model_args_of(GLM4_SCRIPT)
    at = flags.index("--spec")
    assert flags[at + 1 : at + 3] == ["slime.plugins.models.glm4", "get_glm_spec"]
    args = parse_args(flags[:at] + flags[at + 3 :] + MINIMAL_SLIME_FLAGS)
    with pytest.raises(ValueError, match="--spec MODULE FUNCTION"):
        gpt_layer_spec(args, transformer_config_from_args(args))
