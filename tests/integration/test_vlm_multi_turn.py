"""Multi-turn vision-language samples: an image that arrives in a tool turn, on a tiny random Qwen2.5-VL served by
one real CPU engine process for the module.

A custom-generate-style loop (`slime.agent.multi_turn`) and the trajectory proxy (driven by the real `openai` and
`anthropic` clients) both put a second image in the response. Expected tokens are written here from the tiny template's text; the
trainer's log-probs (both micro-batch layouts) must equal the engine's within 1e-4, and an HF forward of each sample
alone, the model placing its own M-RoPE over all its images, checks the trainer independently.
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import openai
import pytest
import torch
from support.engines import cpu_engine_process
from support.fsdp import make_args, new_actor
from support.tiny_vlm import make_image, png_base64
from support.vlm_reference import hf_log_probs
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from slime.agent.multi_turn import Episode, append_messages, append_observation, model_turn, start_episode
from slime.agent.trajectory_proxy import TrajectoryProxy, session_to_sample
from slime.ray.rollout import samples_to_train_data, split_train_data_by_dp
from slime.utils.data import load_vision_prompter
from slime.utils.types import Sample, Status

PROMPT_IMAGE = make_image(56, 56, seed=1)
# 84x56 pixels is a 6x4 patch grid: 6 visual tokens; 56x56 is 4.
TOOL_IMAGES = [
    make_image(84, 56, seed=5),
    make_image(56, 56, seed=6),
    make_image(56, 56, seed=7),
    make_image(84, 56, seed=8),
]
VISUAL_TOKENS = {(56, 56): 4, (84, 56): 6}
PARAMS = {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True}


pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


@pytest.fixture(scope="module")
def engine(tiny_vlm_dir):
    with cpu_engine_process(tiny_vlm_dir) as (_, url):
        yield url


@pytest.fixture(scope="module")
def tokenizer(tiny_vlm_dir):
    return AutoTokenizer.from_pretrained(tiny_vlm_dir)


def data_url(image) -> str:
    return "data:image/png;base64," + png_base64(image)


def pads(image) -> str:
    return "<|vision_start|>" + "<|image_pad|>" * VISUAL_TOKENS[image.size] + "<|vision_end|>"


def tool_message(image) -> dict:
    return {"role": "tool", "content": [{"type": "text", "text": "zoomed:"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]}  # fmt: skip


def prompt_sample(index: int, with_image: bool) -> Sample:
    if with_image:
        content = [{"type": "image"}, {"type": "text", "text": "How many sides?"}]
        return Sample(index=index, group_index=0, prompt=[{"role": "user", "content": content}],
                      multimodal_inputs={"images": [PROMPT_IMAGE]}, reward=float(index % 2))  # fmt: skip
    content = "Look at the tool's picture."
    return Sample(index=index, group_index=1, prompt=[{"role": "user", "content": content}], reward=float(index % 2))


def rollout_args(tiny_vlm_dir, url: str):
    args = make_args(tiny_vlm_dir, "--max-turns", "2", "--lr", "3e-2", num_samples=4)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    args.sglang_router_ip, args.sglang_router_port = host, int(port)
    return args


async def two_turns(args, sample: Sample, tool_image) -> Sample:
    """A model turn, a tool turn whose answer is an image, a second model turn: what a custom generate does."""
    episode = start_episode(args, sample)
    await model_turn(args, episode, dict(PARAMS, sampling_seed=sample.index))
    assert append_messages(episode, [tool_message(tool_image)])
    await model_turn(args, episode, dict(PARAMS, sampling_seed=10 + sample.index))
    return sample


@pytest.fixture(scope="module")
def rollout(tiny_vlm_dir, engine):
    """Two samples of a prompt with an image and two of a text-only prompt, each with its own tool image."""
    args = rollout_args(tiny_vlm_dir, engine)
    samples = [prompt_sample(i, with_image=i < 2) for i in range(4)]

    async def run():
        return await asyncio.gather(*(two_turns(args, s, image) for s, image in zip(samples, TOOL_IMAGES)))

    return args, asyncio.run(run())


def expected_prompt(tokenizer, sample: Sample) -> list[int]:
    text = "<|im_start|>user\n" + (pads(PROMPT_IMAGE) + "How many sides?" if sample.multimodal_inputs and sample.index < 2 else "Look at the tool's picture.")  # fmt: skip
    return tokenizer.encode(text + "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def same_pixels(a, b) -> bool:
    return a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b))


def test_tool_image_joins_the_sample_in_token_order(tokenizer, rollout):
    _, samples = rollout
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for sample, tool_image in zip(samples, TOOL_IMAGES):
        prompt = expected_prompt(tokenizer, sample)
        turn1 = sample.tokens[len(prompt) : len(prompt) + 4]
        context = tokenizer.encode(
            "<|im_end|>\n<|im_start|>tool\nzoomed:" + pads(tool_image) + "<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )
        if turn1[-1] == im_end:  # the model sampled the turn's end itself
            context = context[1:]
        assert sample.tokens[: len(prompt)] == prompt and sample.prompt_length == len(prompt)
        assert sample.tokens[len(prompt) + 4 : -4] == context
        assert sample.loss_mask == [1] * 4 + [0] * len(context) + [1] * 4
        assert sample.rollout_log_probs[4:-4] == [0.0] * len(context)
        assert sample.status == Status.TRUNCATED and len(sample.weight_versions) == 2
        images = sample.multimodal_inputs["images"]
        expected_images = [PROMPT_IMAGE, tool_image] if sample.index < 2 else [tool_image]
        assert len(images) == len(expected_images) and all(map(same_pixels, images, expected_images))
        grid = sample.multimodal_train_inputs["image_grid_thw"]
        assert (grid.prod(-1) // 4).tolist() == [VISUAL_TOKENS[image.size] for image in expected_images]
        assert sample.multimodal_train_inputs["pixel_values"].shape[0] == int(grid.prod(-1).sum())


def test_an_observation_image_that_does_not_fit_whole_is_left_out(tiny_vlm_dir, tokenizer):
    vision = load_vision_prompter(str(tiny_vlm_dir))
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    text = "a:<|vision_start|><|image_pad|><|vision_end|> b:<|vision_start|><|image_pad|><|vision_end|>"
    first_image = tokenizer.encode("a:" + pads(TOOL_IMAGES[1]) + " b:<|vision_start|>", add_special_tokens=False)
    # Room for the first image and two tokens of the second one's four.
    sample = Sample(index=0, tokens=list(prompt), loss_mask=[], rollout_log_probs=[])
    episode = Episode(sample, tokenizer, len(prompt) + len(first_image) + 2, max_turns=2, vision=vision)
    assert not append_observation(episode, text, images=[TOOL_IMAGES[1], TOOL_IMAGES[2]])
    assert sample.tokens == prompt + first_image and sample.loss_mask == [0] * len(first_image)
    assert sample.status == Status.TRUNCATED and len(sample.multimodal_inputs["images"]) == 1
    assert same_pixels(sample.multimodal_inputs["images"][0], TOOL_IMAGES[1])
    assert sample.multimodal_train_inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert sample.multimodal_train_inputs["pixel_values"].shape[0] == 16
    with pytest.raises(ValueError, match="the observation does not place its images"):
        append_observation(Episode(Sample(index=1, tokens=list(prompt)), tokenizer, 500, 2, vision=vision), "no image", [TOOL_IMAGES[1]])  # fmt: skip


def train_data(args, samples) -> dict:
    return split_train_data_by_dp(args, samples_to_train_data(args, samples), 1)[0]


@pytest.mark.parametrize("layout", ["sdpa", "flash_attention_2"], ids=["shared-prompt-rows", "one-packed-row"])
def test_trainer_log_probs_equal_the_engines_with_images_in_the_response(tiny_vlm_dir, rollout, layout):
    args, samples = rollout
    args = copy.copy(args)
    args.micro_batch_size = len(samples)  # one micro-batch: each prompt's two samples share a row in sdpa
    actor = new_actor(args)
    actor.attn_implementation = layout
    log_probs = actor._forward_log_probs(actor._micro_batches(actor._prepare(train_data(args, samples))), 4)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(tiny_vlm_dir)
    for ours, sample in zip(log_probs, samples):
        sampled = torch.tensor(sample.loss_mask, dtype=torch.bool)
        gap = (ours[sampled] - torch.tensor(sample.rollout_log_probs)[sampled]).abs().max().item()
        assert gap <= 1e-4, (sample.index, gap)
        images = sample.multimodal_inputs["images"]
        reference = hf_log_probs(model, processor, sample.tokens, images, sample.response_length)
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
    # The tool image is seen: other pixels of the same size move the second turn's log-probs.
    first = samples[0]
    other = [PROMPT_IMAGE, make_image(84, 56, seed=99)]
    moved = hf_log_probs(model, processor, first.tokens, other, first.response_length)
    assert (moved[-4:] - log_probs[0][-4:]).abs().max() > 1e-3


# ---- the trajectory proxy ---------------------------------------------------------------------------------------
async def proxy_session(tokenizer, engine_url: str, talk, vision, wire: str = "openai"):
    """Run `talk(client)` in one session of a fresh proxy with an `openai` (or `anthropic`) client; the session."""
    proxy = TrajectoryProxy(tokenizer, vision=vision)
    await proxy.start()
    try:
        session = proxy.open_session([engine_url], sampling_params={"temperature": 1.0, "max_new_tokens": 4})
        if wire == "openai":
            client = openai.AsyncOpenAI(base_url=proxy.base_url(session.session_id), api_key="any", max_retries=0)
        else:
            import anthropic  # here: its import costs every worker that collects this file ~1.2 s

            url = proxy.anthropic_base_url(session.session_id)
            client = anthropic.AsyncAnthropic(base_url=url, api_key="any", max_retries=0)
        try:
            await talk(client)
        finally:
            await client.close()
        return proxy.close_session(session.session_id)
    finally:
        await proxy.stop()


async def openai_talk(client, tool_image):
    first = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(PROMPT_IMAGE)}}, {"type": "text", "text": "How many sides?"}]}]  # fmt: skip
    reply = await client.chat.completions.create(model="m", messages=first, max_tokens=4, seed=1)
    history = first + [reply.choices[0].message.model_dump(exclude_none=True), tool_message(tool_image)]
    history[-1]["tool_call_id"] = "call_0"
    await client.chat.completions.create(model="m", messages=history, max_tokens=4, seed=2)


def image_block(image) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_base64(image)}}


async def anthropic_talk(client, tool_image):
    first = [{"role": "user", "content": [image_block(PROMPT_IMAGE), {"type": "text", "text": "How many sides?"}]}]
    reply = await client.messages.create(model="m", messages=first, max_tokens=4)
    result = {"type": "tool_result", "tool_use_id": "toolu_0",
              "content": [{"type": "text", "text": "zoomed:"}, image_block(tool_image)]}  # fmt: skip
    history = first + [
        {"role": "assistant", "content": [{"type": "text", "text": block.text} for block in reply.content]},
        {"role": "user", "content": [result]},
    ]
    await client.messages.create(model="m", messages=history, max_tokens=4)


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_proxy_records_images_of_user_and_tool_messages(tiny_vlm_dir, engine, tokenizer, wire):
    tool_image = TOOL_IMAGES[0]
    talk = openai_talk if wire == "openai" else anthropic_talk
    session = asyncio.run(
        proxy_session(tokenizer, engine, lambda c: talk(c, tool_image), load_vision_prompter(str(tiny_vlm_dir)), wire)
    )
    sample = session_to_sample(session, Sample(index=0))
    prompt = expected_prompt(tokenizer, Sample(index=0, multimodal_inputs={"images": [PROMPT_IMAGE]}))
    assert sample.tokens[: len(prompt)] == prompt
    # The tool turn's tokens hold the tool image's placeholder expanded, masked out of the loss.
    context = session.turns[1].context_ids
    assert context.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == VISUAL_TOKENS[tool_image.size]
    assert tokenizer.decode(context).endswith("<|im_start|>tool\nzoomed:" + pads(tool_image) + "<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    outputs = [len(turn.output_ids) for turn in session.turns]
    assert sample.loss_mask == [1] * outputs[0] + [0] * len(context) + [1] * outputs[1]
    images = sample.multimodal_inputs["images"]
    assert len(images) == 2 and same_pixels(images[0], PROMPT_IMAGE) and same_pixels(images[1], tool_image)
    grid = sample.multimodal_train_inputs["image_grid_thw"]
    assert (grid.prod(-1) // 4).tolist() == [4, 6]
    # The engine saw both images: its log-probs are the model's over the whole sequence with them.
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(tiny_vlm_dir)
    reference = hf_log_probs(model, processor, sample.tokens, images, sample.response_length)
    sampled = torch.tensor(sample.loss_mask, dtype=torch.bool)
    torch.testing.assert_close(torch.tensor(sample.rollout_log_probs)[sampled], reference[sampled], atol=1e-4, rtol=0)


def test_proxy_refuses_images_for_a_text_only_model_and_web_urls(tiny_vlm_dir, tiny_model_dir, tokenizer):
    image_part = {"type": "image_url", "image_url": {"url": data_url(PROMPT_IMAGE)}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image_part]}]

    async def refused(client, messages):
        with pytest.raises(openai.BadRequestError) as error:
            await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        return error.value.body

    async def text_only(client):
        body = await refused(client, messages)
        assert "messages[0].content[1] is an image" in body["message"] and "text-only" in body["message"]

    # Neither request reaches an engine: nothing listens at this URL.
    asyncio.run(proxy_session(AutoTokenizer.from_pretrained(tiny_model_dir), "http://127.0.0.1:9", text_only, None))

    async def web_url(client):
        web = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
        assert "web URL" in (await refused(client, web))["message"]

    asyncio.run(proxy_session(tokenizer, "http://127.0.0.1:9", web_url, load_vision_prompter(str(tiny_vlm_dir))))
