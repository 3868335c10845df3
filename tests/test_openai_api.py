"""The CPU engine's OpenAI-compatible routes, driven by the real `openai` client against a real engine process."""

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import requests
from transformers import AutoTokenizer

from slime.utils.http_utils import find_free_port, wait_until_healthy

REPO_ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key"
MESSAGES = [{"role": "system", "content": "think step by step"}, {"role": "user", "content": "What is 12 + 34?"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """One engine process (with --api-key) for the module; yields (openai client, base URL, tokenizer)."""
    port = find_free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "slime.backends.cpu_engine", "--model-path", str(tiny_model_dir)]
    command += ["--port", str(port), "--num-threads", "1", "--api-key", API_KEY]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(f"{url}/health", 120, process=process)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        yield client, url, AutoTokenizer.from_pretrained(tiny_model_dir)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def native_generate(url: str, body: dict) -> dict:
    response = requests.post(f"{url}/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    response.raise_for_status()
    return response.json()


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_models_lists_the_served_model(engine, tiny_model_dir):
    client, _, _ = engine
    assert [m.id for m in client.models.list().data] == [str(Path(tiny_model_dir).resolve())]


def test_chat_matches_native_generate_and_counts_real_tokens(engine):
    client, url, tokenizer = engine
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=10)
    prompt_ids = chat_prompt_ids(tokenizer, MESSAGES)
    native = native_generate(
        url, {"input_ids": prompt_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 10}}
    )
    [choice] = answer.choices
    assert answer.object == "chat.completion" and answer.model == "tiny"
    assert choice.message.role == "assistant"
    assert choice.message.content == native["text"]
    assert choice.message.tool_calls is None
    assert choice.finish_reason == native["meta_info"]["finish_reason"]["type"]
    assert answer.usage.prompt_tokens == len(prompt_ids)
    assert answer.usage.completion_tokens == len(native["output_ids"])
    assert answer.usage.total_tokens == len(prompt_ids) + len(native["output_ids"])


def test_completions_match_native_generate(engine):
    client, url, tokenizer = engine
    prompt = "the quick brown fox"
    answer = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=8)
    native = native_generate(url, {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    assert answer.object == "text_completion"
    assert answer.choices[0].text == native["text"]
    assert answer.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert answer.usage.completion_tokens == len(native["output_ids"])


def test_completions_batch_of_token_id_prompts(engine):
    client, url, _ = engine
    prompts = [[5, 6, 7], [8, 9]]
    answer = client.completions.create(model="tiny", prompt=prompts, temperature=0, max_tokens=4)
    texts = [
        native_generate(url, {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 4}})["text"]
        for p in prompts
    ]
    assert [c.index for c in answer.choices] == [0, 1]
    assert [c.text for c in answer.choices] == texts
    assert answer.usage.prompt_tokens == 5


def test_max_tokens_and_max_completion_tokens_are_respected(engine):
    client, _, _ = engine
    for limit in (1, 3):
        answer = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=limit, seed=1, logprobs=True, n=3
        )
        for choice in answer.choices:
            produced = len(choice.logprobs.content)
            assert produced <= limit
            assert choice.finish_reason == ("length" if produced == limit else "stop")
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=2, seed=2)
    assert answer.usage.completion_tokens <= 2


def test_n_choices_with_logprobs_add_up_to_usage(engine):
    client, _, _ = engine
    answer = client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=2, temperature=1, seed=3, max_tokens=12, logprobs=True
    )
    assert [c.index for c in answer.choices] == [0, 1]
    lengths = [len(c.logprobs.content) for c in answer.choices]
    assert answer.usage.completion_tokens == sum(lengths)
    for choice in answer.choices:
        assert all(entry.logprob <= 0 for entry in choice.logprobs.content)


def test_seed_reproduces_sampling_at_temperature_one(engine):
    client, _, _ = engine

    def texts(seed: int) -> list[str]:
        answer = client.chat.completions.create(
            model="tiny", messages=MESSAGES, temperature=1, seed=seed, max_tokens=16, n=2
        )
        return [c.message.content for c in answer.choices]

    first = texts(7)
    assert texts(7) == first
    # Different seeds give different samples (fixed seeds: checked once, not by chance at test time).
    assert texts(8) != first


def test_stop_string_cuts_the_output(engine):
    client, _, _ = engine
    greedy = client.completions.create(model="tiny", prompt="0123", temperature=0, max_tokens=16, stop=None)
    text = greedy.choices[0].text
    assert len(text.strip()) >= 4, f"the tiny model's greedy text is too short to pick a stop string: {text!r}"
    stop = text.strip()[len(text.strip()) // 2]
    answer = client.completions.create(model="tiny", prompt="0123", temperature=0, max_tokens=16, stop=[stop])
    assert answer.choices[0].text == text[: text.index(stop)]
    assert answer.choices[0].finish_reason == "stop"


def test_tools_are_accepted(engine):
    # The tiny template does not render tools and the random model writes no <tool_call>; parsing is in
    # tests/test_tool_calls.py. This checks the request path with tools end to end.
    client, _, _ = engine
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools, temperature=0, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_streaming_reassembles_to_the_non_streamed_answer(engine):
    client, _, _ = engine
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=10)
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        temperature=0,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [plain.choices[0].finish_reason]
    assert chunks[-1].usage.model_dump() == plain.usage.model_dump()

    completion = client.completions.create(model="tiny", prompt="the quick", temperature=0, max_tokens=6)
    streamed = client.completions.create(model="tiny", prompt="the quick", temperature=0, max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text


def _assert_openai_error(error: openai.APIStatusError, status: int, param: str | None) -> None:
    body = error.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert error.status_code == status and body["error"]["param"] == param and body["error"]["message"]


@pytest.mark.reliability("OpenAI chat request without messages", "400 in OpenAI's error shape, param 'messages'")
def test_missing_messages_is_a_bad_request(engine):
    client, _, _ = engine
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[])
    _assert_openai_error(caught.value, 400, "messages")
    assert caught.value.response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.reliability("OpenAI request with temperature -1, n=0 or top_logprobs", "400 naming the field")
@pytest.mark.parametrize(
    "fields, param",
    [({"temperature": -1}, "temperature"), ({"n": 0}, "n"), ({"logprobs": True, "top_logprobs": 2}, "top_logprobs")],
)
def test_bad_sampling_fields_are_bad_requests(engine, fields, param):
    client, _, _ = engine
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **fields)
    _assert_openai_error(caught.value, 400, param)


@pytest.mark.reliability("OpenAI completion whose max_tokens overflows the context", "400 saying how far to lower it")
def test_max_tokens_beyond_the_context_is_a_bad_request(engine):
    client, url, _ = engine
    context = requests.get(f"{url}/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="tiny", prompt="the quick", max_tokens=context["context_length"])


@pytest.mark.reliability("unknown /v1 route", "404 in OpenAI's error shape listing the routes served")
def test_unknown_v1_route_is_not_found(engine):
    _, url, _ = engine
    response = requests.post(f"{url}/v1/embeddings", json={}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert "/v1/chat/completions" in response.json()["error"]["message"]


@pytest.mark.reliability("OpenAI request without the engine's --api-key", "401, the client raises AuthenticationError")
def test_v1_routes_need_the_api_key(engine):
    _, url, _ = engine
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
