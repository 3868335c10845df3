"""The FSDP trainer on a vision-language model (a tiny random Qwen2.5-VL) against the real CPU engine.

One rollout is generated through the default rollout's `generate` (images read by the dataset, sent as `image_data`
with the expanded prompt); the trainer's log-probs of those samples must equal the engine's within 1e-4 in both
micro-batch layouts, and an HF forward of each sample on its own (the model computing its own M-RoPE) checks the
trainer independently. Two of the prompts have the same text and same-sized images, so only their pixels differ.
The vision tower stays frozen unless --train-vision-tower, and a trained one reaches the engine with the weights.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from support.engines import cpu_engine_process
from support.fsdp import make_args, new_actor
from support.tiny_vlm import make_image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from slime.backends.fsdp_utils.model import gather_full_state_dict
from slime.ray.rollout import samples_to_train_data, split_train_data_by_dp
from slime.rollout import sglang_rollout
from slime.utils.data import Dataset

IMAGES = [make_image(56, 56, seed=1), make_image(84, 56, seed=2), make_image(56, 56, seed=3)]
PROMPTS = ["<image>How many sides?", "What is shown? <image>", "<image>How many sides?"]
MULTIMODAL = ("--multimodal-keys", '{"image": "images"}')


pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


def rollout_args(tiny_vlm_dir, url: str, *extra: str):
    args = make_args(tiny_vlm_dir, *MULTIMODAL, "--lr", "3e-2", *extra, num_samples=6)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    args.sglang_router_ip, args.sglang_router_port = host, int(port)
    return args


def generate_samples(args, tokenizer) -> list:
    """Two samples per prompt from the engine behind `args`' router address, through the default `generate`."""
    records = [{"prompt": p, "images": [image]} for p, image in zip(PROMPTS, IMAGES)]
    dataset = Dataset(
        records, tokenizer, input_key="prompt", multimodal_keys={"image": "images"}, apply_chat_template=True
    )
    samples = []
    for group, prompt in enumerate(dataset.samples):
        for k in range(2):
            sample = copy.deepcopy(prompt)
            sample.index, sample.group_index, sample.reward = len(samples), group, float(k)
            samples.append(sample)
    sglang_rollout._STATE = None  # a fresh rollout state for these args
    params = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 3}

    async def all_samples():
        return await asyncio.gather(*(sglang_rollout.generate(args, s, dict(params)) for s in samples))

    samples = asyncio.run(all_samples())
    sglang_rollout._STATE = None
    return samples


def train_data(args, samples) -> dict:
    return split_train_data_by_dp(args, samples_to_train_data(args, samples), 1)[0]


@pytest.fixture(scope="module")
def rollout(tiny_vlm_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_dir)
    with cpu_engine_process(tiny_vlm_dir) as (_, url):
        args = rollout_args(tiny_vlm_dir, url)
        return args, generate_samples(args, tokenizer)


@torch.no_grad()
def hf_log_probs(model, processor, sample) -> torch.Tensor:
    """One HF forward of the sample alone, the model computing its own M-RoPE from mm_token_type_ids and the grid."""
    processed = processor(images=sample.multimodal_inputs["images"], return_tensors="pt")
    ids = torch.tensor([sample.tokens])
    logits = model(
        input_ids=ids,
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
        pixel_values=processed["pixel_values"],
        image_grid_thw=processed["image_grid_thw"],
    ).logits[0, -sample.response_length - 1 : -1]
    return logits.log_softmax(-1).gather(-1, ids[0, -sample.response_length :, None])[:, 0]


def test_rollout_sends_expanded_prompts_and_the_trainer_inputs(tiny_vlm_dir, rollout):
    _, samples = rollout
    processor = AutoImageProcessor.from_pretrained(tiny_vlm_dir)
    image_id = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).config.image_token_id
    for sample in samples:
        grid = processor(images=sample.multimodal_inputs["images"], return_tensors="pt")["image_grid_thw"]
        assert sample.tokens.count(image_id) == int(grid.prod(-1).sum()) // 4 > 1
        torch.testing.assert_close(sample.multimodal_train_inputs["image_grid_thw"], grid)
        assert sample.response_length == 6 and len(sample.rollout_log_probs) == 6


