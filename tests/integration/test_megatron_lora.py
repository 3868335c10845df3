"""LoRA on megatron-core (slime/backends/megatron_utils/lora.py) computes and trains what peft does on the HF model.

Every expected value comes from peft on the HF model in the pytest process; Megatron runs in one spawn of 2 gloo
workers (tests/support/megatron_cpu.py) that covers TP=1 (DP=2), TP=2 and PP=2. The model has 4 heads over 2 KV
heads (q/k/v of different sizes) and non-zero q/k/v biases, so a misplaced row in the fused QKV layout shows.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from support.megatron_cpu import requires_megatron_core, run_in_processes
from support.megatron_models import tiny_qwen2
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from slime.backends.megatron_utils.lora import adapter_config
from slime.utils.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

pytestmark = requires_megatron_core

TOLERANCE = 1e-5
RANK, ALPHA, LR, STEPS = 4, 8.0, 1e-2, 3
VOCAB = 300
# name -> (--target-modules, --exclude-modules)
CASES = {
    "all": (["all-linear"], None),
    "qv": (["q_proj", "v_proj"], None),
    "exclude": (["all-linear"], ["o_proj", "model.layers.1.mlp.down_proj"]),
}
ADAPTER_PREFIX = "base_model.model."


def peft_model(path: str, case: str, seed: int = 0):
    """The HF model with peft's LoRA for `case`, its adapter set to random non-zero values (B included)."""
    targets, exclude = CASES[case]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", exclude_modules=exclude,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
    )  # fmt: skip
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(model).items()}


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------------------------
# Megatron side (spawned workers)
# ----------------------------------------------------------------------------------------------


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits (TP-gathered, padding dropped), with autograd."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return gather_from_tensor_model_parallel_region(model(tokens, positions, None))[..., :VOCAB]


def _build(path: str, sizes: dict, load: bool = True):
    from slime.backends.megatron_utils.config import config_from_hf
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights
    from slime.backends.megatron_utils.model import build_model

    args = config_from_hf(path)
    vars(args).update(sizes)
    model = build_model(args, wrap_with_ddp=False)
    if load:
        load_hf_weights(model, path)
    return args, model


def _error(fn, *args) -> str:
    try:
        fn(*args)
    except ValueError as error:
        return str(error)
    return "no error"


