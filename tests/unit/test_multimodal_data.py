"""`--multimodal-keys`: images read per sample by the prompt dataset (paths, base64, data URLs, Parquet bytes), the
chat template's image placeholders, errors naming the sample and the key, visual tokens in the length filter, and the
parse-time checks (images only; vision-language checkpoints; FSDP only)."""

from __future__ import annotations

import base64
import io
import json
from argparse import Namespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from support.tiny_vlm import IMAGE_PLACEHOLDER, make_image, png_base64
from transformers import AutoImageProcessor, AutoTokenizer

from slime.utils.arguments import ArgumentValidationError, parse_args
from slime.utils.data import load_dataset, load_vision_prompter

IMAGES = [make_image(56, 56, seed=1), make_image(84, 56, seed=2), make_image(30, 70, seed=3)]


@pytest.fixture(scope="module")
def tokenizer(tiny_vlm_dir):
    return AutoTokenizer.from_pretrained(tiny_vlm_dir)


def data_args(tiny_vlm_dir, **overrides) -> Namespace:
    settings = dict(
        input_key="problem", label_key="answer", metadata_key="metadata", tool_key="tools", apply_chat_template=True,
        apply_chat_template_kwargs={}, rollout_max_prompt_len=None, rollout_seed=0,
        multimodal_keys={"image": "images"}, hf_checkpoint=str(tiny_vlm_dir), trust_remote_code=False,
    )  # fmt: skip
    return Namespace(**(settings | overrides))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def pixels(image) -> bytes:
    return image.convert("RGB").tobytes()


def test_every_image_form_is_read_with_its_pixels(tmp_path, tiny_vlm_dir, tokenizer):
    (tmp_path / "imgs").mkdir()
    IMAGES[0].save(tmp_path / "imgs" / "a.png")
    IMAGES[1].save(tmp_path / "b.png")
    rows = [
        {"problem": "<image>Sides?", "answer": "4", "images": ["imgs/a.png"]},  # relative to the data file
        {"problem": "Dots?", "answer": "2", "images": [str(tmp_path / "b.png"), png_base64(IMAGES[2])]},
        {"problem": "<image>x", "answer": "1", "images": [f"data:image/png;base64,{png_base64(IMAGES[1])}"]},
        {"problem": "no picture", "answer": "0", "images": []},
    ]
    samples = load_dataset(write_jsonl(tmp_path / "data.jsonl", rows), data_args(tiny_vlm_dir), tokenizer).samples
    assert [[pixels(i) for i in s.multimodal_inputs["images"]] for s in samples[:3]] == [
        [pixels(IMAGES[0])],
        [pixels(IMAGES[1]), pixels(IMAGES[2])],
        [pixels(IMAGES[1])],
    ]
    assert samples[3].multimodal_inputs is None and samples[3].prompt.count(IMAGE_PLACEHOLDER) == 0
    # Parquet as HF datasets writes an Image feature: {"bytes", "path"} cells.
    table = pa.table(
        {
            "problem": ["<image> and <image>"],
            "answer": ["3"],
            "images": [[{"bytes": png_bytes(IMAGES[2]), "path": None}, {"bytes": png_bytes(IMAGES[0]), "path": None}]],
        }
    )
    pq.write_table(table, tmp_path / "data.parquet")
    (sample,) = load_dataset(str(tmp_path / "data.parquet"), data_args(tiny_vlm_dir), tokenizer).samples
    assert [pixels(i) for i in sample.multimodal_inputs["images"]] == [pixels(IMAGES[2]), pixels(IMAGES[0])]


def test_placeholders_take_the_images_in_order_or_lead_the_text(tmp_path, tiny_vlm_dir, tokenizer):
    rows = [
        {"problem": "first <image> then <image> end", "answer": "1", "images": [png_base64(i) for i in IMAGES[:2]]},
        {"problem": "how many sides?", "answer": "3", "images": [png_base64(IMAGES[0])]},
    ]
    samples = load_dataset(write_jsonl(tmp_path / "d.jsonl", rows), data_args(tiny_vlm_dir), tokenizer).samples
    assert samples[0].prompt == (
        f"<|im_start|>user\nfirst {IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} end<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        samples[1].prompt == f"<|im_start|>user\n{IMAGE_PLACEHOLDER}how many sides?<|im_end|>\n<|im_start|>assistant\n"
    )
    # Without --apply-chat-template the prompt stays messages with image parts (the rollout templates them).
    plain = load_dataset(
        write_jsonl(tmp_path / "e.jsonl", rows[1:]), data_args(tiny_vlm_dir, apply_chat_template=False), tokenizer
    )
    assert plain.samples[0].prompt == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many sides?"}]}
    ]


