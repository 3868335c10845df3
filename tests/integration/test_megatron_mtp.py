"""Multi-token prediction (`--enable-mtp-training`) on megatron-core, checked against a hand computation.

The tiny GLM-4.5 checkpoint carries one MTP layer as GLM-4.5 and DeepSeek-V3 ship it: an extra decoder layer
`model.layers.{num_hidden_layers}` with `enorm`, `hnorm`, `eh_proj` and `shared_head.norm`, which transformers'
model leaves out. The reference is written from that layout with transformers' own modules: the main model's final
hidden state at position p and the embedding of token p + 1, each RMS-normed, concatenated, projected, run through
the MTP decoder layer and its norm, and scored by the shared output head against token p + 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from support.megatron_actor import make_args, make_rollout, new_megatron_actor
from support.megatron_cpu import requires_megatron_core, run_in_processes
from support.tiny_model import build_tiny_model
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRMSNorm

pytestmark = requires_megatron_core

SCALE = 0.5  # --mtp-loss-scaling-factor
MAIN_LAYERS = 2
MTP = f"model.layers.{MAIN_LAYERS}."


def build_glm4_moe_with_mtp(root: Path) -> tuple[Path, Path]:
    """A tiny GLM-4.5 with 2 decoder layers and 1 MTP layer, and the 3-layer model it is made from: the last
    layer of the 3-layer model becomes the MTP layer's decoder layer, which gets its own norms and projection.

    Returns:
        (the checkpoint with the MTP layer, the 3-layer model whose layer 2 the reference runs).
    """
    full = build_tiny_model(root / "three_layers", arch="glm4_moe", num_layers=MAIN_LAYERS + 1)
    path = root / "with_mtp"
    shutil.copytree(full, path)
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=MAIN_LAYERS, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
        file.unlink()
    hidden = config["hidden_size"]
    generator = torch.Generator().manual_seed(3)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{MTP}{norm}.weight"] = 1.0 + 0.3 * torch.randn(hidden, generator=generator)
    weights[f"{MTP}eh_proj.weight"] = 0.2 * torch.randn(hidden, 2 * hidden, generator=generator)
    save_file(weights, str(path / "model.safetensors"))
    return path, full


def _worker(rank: int, world_size: int, path: str, rollout: dict) -> dict:
    from slime.backends.megatron_utils.config import config_from_hf, load_hf_config
    from slime.backends.megatron_utils.data import pack_micro_batch
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights, unused_hf_weights
    from slime.backends.megatron_utils.megatron_to_hf import model_dims
    from slime.backends.megatron_utils.model import build_model, initialize_model_parallel
    from slime.backends.megatron_utils.mtp import forward_with_mtp, mtp_cross_entropy, mtp_loss_mask
    from slime.backends.megatron_utils.weight_mapping import convert_megatron_tensor_to_hf

    initialize_model_parallel()
    args = config_from_hf(path)
    args.mtp_num_layers, args.mtp_loss_scaling_factor = 1, SCALE
    model = build_model(args, wrap_with_ddp=False)
    unused = unused_hf_weights(path, load_hf_weights(model, path))
    gpt = model[0]
    gpt.train()
    vocab = load_hf_config(path)["vocab_size"]
    indices = list(range(len(rollout["tokens"])))
    batch = pack_micro_batch(rollout["tokens"], rollout["response_lengths"], indices)
    response_mask = torch.cat([torch.tensor(m) for m in rollout["loss_masks"]])
    mask = mtp_loss_mask(batch.input_ids, batch.cu_seqlens, batch.logit_positions, response_mask, depth=1)
    logits, depths = forward_with_mtp(
        gpt, gpt, batch.input_ids, batch.position_ids, batch.attention_mask(), mask, vocab
    )
    logged = float(mtp_cross_entropy(depths, batch.input_ids, mask, vocab))
    (logits.sum() * 0).backward()  # no main loss: every gradient is the MTP loss's (megatron-core's scale is 1)
    dims = model_dims(model, "glm4_moe", vocab)
    grads = {}
    for name, param in gpt.named_parameters():
        if param.grad is not None:
            grads.update(convert_megatron_tensor_to_hf(name, param.grad, dims))
    return {"unused": unused, "logits": logits[0, :, :vocab].detach(), "logged": logged, "grads": grads}


def reference(path: Path, full: Path, rollout: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """HF logits of the samples, the MTP loss, and the gradients of SCALE x that loss by HF name."""
    config = AutoConfig.from_pretrained(path)
    main = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    layer = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32).model.layers[MAIN_LAYERS]
    weights = load_file(str(path / "model.safetensors"))
    norms = {n: Glm4MoeRMSNorm(config.hidden_size, config.rms_norm_eps) for n in ("enorm", "hnorm", "shared_head.norm")}
    for name, norm in norms.items():
        norm.weight.data.copy_(weights[f"{MTP}{name}.weight"])
    eh_proj = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    eh_proj.weight.data.copy_(weights[f"{MTP}eh_proj.weight"])
    mtp_params = {f"{MTP}{n}": p for n, p in layer.named_parameters()}
    mtp_params |= {f"{MTP}{n}.weight": norm.weight for n, norm in norms.items()}
    mtp_params[f"{MTP}eh_proj.weight"] = eh_proj.weight

    all_logits, losses, counts = [], [], 0
    for tokens, response_length, mask in zip(
        rollout["tokens"], rollout["response_lengths"], rollout["loss_masks"], strict=True
    ):
        ids = torch.tensor([tokens])
        n, prompt = len(tokens), len(tokens) - response_length
        all_logits.append(main(ids).logits[0])
        hidden = main.model(ids).last_hidden_state
        x = torch.cat([norms["enorm"](main.model.embed_tokens(ids[:, 1:])), norms["hnorm"](hidden[:, :-1])], -1)
        x = eh_proj(x)
        positions = torch.arange(n - 1)[None]
        causal = torch.full((n - 1, n - 1), float("-inf")).triu(1)[None, None]
        x = layer(
            x, attention_mask=causal, position_ids=positions, position_embeddings=main.model.rotary_emb(x, positions)
        )
        logits = main.lm_head(norms["shared_head.norm"](x))[0]
        # Position p predicts token p + 2 where that is a trained response token.
        trained = torch.tensor([0] * prompt + list(mask), dtype=torch.bool)
        chosen = torch.tensor([trained[p + 2] for p in range(n - 2)])
        per_token = F.cross_entropy(logits[: n - 2], ids[0, 2:], reduction="none")
        losses.append(per_token[chosen].sum())
        counts += int(chosen.sum())
    loss = SCALE * torch.stack(losses).sum() / counts
    loss.backward()
    grads = {name: p.grad for name, p in main.named_parameters() if p.grad is not None}
    grads |= {name: p.grad for name, p in mtp_params.items() if p.grad is not None}
    return torch.cat(all_logits).detach(), loss.detach() / SCALE, grads


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path, full = build_glm4_moe_with_mtp(tmp_path_factory.mktemp("glm4_moe_mtp"))
    rollout = make_rollout(num_samples=4, seed=5)
    rollout["loss_masks"][1][2] = 0  # a masked-out response token (a tool's output) is no MTP target either
    (result,) = run_in_processes(_worker, world_size=1, args=(str(path), rollout))
    return result, reference(path, full, rollout)


def test_mtp_layer_loads_and_leaves_the_main_logits_as_hf_computes_them(runs):
    result, (logits, _, _) = runs
    assert result["unused"] == set() or not any(name.startswith(MTP) for name in result["unused"])
    assert (result["logits"] - logits).abs().max().item() <= 1e-4


def test_mtp_loss_and_gradients_equal_the_hand_computation(runs):
    result, (_, loss, grads) = runs
    assert abs(result["logged"] - loss.item()) <= 1e-5, (result["logged"], loss.item())
    compared = sorted(set(grads) & set(result["grads"]))
    expected_names = {
        f"{MTP}eh_proj.weight", f"{MTP}enorm.weight", f"{MTP}hnorm.weight", f"{MTP}shared_head.norm.weight",
        f"{MTP}self_attn.o_proj.weight", "model.embed_tokens.weight", "lm_head.weight",
        "model.layers.0.self_attn.o_proj.weight", "model.norm.weight",
    }  # fmt: skip
    assert expected_names <= set(compared), expected_names - set(compared)
    diffs = {name: (result["grads"][name] - grads[name]).abs().max().item() for name in compared}
    wrong = {name: f"{d:.2e}" for name, d in diffs.items() if d > 1e-5 * max(1.0, grads[name].abs().max().item())}
    assert not wrong, wrong
    assert (
        grads[f"{MTP}eh_proj.weight"].abs().sum() > 0
        and grads["model.layers.0.self_attn.o_proj.weight"].abs().sum() > 0
    )


def _actor_worker(rank: int, world_size: int, path: str, out: str, rollout: dict, flags: tuple) -> dict:
    from slime.ray.rollout import split_train_data_by_dp

    args = make_args(path, *flags, "--micro-batch-size", "8", "--save", f"{out}/checkpoint")
    data = split_train_data_by_dp(args, {k: v for k, v in rollout.items() if isinstance(v, list)}, 1)[0]
    actor, _ = new_megatron_actor(rank, world_size, args)
    metrics = actor.train(0, data)
    pushed = sorted(actor.hf_weights())
    actor._save_hf(f"{out}/hf")
    actor.save_model(0)
    # A resumed run starts from the checkpoint's MTP layer, not the HF one.
    resumed, _ = new_megatron_actor(rank, world_size, make_args(path, *flags, "--load", f"{out}/checkpoint"))
    resumed._save_hf(f"{out}/resumed_hf")
    return {"metrics": metrics, "pushed": pushed}


@pytest.fixture(scope="module")
def actor_run(tmp_path_factory):
    path, full = build_glm4_moe_with_mtp(tmp_path_factory.mktemp("glm4_moe_mtp_actor"))
    rollout = make_rollout(num_samples=8, seed=6)
    rollout["loss_masks"][3][1] = 0
    out = tmp_path_factory.mktemp("actor_out")
    flags = ("--enable-mtp-training", "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", str(SCALE))
    (result,) = run_in_processes(_actor_worker, world_size=1, args=(str(path), str(out), rollout, flags))
    return result, reference(path, full, rollout)[1], load_file(str(path / "model.safetensors")), out


def hf_folder(folder: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for file in folder.glob("*.safetensors"):
        weights.update(load_file(str(file)))
    return weights


def test_the_actor_trains_the_mtp_layer_logs_its_loss_and_exports_it(actor_run):
    result, loss, loaded, out = actor_run
    metrics = result["metrics"]
    assert abs(metrics["train/mtp_loss"] - loss.item()) <= 1e-5, (metrics["train/mtp_loss"], loss.item())
    assert metrics["train/ppo_kl"] == 0.0  # the main model's log-probs are unchanged by the MTP block
    # The CPU engine has no draft model: pushes leave the MTP layer out; the HF export keeps it, trained.
    assert result["pushed"] and not any(name.startswith(MTP) for name in result["pushed"])
    exported = hf_folder(out / "hf")
    assert {name for name in loaded if name.startswith(MTP)} <= set(exported)
    assert not torch.equal(exported[f"{MTP}eh_proj.weight"], loaded[f"{MTP}eh_proj.weight"])
    # --save keeps the trained MTP layer: --load resumes from it, bit for bit.
    resumed = hf_folder(out / "resumed_hf")
    assert resumed.keys() == exported.keys()
    assert all(torch.equal(resumed[name], exported[name]) for name in exported)
