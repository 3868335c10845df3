"""slime.utils.processing_utils: image inputs, placeholder expansion, processor kwargs, tokenizer / processor loading."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image
from support.tiny_model import build_tiny_model, build_tokenizer
from support.tiny_vlm import make_image

from slime.utils.processing_utils import (
    build_processor_kwargs,
    encode_image_for_rollout_engine,
    expand_image_pads,
    image_token_counts,
    load_image,
    load_image_processor,
    load_processor,
    load_tokenizer,
)

PAD = 9


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def picture() -> Image.Image:
    return make_image(7, 5, seed=3)


def test_load_image_takes_every_form(picture, tmp_path):
    raw = png_bytes(picture)
    path = tmp_path / "a.png"
    path.write_bytes(raw)
    b64 = base64.b64encode(raw).decode()
    forms = [picture, raw, b64, f"data:image/png;base64,{b64}"]
    for form in forms:
        for allow_path in (False, True):
            loaded = load_image(form, allow_path=allow_path)
            assert loaded.mode == "RGB"
            assert np.array_equal(pixels(loaded), pixels(picture))
    assert np.array_equal(pixels(load_image(str(path), allow_path=True)), pixels(picture))


def test_load_image_reads_no_file_unless_allowed(picture, tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(png_bytes(picture))
    with pytest.raises(ValueError) as error:
        load_image(str(path), "image_data[0]")
    assert "image_data[0]" in str(error.value) and "file paths are not read here" in str(error.value)
    assert "base64 or a data URL" in str(error.value)


def test_load_image_converts_to_rgb():
    rgba = Image.new("RGBA", (3, 2), (10, 20, 30, 40))
    assert load_image(rgba).mode == "RGB"
    assert pixels(load_image(rgba))[0, 0].tolist() == [10, 20, 30]


@pytest.mark.parametrize(
    "bad, names",
    [
        ("https://example.com/cat.png", ["image_data[1]", "https://example.com/cat.png", "offline"]),
        ("/no/such/dir/cat.png", ["image_data[1]", "/no/such/dir/cat.png", "file paths are not read here"]),
        (base64.b64encode(b"not an image at all").decode(), ["image_data[1]", "base64 text", "no image"]),
        ("data:image/png;base64,@@@", ["image_data[1]", "data:image/png", "base64"]),
        ("data:image/png,rawtext", ["image_data[1]", "not a base64 data URL"]),
        (42, ["image_data[1]", "int"]),
    ],
)
def test_load_image_errors_name_the_input(bad, names):
    with pytest.raises(ValueError) as error:
        load_image(bad, "image_data[1]")
    for name in names:
        assert name in str(error.value)


def test_load_image_names_a_missing_file_where_paths_are_read():
    with pytest.raises(ValueError, match=r"images\[0\]: '/no/such/cat.png' is neither an existing image file"):
        load_image("/no/such/cat.png", "images[0]", allow_path=True)


def test_encode_image_is_lossless_base64_png(picture):
    for source in (picture, png_bytes(picture)):
        encoded = encode_image_for_rollout_engine(source)
        decoded = Image.open(io.BytesIO(base64.b64decode(encoded)))
        assert decoded.format == "PNG"
        assert np.array_equal(pixels(decoded), pixels(picture))


def test_image_token_counts_divide_the_grid_by_the_merge():
    assert image_token_counts(torch.tensor([[1, 4, 4], [1, 2, 6], [2, 4, 2]]), 2) == [4, 3, 4]


def test_expand_image_pads_expands_single_placeholders_and_keeps_expanded_ones():
    assert expand_image_pads([1, PAD, 2, PAD, 3], PAD, [3, 2]) == [1, PAD, PAD, PAD, 2, PAD, PAD, 3]
    assert expand_image_pads([1, PAD, PAD, PAD, 2, PAD, 3], PAD, [3, 2]) == [1, PAD, PAD, PAD, 2, PAD, PAD, 3]
    assert expand_image_pads([PAD], PAD, [1]) == [PAD]
    assert expand_image_pads([1, 2], PAD, []) == [1, 2]


@pytest.mark.parametrize(
    "ids, counts, message",
    [
        ([1, PAD, 2], [3, 2], "1 image placeholder(s)"),
        ([1, 2], [3], "0 image placeholder(s)"),
        ([1, PAD, PAD, 2], [3], "2 tokens long"),
    ],
)
def test_expand_image_pads_refuses_mismatches(ids, counts, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        expand_image_pads(ids, PAD, counts)


def test_build_processor_kwargs_lists_text_and_tensors_media():
    images = [make_image(4, 4, 0)]
    kwargs = build_processor_kwargs({"images": images, "images_kwargs": {"max_pixels": 100}})
    assert kwargs["images"] is images
    assert kwargs["text_kwargs"] == {"return_tensors": None, "return_mm_token_type_ids": True}
    assert kwargs["images_kwargs"] == {"max_pixels": 100, "return_tensors": "pt"}
    assert kwargs["videos_kwargs"] == {"return_tensors": "pt"}
    assert kwargs["audio_kwargs"] == {"return_tensors": "pt"}
    assert build_processor_kwargs(None)["text_kwargs"]["return_tensors"] is None


def test_load_tokenizer_takes_the_processor_chat_template(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(template)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"


def test_load_processor_is_none_for_a_text_model(tmp_path):
    assert load_processor(str(build_tiny_model(tmp_path / "text"))) is None


def test_load_image_processor_reads_the_vlm_folder_and_names_a_missing_one(tmp_path, tiny_vlm_dir):
    processed = load_image_processor(str(tiny_vlm_dir))(images=[make_image(56, 56, 1)], return_tensors="pt")
    assert processed["image_grid_thw"].tolist() == [[1, 4, 4]]
    with pytest.raises(ValueError, match="preprocessor_config.json"):
        load_image_processor(str(build_tiny_model(tmp_path / "text")))
