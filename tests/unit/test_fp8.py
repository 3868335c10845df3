"""Block-wise FP8 weights (slime.utils.fp8), the conversion tools and the CPU engine's FP8 loading, on CPU.

Expected values are computed here block by block with plain loops: each block's scale is its largest magnitude
over 448 (e4m3's largest value), and e4m3 keeps 3 mantissa bits, so a normal value comes back within half its
relative step of 2**-3 (2**-4 |x|) and a subnormal one (below 2**-6 in scaled units, step 2**-9) within 2**-10
of its block's scale.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.tiny_model import build_tiny_model

from slime.backends.cpu_engine import weights
from slime.utils import fp8

REPO = Path(__file__).resolve().parents[2]


def block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """amax / 448 of every block (1 for an all-zero block), by loops."""
    rows, cols = math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1])
    scales = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            amax = float(tile.abs().max())
            scales[i, j] = amax / 448 if amax > 0 else 1.0
    return scales


def error_bound(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per element: 2**-4 |x| + 2**-10 * its block's scale (+ float32 rounding of the scaling)."""
    per_element = block_scales(w, block).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    per_element = per_element[: w.shape[0], : w.shape[1]]
    return 2**-4 * w.abs() + 2**-10 * per_element + 1e-6 * w.abs()


def spread_weight(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Random signs and magnitudes spread over five decades, so normal and subnormal e4m3 values both occur."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = 10 ** (torch.rand(shape, generator=generator) * 5 - 4)
    return magnitude * torch.randn(shape, generator=generator).sign()


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((256, 128), (128, 128)), ((70, 45), (32, 16))])
def test_round_trip_stays_within_the_e4m3_step_of_every_block(shape, block):
    w = spread_weight(shape)
    w_fp8, scale_inv = fp8.quantize_block_fp8(w, block)
    assert w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == w.shape
    assert scale_inv.dtype == torch.float32
    assert tuple(scale_inv.shape) == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    torch.testing.assert_close(scale_inv, block_scales(w, block), rtol=1e-6, atol=0)
    back = fp8.dequantize_block_fp8(w_fp8, scale_inv, block)
    error = (back - w).abs()
    assert bool((error <= error_bound(w, block)).all()), float((error / error_bound(w, block)).max())
    # It does quantize: most values move, by a typical relative error far above float32's.
    assert float((error / w.abs()).median()) > 2**-8


def test_each_blocks_largest_magnitude_comes_back_exactly():
    w = spread_weight((200, 300), seed=1)
    block = (64, 128)
    back = fp8.dequantize_block_fp8(*fp8.quantize_block_fp8(w, block), block)
    for i in range(0, 200, 64):
        for j in range(0, 300, 128):
            tile, tile_back = w[i : i + 64, j : j + 128], back[i : i + 64, j : j + 128]
            k = tile.abs().argmax()
            torch.testing.assert_close(tile_back.flatten()[k], tile.flatten()[k], rtol=1e-6, atol=0)


def test_a_zero_block_stays_zero_with_a_finite_scale():
    w = spread_weight((256, 256))
    w[128:, :128] = 0
    w_fp8, scale_inv = fp8.quantize_block_fp8(w)
    assert bool(torch.isfinite(scale_inv).all()) and float(scale_inv[1, 0]) == 1.0
    back = fp8.dequantize_block_fp8(w_fp8, scale_inv)
    assert bool((back[128:, :128] == 0).all()) and bool(torch.isfinite(back).all())


def test_bf16_weights_quantize_like_their_float32_values():
    w = spread_weight((130, 260)).bfloat16()
    a = fp8.quantize_block_fp8(w)
    b = fp8.quantize_block_fp8(w.float())
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_a_scale_of_another_block_size_is_refused():
    w_fp8, scale_inv = fp8.quantize_block_fp8(spread_weight((256, 256)), (128, 128))
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8.dequantize_block_fp8(w_fp8, scale_inv, (64, 64))


