"""examples/geo3k_vlm_multi_turn: its generate function against a real CPU engine serving a tiny random Qwen2.5-VL,
on prompts of geo3k_vlm's synthesizer read by the data reader. The random model never answers right, so every
sample takes the environment's zoomed picture and a second turn; the zoom is recomputed here with numpy, and the
engine's log-probs of both turns must equal an HF forward over the whole sequence with both pictures."""

from __future__ import annotations

import asyncio
import copy
import json
import random
import sys

import numpy as np
import torch
from PIL import Image
from support.engines import cpu_engine_process
from support.fsdp import make_args
from support.runs import REPO
from support.vlm_reference import hf_log_probs
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from slime.utils.data import Dataset
from slime.utils.types import Status

EXAMPLE = REPO / "examples" / "geo3k_vlm_multi_turn"
sys.path[:0] = [str(EXAMPLE), str(REPO / "examples" / "geo3k_vlm")]
import env_geo3k  # noqa: E402
import rollout  # noqa: E402
import synth_data  # noqa: E402


def expected_zoom(image: Image.Image) -> Image.Image:
    pixels = np.asarray(image).astype(int)
    ink = (pixels != pixels[0, 0]).any(axis=-1)
    rows, cols = np.nonzero(ink.any(axis=1))[0], np.nonzero(ink.any(axis=0))[0]
    m = env_geo3k.MARGIN
    box = (max(cols[0] - m, 0), max(rows[0] - m, 0), min(cols[-1] + 1 + m, image.width), min(rows[-1] + 1 + m, image.height))  # fmt: skip
    return image.crop(tuple(int(v) for v in box)).resize(image.size, Image.Resampling.BICUBIC)


def test_the_environment_ends_on_the_right_answer_and_zooms_otherwise():
    picture = synth_data.draw("sides", 5, 56, random.Random(0))
    assert env_geo3k.step(picture, "5", "five sides: \\boxed{5}") is None
    message = env_geo3k.step(picture, "5", "\\boxed{4}")
    assert message["role"] == "tool" and message["content"][0]["text"] == env_geo3k.FEEDBACK
    zoomed = message["content"][1]["image"]
    assert zoomed.size == picture.size and np.array_equal(np.asarray(zoomed), np.asarray(expected_zoom(picture)))
    assert not np.array_equal(np.asarray(zoomed), np.asarray(picture))


def test_generate_sends_the_zoomed_picture_and_the_samples_are_consistent(tiny_vlm_dir, tmp_path):
    synth_data.main(["--out", str(tmp_path), "--train", "2", "--test", "1", "--size", "56"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_dir)
    source = tmp_path / "train.jsonl"
    dataset = Dataset(
        [json.loads(line) for line in source.read_text().splitlines()], tokenizer, source=str(source),
        input_key="problem", label_key="answer", multimodal_keys={"image": "images"}, apply_chat_template=True,
    )  # fmt: skip
    samples = [copy.deepcopy(s) for s in dataset.samples]
    for i, sample in enumerate(samples):
        sample.index = i
    # Every token stops a turn: each turn is one token and ends COMPLETED, so only --max-turns ends the episode.
    params = {"temperature": 1.0, "max_new_tokens": 8, "stop_token_ids": list(range(len(tokenizer)))}
    with cpu_engine_process(tiny_vlm_dir) as (_, url):
        args = make_args(tiny_vlm_dir, "--max-turns", "2", num_samples=4)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        args.sglang_router_ip, args.sglang_router_port = host, int(port)

        async def run():
            return await asyncio.gather(*(rollout.generate(args, s, dict(params)) for s in samples))

        samples = asyncio.run(run())
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(tiny_vlm_dir)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for sample in samples:
        picture, zoomed = sample.multimodal_inputs["images"]
        assert np.array_equal(np.asarray(zoomed), np.asarray(expected_zoom(picture)))
        assert sample.status == Status.COMPLETED and sample.loss_mask.count(1) == 2
        assert sample.loss_mask[0] == 1 and sample.loss_mask[-1] == 1 and 0 in sample.loss_mask
        response = sample.tokens[sample.prompt_length :]
        assert response.count(pad) == 4 and sample.tokens[: sample.prompt_length].count(pad) == 4  # 56x56: 4 tokens
        assert env_geo3k.FEEDBACK in sample.response
        grid = sample.multimodal_train_inputs["image_grid_thw"]
        assert grid.tolist() == [[1, 4, 4], [1, 4, 4]]
        reference = hf_log_probs(model, processor, sample.tokens, [picture, zoomed], sample.response_length)
        sampled = torch.tensor(sample.loss_mask, dtype=torch.bool)
        got = torch.tensor(sample.rollout_log_probs)
        torch.testing.assert_close(got[sampled], reference[sampled], atol=1e-4, rtol=0)