@pytest.mark.parametrize(
    "row, names",
    [
        ({"problem": "p", "images": ["missing.png"]}, ["sample 1", "'images'[0]", "missing.png"]),
        ({"problem": "p", "images": ["https://example.com/x.png"]}, ["sample 1", "'images'[0]", "offline"]),
        ({"problem": "p", "images": [base64.b64encode(b"not an image").decode()]}, ["sample 1", "'images'[0]"]),
        ({"problem": "<image><image>", "images": [png_base64(IMAGES[0])]}, ["sample 1", "2 image placeholder", "1 image"]),
        ({"problem": "p"}, ["sample 1", "no key 'images'", "--multimodal-keys"]),
    ],
    ids=["missing-file", "web-url", "not-an-image", "placeholder-count", "missing-key"],
)  # fmt: skip
def test_bad_images_name_the_sample_and_the_key(tmp_path, tiny_vlm_dir, tokenizer, row, names):
    rows = [{"problem": "fine", "images": []}, row]
    with pytest.raises((ValueError, KeyError)) as error:
        load_dataset(write_jsonl(tmp_path / "bad.jsonl", rows), data_args(tiny_vlm_dir, label_key=None), tokenizer)
    for name in names:
        assert name in str(error.value)


def test_length_filter_counts_visual_tokens(tmp_path, tiny_vlm_dir, tokenizer):
    rows = [{"problem": "a", "images": [png_base64(IMAGES[1])]}, {"problem": "a", "images": []}]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "a"}], add_generation_prompt=True, tokenize=False
    )
    text_only = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    grid = AutoImageProcessor.from_pretrained(tiny_vlm_dir)(images=[IMAGES[1]], return_tensors="pt")["image_grid_thw"]
    with_image = text_only + 3 - 1 + int(grid.prod()) // 4  # vision start/pad/end, the pad expanded
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    for limit, kept in ((with_image, 2), (with_image - 1, 1)):
        samples = load_dataset(path, data_args(tiny_vlm_dir, label_key=None, rollout_max_prompt_len=limit), tokenizer)
        assert len(samples) == kept
    # What the rollout sends for that prompt has exactly that many tokens.
    prompter = load_vision_prompter(str(tiny_vlm_dir))
    (sample,) = load_dataset(path, data_args(tiny_vlm_dir, label_key=None), tokenizer).samples[:1]
    ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    expanded, inputs = prompter.prepare(ids, sample.multimodal_inputs["images"])
    assert len(expanded) == with_image and inputs["image_grid_thw"].tolist() == grid.tolist()


def flags(hf_checkpoint, *extra: str):
    return ["--hf-checkpoint", str(hf_checkpoint), "--prompt-data", "p.jsonl", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "1", *extra]  # fmt: skip


def test_multimodal_flags_are_checked_at_parse_time(tiny_vlm_dir, tiny_model_dir):
    args = parse_args(flags(tiny_vlm_dir, "--multimodal-keys", '{"image": "images"}'))
    assert args.multimodal_keys == {"image": "images"} and not args.train_vision_tower
    with pytest.raises(SystemExit):  # argparse: only images
        parse_args(flags(tiny_vlm_dir, "--multimodal-keys", '{"video": "clips"}'))
    cases = [
        (flags(tiny_vlm_dir, "--train-backend", "megatron"), "--train-backend fsdp"),
        (flags(tiny_model_dir, "--train-backend", "megatron", "--multimodal-keys", '{"image": "i"}'), "--multimodal-keys"),
        (flags(tiny_model_dir, "--multimodal-keys", '{"image": "images"}'), "no vision_config"),
        (flags(tiny_model_dir, "--train-vision-tower"), "--train-vision-tower"),
    ]  # fmt: skip
    for argv, message in cases:
        with pytest.raises(ArgumentValidationError, match=message):
            parse_args(argv)


def test_a_sample_with_images_saves_as_plain_data_and_loads_back_pixel_exact(tmp_path):
    # A checkpointed buffer or a debug dump of image samples must load under torch.load(weights_only=True).
    from PIL import Image

    from slime.utils.types import Sample

    image = Image.new("RGB", (5, 4), (10, 200, 30))
    image.putpixel((1, 2), (1, 2, 3))
    sample = Sample(index=0, multimodal_inputs={"images": [image, image.rotate(90)]})
    torch.save(sample.to_dict(), tmp_path / "sample.pt")
    loaded = Sample.from_dict(torch.load(tmp_path / "sample.pt", weights_only=True))
    for original, back in zip(sample.multimodal_inputs["images"], loaded.multimodal_inputs["images"], strict=True):
        assert back.size == original.size and back.mode == "RGB"
        assert back.tobytes() == original.tobytes()