def test_only_decoder_linear_weights_are_quantized():
    matrix, vector = torch.zeros(4, 4), torch.zeros(4)
    quantized = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
        "model.layers.1.mlp.experts.5.gate_proj.weight",
        "model.language_model.layers.0.self_attn.o_proj.weight",
    ]
    kept = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.mlp.gate.weight",  # MoE router
        "model.layers.0.mlp.shared_expert_gate.weight",
        "model.visual.blocks.0.attn.qkv.weight",
    ]
    assert all(fp8.is_fp8_quantized(name, matrix) for name in quantized)
    assert not any(fp8.is_fp8_quantized(name, matrix) for name in kept)
    assert not fp8.is_fp8_quantized("model.layers.0.self_attn.q_proj.bias", vector)
    assert not fp8.is_fp8_quantized("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(2, 4, 4))  # fused 3-D
    assert not fp8.is_fp8_quantized("model.layers.0.self_attn.q_proj.weight", matrix.long())


def test_named_tensors_round_trip_and_unpaired_tensors_are_named():
    named = [("model.layers.0.mlp.up_proj.weight", spread_weight((40, 30))), ("model.norm.weight", torch.ones(30))]
    quantized = fp8.quantize_named_tensors(named, (16, 16))
    assert [name for name, _ in quantized] == [
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.up_proj.weight_scale_inv",
        "model.norm.weight",
    ]
    back = fp8.dequantize_named_tensors(quantized, (16, 16))
    assert [name for name, _ in back] == [name for name, _ in named]
    assert bool(((back[0][1] - named[0][1]).abs() <= error_bound(named[0][1], (16, 16))).all())
    assert back[1][1] is named[1][1]
    with pytest.raises(ValueError, match="without their _scale_inv.*up_proj"):
        fp8.dequantize_named_tensors(quantized[:1] + quantized[2:], (16, 16))
    with pytest.raises(ValueError, match="without an FP8 weight.*up_proj"):
        fp8.dequantize_named_tensors(quantized[1:], (16, 16))


def test_rollout_fp8_block_follows_the_checkpoint_and_the_flag(tmp_path):
    plain, quantized = tmp_path / "plain", tmp_path / "fp8"
    plain.mkdir(), quantized.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (quantized / "config.json").write_text(json.dumps({"quantization_config": fp8.fp8_quantization_config((64, 32))}))

    def args(path, backend, **flags):
        return Namespace(hf_checkpoint=str(path), rollout_backend=backend, sglang_server_args=flags)

    assert fp8.rollout_fp8_block(args(plain, "cpu")) is None
    assert fp8.rollout_fp8_block(args(plain, "cpu", quantization="fp8")) == (128, 128)
    assert fp8.rollout_fp8_block(args(quantized, "sglang")) == (64, 32)
    assert fp8.rollout_fp8_block(args(quantized, "sglang", quantization="fp8")) == (64, 32)
    with pytest.raises(ValueError, match="tools/convert_hf_to_fp8.py"):
        fp8.rollout_fp8_block(args(plain, "sglang", quantization="fp8"))
    (quantized / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8.rollout_fp8_block(args(quantized, "cpu"))


# ----- the tools and the CPU engine's loading ------------------------------------------------------------------


def tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def model_128(tmp_path_factory) -> Path:
    """A tiny Llama 128 wide (k/v projections 64 x 128: ragged blocks of 48 x 80 and whole ones of 128 x 128)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_128"), hidden_size=128)


@pytest.mark.parametrize("block", [(128, 128), (48, 80)])
def test_convert_and_cast_back_through_both_tools(model_128, tmp_path, block):
    fp8_dir, back_dir = tmp_path / "fp8", tmp_path / "back"
    tool("convert_hf_to_fp8")(
        ["--model-dir", str(model_128), "--save-dir", str(fp8_dir), "--block-size", *map(str, block)]
    )
    original = load_file(model_128 / "model.safetensors")
    stored = load_file(fp8_dir / "model.safetensors")
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    assert (fp8_dir / "tokenizer.json").read_bytes() == (model_128 / "tokenizer.json").read_bytes()
    for name, tensor in original.items():
        if ".layers." in name and "norm" not in name:
            assert stored[name].dtype == torch.float8_e4m3fn
            rows, cols = math.ceil(tensor.shape[0] / block[0]), math.ceil(tensor.shape[1] / block[1])
            assert tuple(stored[name + "_scale_inv"].shape) == (rows, cols)
        else:
            assert torch.equal(stored[name], tensor) and name + "_scale_inv" not in stored
    assert len(stored) == len(original) + 14  # 2 layers x 7 Linear weights

    tool("fp8_cast_bf16")(
        ["--input-fp8-hf-path", str(fp8_dir), "--output-bf16-hf-path", str(back_dir), "--dtype", "float32"]
    )
    restored = load_file(back_dir / "model.safetensors")
    assert restored.keys() == original.keys()
    assert "quantization_config" not in json.loads((back_dir / "config.json").read_text())
    for name, tensor in original.items():
        assert restored[name].dtype == torch.float32
        if stored[name].dtype == torch.float8_e4m3fn:
            assert bool(((restored[name] - tensor).abs() <= error_bound(tensor, block)).all()), name
        else:
            assert torch.equal(restored[name], tensor), name


def test_tools_refuse_an_existing_output_and_the_wrong_input(model_128, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit):
        tool("convert_hf_to_fp8")(["--model-dir", str(model_128), "--save-dir", str(taken)])
    assert "already exists" in capsys.readouterr().err and (taken / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no staging folder left behind
    with pytest.raises(SystemExit):
        tool("fp8_cast_bf16")(["--input-fp8-hf-path", str(model_128), "--output-bf16-hf-path", str(tmp_path / "x")])
    assert "not an FP8 checkpoint" in capsys.readouterr().err
    fp8_dir = tmp_path / "fp8"
    tool("convert_hf_to_fp8")(["--model-dir", str(model_128), "--save-dir", str(fp8_dir)])
    with pytest.raises(SystemExit):
        tool("convert_hf_to_fp8")(["--model-dir", str(fp8_dir), "--save-dir", str(tmp_path / "y")])
    assert "quantized already" in capsys.readouterr().err


def dequantized_reference(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors with every FP8 weight times its block scales, by loops over the blocks."""
    stored = load_file(folder / "model.safetensors")
    out = {}
    for name, tensor in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scales, value = stored[name + "_scale_inv"], tensor.float()
            for i in range(scales.shape[0]):
                for j in range(scales.shape[1]):
                    value[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= scales[i, j]
            tensor = value
        out[name] = tensor
    return out


def test_the_cpu_engine_loads_an_fp8_checkpoint_dequantized(model_128, tmp_path):
    fp8_dir = tmp_path / "fp8"
    tool("convert_hf_to_fp8")(["--model-dir", str(model_128), "--save-dir", str(fp8_dir)])
    model, _ = weights.load_model(fp8_dir)
    live = model.state_dict()
    for name, tensor in dequantized_reference(fp8_dir).items():
        assert torch.equal(live[name], tensor), name
    assert weights.weight_targets(model).fp8_block == (128, 128)


def test_fp8_pushes_are_dequantized_and_plain_ones_rounded_on_an_fp8_model(model_128):
    name = "model.layers.1.mlp.gate_proj.weight"
    new = spread_weight((256, 128), seed=3) * 0.1
    w_fp8, scale_inv = fp8.quantize_block_fp8(new)

    plain_model, _ = weights.load_model(model_128)  # not FP8: an FP8 push is still dequantized
    weights.copy_named_tensors(weights.weight_targets(plain_model), [(name, w_fp8), (name + "_scale_inv", scale_inv)])
    expected = torch.cat([w_fp8[:128].float() * scale_inv[0, 0], w_fp8[128:].float() * scale_inv[1, 0]])
    assert torch.equal(plain_model.state_dict()[name], expected)
    weights.copy_named_tensors(weights.weight_targets(plain_model), [(name, new)])  # plain: taken as it is
    assert torch.equal(plain_model.state_dict()[name], new)

    weights.enable_fp8(plain_model)  # now FP8: the loaded weights were rounded, and so is a plain push
    weights.copy_named_tensors(weights.weight_targets(plain_model), [(name, new)])
    assert torch.equal(plain_model.state_dict()[name], expected)
    embed = plain_model.state_dict()["model.embed_tokens.weight"]
    assert torch.equal(embed, load_file(model_128 / "model.safetensors")["model.embed_tokens.weight"])

    with pytest.raises(ValueError, match="nothing was changed.*without their _scale_inv"):
        weights.copy_named_tensors(weights.weight_targets(plain_model), [(name, w_fp8)])
    with pytest.raises(ValueError, match="nothing was changed.*another weight_block_size"):
        weights.copy_named_tensors(
            weights.weight_targets(plain_model), [(name, w_fp8), (name + "_scale_inv", scale_inv[:1])]
        )
    assert torch.equal(plain_model.state_dict()[name], expected)


def test_sglang_quantization_reaches_the_cpu_engine_command_line(model_128):
    from slime.backends.cpu_engine.server import parse_args as engine_parse_args
    from slime.backends.sglang_utils.engine_command_line import build_cpu_engine_args
    from slime.utils.arguments import parse_args

    def slime_args(*flags: str) -> Namespace:
        required = [
            "--prompt-data",
            "x.jsonl",
            "--rollout-batch-size",
            "8",
            "--n-samples-per-prompt",
            "2",
            "--num-rollout",
            "1",
        ]
        return parse_args(["--hf-checkpoint", str(model_128), "--rollout-backend", "cpu", *required, *flags])

    cli = build_cpu_engine_args(slime_args("--sglang-quantization", "fp8"), model_path="/m", host="127.0.0.1", port=5)
    assert engine_parse_args(cli).quantization == "fp8"
    assert fp8.rollout_fp8_block(slime_args("--sglang-quantization", "fp8")) == (128, 128)
    plain = build_cpu_engine_args(slime_args(), model_path="/m", host="127.0.0.1", port=5)
    assert engine_parse_args(plain).quantization is None and fp8.rollout_fp8_block(slime_args()) is None
    with pytest.raises(ValueError, match="--sglang-quantization awq: the CPU engine runs only fp8"):
        build_cpu_engine_args(slime_args("--sglang-quantization", "awq"), model_path="/m", host="127.0.0.1", port=5)


@pytest.mark.parametrize(
    "extra",
    [
        ["--check-weight-update-equal"],
        ["--use-fault-tolerance"],
        ["--update-weight-mode", "delta", "--update-weight-transport", "disk", "--update-weight-disk-dir", "/tmp/d"],
    ],
)
def test_fp8_engines_refuse_checks_against_the_trainers_unrounded_weights(extra):
    from slime.utils.arguments import ArgumentValidationError, parse_args

    base = ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--num-rollout", "1", "--rollout-batch-size", "2"]
    base += ["--n-samples-per-prompt", "2", "--rollout-backend", "cpu", "--sglang-quantization", "fp8"]
    assert parse_args(base).sglang_server_args == {"quantization": "fp8"}
    with pytest.raises(ArgumentValidationError, match=f"{re.escape(extra[0])}.* with FP8 engines \\(block 128x128\\)"):
        parse_args([*base, *extra])