def _train(path: str, sizes: dict, tokens: torch.Tensor, initial: dict) -> dict:
    """STEPS AdamW steps through Megatron's DDP, finalize_model_grads and optimizer, as the actor drives them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from slime.backends.megatron_utils.lora import adapter_state_to_hf, apply_lora, load_adapter_from_hf
    from slime.backends.megatron_utils.model import build_optimizer, unwrap_model

    args, model = _build(path, sizes)
    apply_lora(model, RANK, ALPHA, 0.0, ["all-linear"], None)
    load_adapter_from_hf(model, initial)
    config = unwrap_model(model[0]).config
    model = [DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=model[0])]
    # A huge clip threshold: the optimizer reports the grad norm but never scales.
    vars(args).update(lr=LR, weight_decay=0.0, clip_grad=1e9, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)
    optimizer = build_optimizer(args, model)
    model[0].train()
    losses, norms = [], []
    for _ in range(STEPS):
        model[0].zero_grad_buffer()
        optimizer.zero_grad()
        loss = next_token_loss(_logits(model[0], tokens), tokens)
        loss.backward()
        finalize_model_grads(model)
        success, grad_norm, _ = optimizer.step()
        assert success
        losses.append(loss.item())
        norms.append(grad_norm)
    model[0].eval()
    with torch.no_grad():
        logits = _logits(model[0], tokens)
    trainable = sorted(n for n, p in model[0].named_parameters() if p.requires_grad)
    adapter = dict(adapter_state_to_hf(model))
    return {"losses": losses, "norms": norms, "adapter": adapter, "trainable": trainable, "logits": logits}


def _worker(rank: int, world_size: int, paths: dict, tokens: torch.Tensor, adapters: dict) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from slime.backends.megatron_utils.lora import (
        adapter_state_to_hf,
        apply_lora,
        disable_adapters,
        load_adapter_from_hf,
    )
    from slime.backends.megatron_utils.model import initialize_model_parallel, unwrap_model

    results: dict = {"logits": {}, "base": {}, "init": {}, "export": {}, "train": {}, "errors": {}}
    for layout, sizes in [("tp1", dict(tensor_model_parallel_size=1)), ("tp2", dict(tensor_model_parallel_size=2))]:
        initialize_model_parallel(**sizes)
        for case, (targets, exclude) in CASES.items():
            _, model = _build(paths["dense"], sizes)
            apply_lora(model, RANK, ALPHA, 0.0, targets, exclude, seed=7)
            model[0].eval()
            if case == "all":
                with torch.no_grad():
                    results["init"][layout] = (_logits(model[0], tokens), dict(adapter_state_to_hf(model)))
            load_adapter_from_hf(model, adapters[case])
            with torch.no_grad():
                results["logits"][(layout, case)] = _logits(model[0], tokens)
                with disable_adapters(model):
                    results["base"][(layout, case)] = _logits(model[0], tokens)
            results["export"][(layout, case)] = dict(adapter_state_to_hf(model))
            if case == "qv":
                # linear_qkv's own output: the adapter moves the q and v rows of each query group, never k's.
                gpt = unwrap_model(model[0])
                linear = gpt.decoder.layers[0].self_attention.linear_qkv
                x = torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(1))
                with torch.no_grad():
                    on = linear(x)[0]
                    with disable_adapters(model):
                        off = linear(x)[0]
                groups, d = 2 // sizes["tensor_model_parallel_size"], gpt.config.kv_channels
                q, k, v = (on - off).view(3, 1, groups, -1, d).split([2, 1, 1], dim=3)
                results.setdefault("qkv_delta", {})[layout] = (q.abs().max(), k.abs().max(), v.abs().max())
        # TP=1: each data-parallel rank trains on its own sequence (DDP averages); TP=2: both see the whole batch.
        batch = tokens[rank : rank + 1] if layout == "tp1" else tokens
        results["train"][layout] = _train(paths["dense"], sizes, batch, adapters["all"])

        if layout == "tp2":
            # megatron-core's local (CPU) norms refuse to build with sequence parallelism: switch it on afterwards.
            _, model = _build(paths["dense"], sizes, load=False)
            unwrap_model(model[0]).config.sequence_parallel = True
            results["errors"]["sp"] = _error(apply_lora, model, RANK, ALPHA, 0.0, ["all-linear"], None)

    initialize_model_parallel(tensor_model_parallel_size=1)
    _, model = _build(paths["dense"], {}, load=False)
    results["errors"]["unknown"] = _error(apply_lora, model, RANK, ALPHA, 0.0, ["q_proj", "qkv_proj"], None)
    results["errors"]["nothing_left"] = _error(apply_lora, model, RANK, ALPHA, 0.0, ["o_proj"], ["o_proj"])
    apply_lora(model, RANK, ALPHA, 0.0, ["q_proj"], None)
    results["errors"]["twice"] = _error(apply_lora, model, RANK, ALPHA, 0.0, ["q_proj"], None)
    ddp = [DistributedDataParallel(unwrap_model(model[0]).config, DistributedDataParallelConfig(), module=model[0])]
    results["errors"]["ddp"] = _error(apply_lora, ddp, RANK, ALPHA, 0.0, ["v_proj"], None)
    _, moe = _build(paths["moe"], {}, load=False)
    results["errors"]["moe"] = _error(apply_lora, moe, RANK, ALPHA, 0.0, ["all-linear"], None)
    _, moe = _build(paths["moe"], {}, load=False)
    results["moe_attention"] = apply_lora(moe, RANK, ALPHA, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"], None)

    # Pipeline parallel: each stage adapts and exports its own layer, under its global number.
    initialize_model_parallel(pipeline_model_parallel_size=2)
    _, model = _build(paths["dense"], dict(pipeline_model_parallel_size=2), load=False)
    apply_lora(model, RANK, ALPHA, 0.0, ["all-linear"], None, seed=7)
    results["pp2_export"] = dict(adapter_state_to_hf(model))
    return results


# ----------------------------------------------------------------------------------------------
# peft side (pytest process) and the comparisons
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lora")
    path = tiny_qwen2(root / "qwen2", VOCAB)
    moe_config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    moe_config.save_pretrained(root / "moe")  # the Megatron model is built from the config alone
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))

    reference: dict = {"logits": {}, "adapters": {}}
    with torch.no_grad():
        reference["hf_base"] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(tokens).logits
    for case in CASES:
        model = peft_model(path, case)
        reference["adapters"][case] = adapter_tensors(model)
        with torch.no_grad():
            reference["logits"][case] = model(tokens).logits

    # Training reference: peft's model, torch AdamW on the adapter only, the same batch.
    model = peft_model(path, "all")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses, norms = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = next_token_loss(model(tokens).logits, tokens)
        loss.backward()
        norms.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in params)).item())
        optimizer.step()
        losses.append(loss.item())
    reference["train"] = {"losses": losses, "norms": norms, "adapter": adapter_tensors(model)}
    model.eval()
    with torch.no_grad():
        reference["trained_logits"] = model(tokens).logits

    paths = {"dense": path, "moe": str(root / "moe")}
    results = run_in_processes(_worker, world_size=2, args=(paths, tokens, reference["adapters"]))
    return path, tokens, reference, results, root


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_peft(runs, layout, case):
    _, _, reference, results, _ = runs
    expected = reference["logits"][case]
    # The adapter moves the logits far beyond the tolerance, so equality means something.
    assert _max_diff(expected, reference["hf_base"]) > 0.1
    for rank, result in enumerate(results):
        diff = _max_diff(result["logits"][(layout, case)], expected)
        print(f"{layout} {case} rank{rank}: max |megatron+lora - peft| = {diff:.2e}")
        assert diff <= TOLERANCE
        # disable_adapters: the base model, as HF computes it without an adapter.
        base_diff = _max_diff(result["base"][(layout, case)], reference["hf_base"])
        print(f"{layout} {case} rank{rank}: adapters disabled, max |megatron - hf base| = {base_diff:.2e}")
        assert base_diff <= TOLERANCE
        # Targets and excludes select exactly peft's modules, and each rank's shards reassemble to peft's tensors.
        exported = result["export"][(layout, case)]
        assert exported.keys() == reference["adapters"][case].keys()
        for name, tensor in exported.items():
            assert torch.equal(tensor, reference["adapters"][case][name]), name


def test_target_modules_and_exclude_select_peft_modules(runs):
    _, _, reference, results, _ = runs
    qv = reference["adapters"]["qv"].keys()
    assert {name.split(".")[-3] for name in qv} == {"q_proj", "v_proj"}
    excluded = reference["adapters"]["exclude"].keys()
    assert not any(".o_proj." in name for name in excluded)
    assert any("layers.0.mlp.down_proj" in name for name in excluded)
    assert not any("layers.1.mlp.down_proj" in name for name in excluded)
    for result in results:
        for layout, (q, k, v) in result["qkv_delta"].items():
            assert q > 0.01 and v > 0.01, layout
            assert k == 0, f"{layout}: k rows of linear_qkv changed without a k_proj adapter"


def test_new_adapter_starts_as_the_base_with_peft_init_on_every_layout(runs):
    _, _, reference, results, _ = runs
    tp1 = results[0]["init"]["tp1"][1]
    assert len(tp1) == 2 * 7 * 2  # layers x projections x (A, B)
    for name, tensor in tp1.items():
        if ".lora_B." in name:
            assert not tensor.any(), name
        else:
            bound = tensor.shape[1] ** -0.5  # kaiming-uniform with a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
            assert 0.8 * bound < tensor.abs().max() <= bound, name
    # The same seed gives the same adapter on every rank and every parallel layout.
    pp2 = {**results[0]["pp2_export"], **results[1]["pp2_export"]}
    assert all(".layers.0." in n for n in results[0]["pp2_export"])
    assert all(".layers.1." in n for n in results[1]["pp2_export"])
    for result in results:
        for layout in ("tp1", "tp2"):
            logits, exported = result["init"][layout]
            assert _max_diff(logits, reference["hf_base"]) <= TOLERANCE
            assert exported.keys() == tp1.keys() == pp2.keys()
            for name in tp1:
                assert torch.equal(exported[name], tp1[name]) and torch.equal(pp2[name], tp1[name]), name


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_training_matches_peft_and_export_loads_into_peft(runs, layout, tmp_path):
    path, tokens, reference, results, _ = runs
    expected = reference["train"]
    trained = [result["train"][layout] for result in results]
    # TP=1 runs DP=2 with one sequence per rank: the batch loss is the mean of the two (equal lengths).
    losses = [sum(run["losses"][step] for run in trained) / 2 for step in range(STEPS)]
    loss_diff = max(abs(a - b) for a, b in zip(losses, expected["losses"], strict=True))
    print(f"{layout}: losses {losses} vs peft {expected['losses']}: max diff {loss_diff:.2e}")
    assert loss_diff <= TOLERANCE
    assert expected["losses"][-1] < expected["losses"][0]
    for run in trained:
        # Megatron's grad norm counts each TP shard once and each replicated factor once.
        for norm, peft_norm in zip(run["norms"], expected["norms"], strict=True):
            assert abs(norm - peft_norm) <= TOLERANCE * max(1.0, peft_norm), (run["norms"], expected["norms"])
        assert all(".lora." in name for name in run["trainable"]) and len(run["trainable"]) == 2 * 7 * 2
        assert run["adapter"].keys() == expected["adapter"].keys()
        diff = max(_max_diff(run["adapter"][n], expected["adapter"][n]) for n in expected["adapter"])
        print(f"{layout}: max |adapter after {STEPS} steps - peft's| = {diff:.2e}")
        assert diff <= TOLERANCE
    # The exported adapter is a PEFT adapter folder: peft computes with it what Megatron does (on the TP=2 batch).
    save_file(trained[0]["adapter"], str(tmp_path / ADAPTER_WEIGHTS_FILE))
    config = adapter_config(RANK, ALPHA, 0.0, ["all-linear"], base_model_name_or_path=path)
    (tmp_path / ADAPTER_CONFIG_FILE).write_text(json.dumps(config))
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path)).eval()
    with torch.no_grad():
        logits = loaded(tokens).logits
    megatron_logits = torch.cat([run["logits"] for run in trained]) if layout == "tp1" else trained[0]["logits"]
    diff = _max_diff(logits, megatron_logits)
    print(f"{layout}: exported adapter in peft vs Megatron after training: max logit diff {diff:.2e}")
    assert diff <= TOLERANCE
    # ... and what peft's own training reached (the adapters differ by Adam's rounding, amplified by large logits).
    assert _max_diff(logits, reference["trained_logits"]) <= 5 * TOLERANCE


def test_refusals_name_the_flag_or_layer_kind(runs):
    _, _, _, results, _ = runs
    errors = results[0]["errors"]
    assert "--target-modules" in errors["unknown"] and "qkv_proj" in errors["unknown"]
    assert "--target-modules" in errors["nothing_left"]
    assert "--sequence-parallel" in errors["sp"]
    assert "already has LoRA" in errors["twice"]
    assert "DistributedDataParallel" in errors["ddp"]
    assert "MoE" in errors["moe"] and "--target-modules q_proj k_proj v_proj o_proj" in errors["moe"]
    assert results[0]["moe_attention"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
