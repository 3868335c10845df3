"""`save_hf_folder` on a vision-language model: the export carries the image processor and chat template of the
source checkpoint, so it loads back as the VLM it is (slime's own readers and transformers')."""

from __future__ import annotations

import torch
from support.tiny_vlm import make_image
from transformers import AutoImageProcessor, AutoModelForImageTextToText

from slime.backends.fsdp_utils.model import save_hf_folder
from slime.utils.data import load_vision_prompter
from slime.utils.processing_utils import load_processor, load_tokenizer


def test_save_hf_folder_keeps_the_vlm_image_processor(tmp_path, tiny_vlm_dir):
    source = tiny_vlm_dir
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
    export = tmp_path / "export"
    save_hf_folder(model, model.state_dict(), str(export), str(source))

    assert (export / "preprocessor_config.json").is_file()
    image = make_image(84, 56, seed=4)
    expected = AutoImageProcessor.from_pretrained(source)(images=[image], return_tensors="pt")
    got = AutoImageProcessor.from_pretrained(export)(images=[image], return_tensors="pt")
    assert torch.equal(got["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(got["pixel_values"], expected["pixel_values"])

    # What a run started from the export reads: the rollout's image side and the chat template.
    prompter = load_vision_prompter(str(export))
    assert prompter is not None and prompter.image_token_id == model.config.image_token_id
    assert load_tokenizer(str(export)).chat_template == load_tokenizer(str(source)).chat_template
    source_processor = load_processor(str(source))
    if source_processor is not None:  # transformers builds Qwen-VL processors only with torchvision
        assert type(load_processor(str(export))) is type(source_processor)
