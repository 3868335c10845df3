"""FP8 rollout: the trainer keeps float32 weights, the CPU engines run block FP8, every push is quantized.

Real CPU engine server processes (one plain, one with `--quantization fp8`) take broadcast pushes from a
`WeightUpdater` in this process (a one-rank gloo group). The expected values come from plain HF models: the
trainer's weights, and the same weights rounded through FP8 here block by block. Reported: the largest gap between
the engine's and the trainer's probe log-probs with and without FP8.

Bound on the FP8 gap: a log-prob is `z_i - logsumexp(z)`, and `logsumexp` moves by at most max|dz|, so the
log-probs of weights rounded through FP8 differ from the trainer's by at most 2 max|dz| over the probe's logits.
"""

from __future__ import annotations

import datetime
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch
import torch.distributed as dist
from support.engines import cpu_engine_process, engine_prompt_log_probs, engine_server
from support.tiny_model import build_tiny_model
from transformers import AutoModelForCausalLM

from slime.backends.sglang_utils.http_client import EngineClient
from slime.backends.weight_sync import WeightUpdater, choose_transport
from slime.utils.weight_sync import bucket_named_tensors

PROBE = [5, 17, 42, 99, 123, 7, 250, 31, 64, 12, 200, 3, 77, 150, 9, 301]
BLOCK = 128


