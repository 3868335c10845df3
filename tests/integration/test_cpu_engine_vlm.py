"""The CPU engine serving a vision-language model (a tiny random Qwen2.5-VL): /generate with `image_data`, chat with
`image_url` parts, log-probs against an HF forward, batching, bad images, weight updates of the vision tower, and
what sglang-router forwards.

Expected values come from the checkpoint loaded with transformers and run once over the whole sequence; the image
placeholders are expanded here from the image processor's grids, independently of the engine's code.
"""

from __future__ import annotations

import shutil

import pytest
import requests
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from support.engines import engine_server, router_args, router_for
from support.tiny_vlm import make_image, png_base64
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from slime.backends.cpu_engine.protocol import RequestError, parse_generate_request
from slime.utils.weight_transport import serialize_named_tensors

IMAGES = [make_image(60, 50, seed=1), make_image(90, 40, seed=2)]


@pytest.fixture(scope="module")
def server(tiny_vlm_dir):
    with engine_server(tiny_vlm_dir, "--max-running-requests", "8") as (_, url):
        yield url


@pytest.fixture(scope="module")
def ref_model(tiny_vlm_dir):
    return AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_vlm_dir):
    return AutoTokenizer.from_pretrained(tiny_vlm_dir)


@pytest.fixture(scope="module")
def image_processor(tiny_vlm_dir):
    return AutoImageProcessor.from_pretrained(tiny_vlm_dir)


def chat_ids(tokenizer, images: int, question: str = "what is 1+2?") -> list[int]:
    """A user turn with `images` image parts then text, as the chat template writes it (one placeholder per image)."""
    content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text)


def expanded(ids: list[int], image_id: int, grids: torch.Tensor) -> list[int]:
    """Each placeholder repeated once per merged 2x2 patch of its image."""
    counts = iter((grids.prod(-1) // 4).tolist())
    out = []
    for token in ids:
        out += [image_id] * next(counts) if token == image_id else [token]
    return out


@torch.no_grad()
def hf_log_probs(model, processor, prompt: list[int], output: list[int], images, temperature: float = 1.0):
    """log_softmax(logits / T) of each output token from one HF forward over the expanded prompt + output."""
    image_id = model.config.image_token_id
    kwargs, full_prompt = {}, prompt
    if images:
        processed = processor(images=images, return_tensors="pt")
        full_prompt = expanded(prompt, image_id, processed["image_grid_thw"])
        kwargs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
    ids = torch.tensor([full_prompt + output])
    logits = model(input_ids=ids, mm_token_type_ids=(ids == image_id).int(), **kwargs).logits[0]
    logits = logits[len(full_prompt) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0], len(full_prompt)


def generate(url: str, **body) -> requests.Response:
    return requests.post(f"{url}/generate", json=body, timeout=120)


def sample(url: str, ids, images, temperature: float = 1.0, max_new_tokens: int = 10, **fields) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": temperature, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "return_logprob": True,
        **fields,
    }
    if images is not None:
        body["image_data"] = images
    response = generate(url, **body)
    assert response.status_code == 200, response.text
    return response.json()


def tokens_and_log_probs(answer: dict) -> tuple[list[int], torch.Tensor]:
    pairs = answer["meta_info"]["output_token_logprobs"]
    return [p[1] for p in pairs], torch.tensor([p[0] for p in pairs])


def check_generate_with_images(
    url: str, tokenizer, model, processor, seed: int
) -> tuple[list, list, torch.Tensor, int]:
    """/generate of a two-image chat prompt, sampled at T=0.8, scores its tokens as one HF forward does and counts
    the prompt with its expanded image tokens; returns (prompt, output, log-probs, expanded prompt length)."""
    prompt = chat_ids(tokenizer, 2)
    answer = sample(url, prompt, [png_base64(i) for i in IMAGES], temperature=0.8, sampling_seed=seed)
    output, log_probs = tokens_and_log_probs(answer)
    expected, prompt_length = hf_log_probs(model, processor, prompt, output, IMAGES, temperature=0.8)
    assert answer["meta_info"]["prompt_tokens"] == prompt_length > len(prompt)
    torch.testing.assert_close(log_probs, expected, atol=1e-4, rtol=0)
    return prompt, output, log_probs, prompt_length


def test_generate_with_images_matches_an_hf_forward(server, ref_model, image_processor, tokenizer):
    prompt, output, log_probs, prompt_length = check_generate_with_images(
        server, tokenizer, ref_model, image_processor, seed=5
    )
    # The images matter: the same tokens without pixels (text positions, plain pad embeddings) score otherwise.
    image_id = ref_model.config.image_token_id
    blind = torch.tensor([expanded(prompt, image_id, image_processor(images=IMAGES)["image_grid_thw"]) + output])
    with torch.no_grad():
        logits = ref_model(input_ids=blind).logits[0, prompt_length - 1 : -1] / 0.8
    assert not torch.allclose(logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0], log_probs)