@pytest.mark.parametrize("layout", ["sdpa", "flash_attention_2"], ids=["shared-prompt-rows", "one-packed-row"])
def test_trainer_log_probs_equal_the_engines(tiny_vlm_dir, rollout, layout):
    args, samples = rollout
    args = copy.copy(args)
    args.micro_batch_size = len(samples)  # one micro-batch: prompts 0 and 2 (same tokens, other pixels) side by side
    actor = new_actor(args)
    # The layout follows the attention kernel's name; sdpa computes both (HF reads packed rows from position_ids).
    actor.attn_implementation = layout
    data = actor._prepare(train_data(args, samples))
    log_probs = actor._forward_log_probs(actor._micro_batches(data), len(samples))
    gap = max((ours - torch.tensor(s.rollout_log_probs)).abs().max().item() for ours, s in zip(log_probs, samples))
    assert gap <= 1e-4, gap
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(tiny_vlm_dir)
    for ours, sample in zip(log_probs, samples):
        torch.testing.assert_close(ours, hf_log_probs(model, processor, sample), atol=1e-4, rtol=0)
    # Prompts 0 and 2 share their text and image size: their pixels alone make their log-probs differ.
    assert samples[0].tokens[: samples[0].prompt_length] == samples[4].tokens[: samples[4].prompt_length]
    other_image = copy.deepcopy(samples[0])
    other_image.multimodal_inputs = samples[4].multimodal_inputs
    assert not torch.allclose(log_probs[0], hf_log_probs(model, processor, other_image), atol=1e-3)


def vision_weights(actor) -> dict[str, torch.Tensor]:
    return {n: t for n, t in gather_full_state_dict(actor.model).items() if ".visual." in f".{n}"}


def test_vision_tower_is_frozen_by_default(rollout):
    args, samples = rollout
    actor = new_actor(args)
    before = vision_weights(actor)
    language_before = gather_full_state_dict(actor.model)["lm_head.weight"]
    actor.train(0, train_data(args, samples))
    after = vision_weights(actor)
    assert before and all(torch.equal(before[n], after[n]) for n in before)
    assert not torch.equal(language_before, gather_full_state_dict(actor.model)["lm_head.weight"])


def test_trained_vision_tower_reaches_the_engine(tiny_vlm_dir, rollout):
    """--train-vision-tower moves the vision tower; after the push the engine scores the rollout as the trainer."""
    _, samples = rollout
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_dir)
    with cpu_engine_process(tiny_vlm_dir) as (client, url):
        args = rollout_args(tiny_vlm_dir, url, "--train-vision-tower", "--colocate")
        actor = new_actor(args)
        before = vision_weights(actor)
        actor.train(0, train_data(args, samples))
        after = vision_weights(actor)
        assert all(not torch.equal(before[n], after[n]) for n in before if n.endswith("qkv.weight"))
        actor.connect_rollout_engines([client], [url])
        assert rollout_gap(actor, args, generate_samples(args, tokenizer)) > 1e-3  # the step changed the policy
        actor.update_weights()
        fresh = generate_samples(args, tokenizer)
    assert rollout_gap(actor, args, fresh) <= 1e-4


def rollout_gap(actor, args, samples) -> float:
    """The largest difference between the engine's log-probs of `samples` and the trainer's."""
    data = actor._prepare(train_data(args, samples))
    log_probs = actor._forward_log_probs(actor._micro_batches(data), len(samples))
    return max((ours - torch.tensor(s.rollout_log_probs)).abs().max().item() for ours, s in zip(log_probs, samples))