@pytest.fixture(scope="module")
def model_128(tmp_path_factory):
    """A tiny Llama 128 wide: its Linear weights hold whole 128 x 128 blocks and ragged ones (k/v: 64 rows)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_128"), hidden_size=128)


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """The default process group a trainer rank has (the updater's barriers run in it), for this module only."""
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    yield
    dist.destroy_process_group()


def through_fp8(w: torch.Tensor) -> torch.Tensor:
    """`w` rounded through e4m3 with one scale (amax / 448) per 128 x 128 block, by a loop over the blocks."""
    out = torch.empty_like(w)
    for i in range(0, w.shape[0], BLOCK):
        for j in range(0, w.shape[1], BLOCK):
            tile = w[i : i + BLOCK, j : j + BLOCK]
            scale = tile.abs().max() / 448
            out[i : i + BLOCK, j : j + BLOCK] = (tile / scale).to(torch.float8_e4m3fn).float() * scale
    return out


def rounded(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state as an FP8 engine holds it: the decoder layers' 2-D projection weights rounded."""
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {
        name: through_fp8(t) if any(f".{leaf}.weight" in name for leaf in linear) else t for name, t in state.items()
    }


def logits(model_dir, state: dict[str, torch.Tensor]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(input_ids=torch.tensor([PROBE])).logits[0, :-1].float()


def log_probs(z: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(z, -1).gather(-1, torch.tensor(PROBE[1:]).unsqueeze(-1)).squeeze(-1)


def push(
    state: dict[str, torch.Tensor],
    model_dir,
    engines: list,
    urls: list[str],
    quantization: str | None,
    bucket_bytes: int = 64_000,
) -> None:
    """One broadcast push of `state` in buckets of `bucket_bytes`, as a trainer rank makes it."""
    args = Namespace(
        colocate=False,
        rollout_num_gpus_per_engine=1,
        rollout_backend="cpu",
        update_weight_transport="nccl",
        hf_checkpoint=str(model_dir),
        sglang_server_args={"quantization": quantization} if quantization else {},
    )
    updater = WeightUpdater(rank=0)
    updater.connect(choose_transport(args, torch.device("cpu")), engines, urls)
    assert updater.transport.fp8_block == ((BLOCK, BLOCK) if quantization else None)
    try:
        updater.push(bucket_named_tensors(state.items(), bucket_bytes))
    finally:
        updater.close()


def gap(client, expected: torch.Tensor) -> float:
    return float((engine_prompt_log_probs(client, PROBE) - expected).abs().max())


def test_fp8_rollout_gap_against_the_trainer(model_128, one_rank_group):
    base = AutoModelForCausalLM.from_pretrained(model_128, dtype=torch.float32).state_dict()
    generator = torch.Generator().manual_seed(0)
    # the weights after some training: every tensor moved
    trainer = {name: t + 0.05 * t.std() * torch.randn(t.shape, generator=generator) for name, t in base.items()}
    trainer_z, fp8_z = logits(model_128, trainer), logits(model_128, rounded(trainer))
    trainer_lp, fp8_lp = log_probs(trainer_z), log_probs(fp8_z)
    bound = 2 * float((fp8_z - trainer_z).abs().max())

    with (
        cpu_engine_process(model_128) as (plain, plain_url),
        cpu_engine_process(model_128, "--quantization", "fp8") as (quantized, quantized_url),
    ):
        # --quantization fp8 rounds the fp32 checkpoint on load
        assert gap(quantized, log_probs(logits(model_128, rounded(base)))) <= 1e-4

        # FP8 pushes: the plain engine gets FP8 weights + scales too (only its dequantization makes it match)
        push(trainer, model_128, [plain, quantized], [plain_url, quantized_url], "fp8")
        assert gap(plain, fp8_lp) <= 1e-4 and gap(quantized, fp8_lp) <= 1e-4
        fp8_gap = gap(quantized, trainer_lp)

        # the trainer's own precision: float32 end to end
        push(trainer, model_128, [plain], [plain_url], None)
        fp32_gap = gap(plain, trainer_lp)

    print(f"\nengine-vs-trainer probe log-prob gap: fp32 {fp32_gap:.3g}, fp8 {fp8_gap:.3g} (bound {bound:.3g})")
    assert fp32_gap <= 1e-4
    assert 0 < fp8_gap <= bound + 1e-4


def test_bf16_engine_computes_as_hf_does_in_bf16_on_the_pushed_weights(model_128, one_rank_group):
    """`--sglang-dtype bfloat16` (the engine's `--dtype bfloat16`): a push of the float32 trainer's weights lands
    rounded to bfloat16, and the engine's log-probs are those of HF's model run in bfloat16 on them."""
    base = AutoModelForCausalLM.from_pretrained(model_128, dtype=torch.float32).state_dict()
    generator = torch.Generator().manual_seed(1)
    trainer = {name: t + 0.05 * t.std() * torch.randn(t.shape, generator=generator) for name, t in base.items()}
    trainer_z = logits(model_128, trainer)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(model_128, dtype=torch.bfloat16).eval()
    hf_bf16.load_state_dict(trainer)  # rounds each tensor to bfloat16
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine's thread count: a bf16 matmul's rounding can depend on it
    try:
        with torch.no_grad():
            bf16_z = hf_bf16(input_ids=torch.tensor([PROBE])).logits[0, :-1].float()
    finally:
        torch.set_num_threads(threads)
    bound = 2 * float((bf16_z - trainer_z).abs().max())

    with cpu_engine_process(model_128, "--dtype", "bfloat16") as (engine, url):
        push(trainer, model_128, [engine], [url], None)
        own_gap = gap(engine, log_probs(bf16_z))
        bf16_gap = gap(engine, log_probs(trainer_z))

    print(f"\nbf16 engine: gap to HF in bf16 {own_gap:.3g}, to the fp32 trainer {bf16_gap:.3g} (bound {bound:.3g})")
    assert own_gap <= 1e-4
    assert 0 < bf16_gap <= bound + 1e-4


def test_pushes_and_generation_leave_no_second_copy_of_the_weights_resident(tmp_path, one_rank_group):
    """A broadcast push receives every tensor into a buffer of its own before any parameter is written (all or
    nothing), and decoding grows KV caches step by step: glibc keeps the pages of both once freed, and without
    handing them back the engine held about another copy of the weights for the rest of the run."""
    model_dir = build_tiny_model(tmp_path / "m", hidden_size=512, num_layers=8, num_heads=8)  # 65 MiB of weights
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    weight_mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    params = {"max_new_tokens": 16, "ignore_eos": True}
    prompts = [PROBE[: 4 + i % 8] for i in range(16)]
    with engine_server(model_dir) as (process, url), ThreadPoolExecutor(16) as pool:
        engine = EngineClient(url)
        before = psutil.Process(process.pid).memory_info().rss / 2**20
        for _ in range(2):
            push(state, model_dir, [engine], [url], None, bucket_bytes=32 * 2**20)
            done = list(pool.map(lambda ids: engine.generate({"input_ids": ids, "sampling_params": params}), prompts))
            assert [d["meta_info"]["completion_tokens"] for d in done] == [16] * 16
        grown = psutil.Process(process.pid).memory_info().rss / 2**20 - before
    print(f"\nengine RSS grew {grown:.1f} MiB over 2 pushes and generations ({weight_mib:.1f} MiB of weights)")
    assert grown < 0.5 * weight_mib