def test_prompt_forms_and_image_forms_agree(server, ref_model, image_processor, tokenizer):
    """Single placeholders or processor-expanded ones; base64 or a data URL: one request."""
    prompt = chat_ids(tokenizer, 1)
    first = sample(server, prompt, [png_base64(IMAGES[0])], temperature=0)
    grids = image_processor(images=[IMAGES[0]])["image_grid_thw"]
    others = [
        sample(server, expanded(prompt, ref_model.config.image_token_id, grids), [png_base64(IMAGES[0])], 0),
        sample(server, prompt, f"data:image/png;base64,{png_base64(IMAGES[0])}", temperature=0),
    ]
    for other in others:
        assert other["output_ids"] == first["output_ids"]
        assert other["meta_info"]["prompt_tokens"] == first["meta_info"]["prompt_tokens"]


def test_batch_mixes_image_and_text_prompts(server, tokenizer, ref_model, image_processor):
    """Rows of different lengths, image counts and none, in one batch, each as when sent alone."""
    prompts = [chat_ids(tokenizer, 2), tokenizer.encode("the quick brown fox"), chat_ids(tokenizer, 1, "why")]
    images = [[png_base64(i) for i in IMAGES], None, [png_base64(IMAGES[1])]]
    batch = sample(server, prompts, images, temperature=0)
    assert len(batch) == 3
    for prompt, row_images, answer, pictures in zip(prompts, images, batch, [IMAGES, [], [IMAGES[1]]]):
        alone = sample(server, prompt, row_images, temperature=0)
        assert answer["output_ids"] == alone["output_ids"]
        output, log_probs = tokens_and_log_probs(answer)
        expected, _ = hf_log_probs(ref_model, image_processor, prompt, output, pictures)
        torch.testing.assert_close(log_probs, expected, atol=1e-4, rtol=0)


def check_chat_with_image_url(url: str, tokenizer, model, processor, image, max_tokens: int) -> None:
    """Greedy chat with an image_url part answers as /generate with that image does, and scores its tokens as one
    HF forward does."""
    image_url = f"data:image/png;base64,{png_base64(image)}"
    content = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "what is 1+2?"}]
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
    }
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    native = sample(url, chat_ids(tokenizer, 1), [png_base64(image)], temperature=0, max_new_tokens=max_tokens)
    assert choice["message"]["content"] == native["text"]
    output, _ = tokens_and_log_probs(native)
    expected, prompt_length = hf_log_probs(model, processor, chat_ids(tokenizer, 1), output, [image])
    got = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert response.json()["usage"]["prompt_tokens"] == prompt_length


def test_chat_with_image_url(server, tokenizer, ref_model, image_processor):
    check_chat_with_image_url(server, tokenizer, ref_model, image_processor, IMAGES[0], max_tokens=6)


@pytest.mark.parametrize(
    "images, names",
    [
        (["https://example.com/cat.png"], ["image_data[0]", "https://example.com/cat.png", "offline"]),
        ([png_base64(IMAGES[0]), "bm90IGFuIGltYWdl"], ["image_data[1]", "no image"]),
        (["/no/such/file.png"], ["image_data[0]", "/no/such/file.png"]),
        ([png_base64(IMAGES[0]), png_base64(IMAGES[1])], ["1 image placeholder(s) (runs of token", "2 image(s)"]),
    ],
)
def test_bad_images_are_refused_by_name(server, tokenizer, images, names):
    response = generate(server, input_ids=chat_ids(tokenizer, 1), image_data=images)
    assert response.status_code == 400
    for name in names:
        assert name in response.json()["error"]["message"]


def test_engine_never_reads_image_files_its_clients_name(server, tokenizer, tmp_path):
    """A path to a real image on the engine's host is refused (400 naming the field), by /generate and by chat:
    clients must not be able to make the engine open its files."""
    path = tmp_path / "image.png"
    IMAGES[0].save(path)
    response = generate(server, input_ids=chat_ids(tokenizer, 1), image_data=[str(path)])
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "image_data[0]" in message and str(path)[:40] in message and "base64 or a data URL" in message
    content = [{"type": "image_url", "image_url": {"url": str(path)}}, {"type": "text", "text": "look"}]
    response = requests.post(
        f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]}, timeout=60
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[0]" and "base64 or a data URL" in error["message"]


def test_chat_names_a_bad_image_part(server):
    content = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    response = requests.post(
        f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]}, timeout=60
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].content[1]"


def test_text_only_engines_refuse_image_data(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(RequestError, match="image_data.*text-only"):
        parse_generate_request({"input_ids": [1, 2], "image_data": ["x"]}, tokenizer, len(tokenizer), 64)


def test_weight_update_by_checkpoint_names_reaches_the_vision_tower(
    server, tiny_vlm_dir, ref_model, image_processor, tokenizer, tmp_path
):
    """A push named as the checkpoint stores the weights (`visual.*`, `model.layers.*`) changes every parameter,
    the vision tower's included; /update_weights_from_disk puts the checkpoint back."""
    with safe_open(tiny_vlm_dir / "model.safetensors", "pt") as reader:
        saved = {name: reader.get_tensor(name) for name in reader.keys()}
    assert any(name.startswith("visual.") for name in saved)
    generator = torch.Generator().manual_seed(7)
    perturbed = {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in saved.items()}
    # The reference: the perturbed checkpoint, loaded by transformers (which maps the saved names itself).
    changed_dir = tmp_path / "perturbed"
    shutil.copytree(tiny_vlm_dir, changed_dir)
    save_file(perturbed, changed_dir / "model.safetensors", metadata={"format": "pt"})
    changed = AutoModelForImageTextToText.from_pretrained(changed_dir, dtype=torch.float32).eval()
    prompt, images = chat_ids(tokenizer, 1), [png_base64(IMAGES[0])]
    before, _ = tokens_and_log_probs(sample(server, prompt, images, temperature=0))
    response = requests.post(
        f"{server}/update_weights_from_tensor",
        json={"serialized_named_tensors": [serialize_named_tensors(list(perturbed.items()))]},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    output, log_probs = tokens_and_log_probs(sample(server, prompt, images, temperature=0))
    expected, _ = hf_log_probs(changed, image_processor, prompt, output, [IMAGES[0]])
    torch.testing.assert_close(log_probs, expected, atol=1e-4, rtol=0)

    response = requests.post(f"{server}/update_weights_from_disk", json={"model_path": str(tiny_vlm_dir)}, timeout=120)
    assert response.status_code == 200, response.text
    restored, log_probs = tokens_and_log_probs(sample(server, prompt, images, temperature=0))
    assert restored == before
    expected, _ = hf_log_probs(ref_model, image_processor, prompt, restored, [IMAGES[0]])
    torch.testing.assert_close(log_probs, expected, atol=1e-4, rtol=0)


def test_router_forwards_image_data(server, tokenizer, tmp_path):
    """sglang-router passes `image_data` (a list, or one string) and chat `image_url` parts on to the engine."""
    prompt = chat_ids(tokenizer, 1)
    direct = sample(server, prompt, [png_base64(IMAGES[0])], temperature=0)
    assert direct["meta_info"]["prompt_tokens"] > len(prompt)
    with router_for([server], router_args(tmp_path)) as router:
        for images in ([png_base64(IMAGES[0])], png_base64(IMAGES[0])):
            routed = sample(router, prompt, images, temperature=0)
            assert routed["output_ids"] == direct["output_ids"]
            assert routed["meta_info"]["prompt_tokens"] == direct["meta_info"]["prompt_tokens"]
        url = f"data:image/png;base64,{png_base64(IMAGES[0])}"
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is 1+2?"}]
        response = requests.post(
            f"{router}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == direct["meta_info"]["prompt_tokens"]


def test_qwen3_vl_is_served_as_hf_scores_it(tmp_path_factory, tokenizer):
    """A tiny Qwen3-VL (deepstack visual features, interleaved M-RoPE, 16-pixel patches): /generate with two images
    and chat with an image_url part score their tokens as one HF forward does."""
    from support.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / "qwen3_vl", arch="qwen3_vl")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.config.model_type == "qwen3_vl"
    processor = AutoImageProcessor.from_pretrained(model_dir)
    with engine_server(model_dir) as (_, url):
        check_generate_with_images(url, tokenizer, model, processor, seed=3)
        check_chat_with_image_url(url, tokenizer, model, processor, IMAGES[1], max_tokens=5)
