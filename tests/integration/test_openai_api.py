"""The CPU engine's OpenAI-compatible routes, driven by the real `openai` client against a real engine process."""

import time
from pathlib import Path

import openai
import pytest
import requests
import torch
from support.engines import engine_server
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime.backends.cpu_engine.openai_api import _settled_text

API_KEY = "test-key"
MESSAGES = [{"role": "system", "content": "think step by step"}, {"role": "user", "content": "What is 12 + 34?"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """One engine process (with --api-key) for the module; yields (openai client, base URL, tokenizer)."""
    # A context beyond the tiny model's 512 positions (RoPE extends) leaves room for a long streamed answer.
    with engine_server(tiny_model_dir, "--api-key", API_KEY, "--context-length", "2048") as (_, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        yield client, url, AutoTokenizer.from_pretrained(tiny_model_dir)


def native_generate(url: str, body: dict) -> dict:
    response = requests.post(f"{url}/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    response.raise_for_status()
    return response.json()


def engine_call(url: str, method: str, path: str, body: dict | None = None) -> dict:
    response = requests.request(method, f"{url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
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
    # tests/unit/test_tool_calls.py. This checks the request path with tools end to end.
    client, _, _ = engine
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools, temperature=0, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_streaming_reassembles_to_the_non_streamed_answer(engine):
    client, _, _ = engine
    fields = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=10, logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**fields)
    chunks = list(client.chat.completions.create(**fields, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    # One chunk per token as it is sampled, not one at the end.
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [plain.choices[0].finish_reason]
    assert chunks[-1].usage.model_dump() == plain.usage.model_dump()
    streamed_logprobs = [
        e.model_dump() for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert streamed_logprobs == [e.model_dump() for e in plain.choices[0].logprobs.content]

    # Completions: two seeded choices interleave in one stream; each reassembles to its non-streamed twin.
    fields = dict(model="tiny", prompt="the quick", temperature=1, seed=11, n=2, max_tokens=8, logprobs=2)
    completion = client.completions.create(**fields)
    streamed = list(client.completions.create(**fields, stream=True))
    for choice in completion.choices:
        parts = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == choice.index]
        assert "".join(p.text for p in parts) == choice.text
        assert [lp for p in parts if p.logprobs for lp in p.logprobs.token_logprobs] == choice.logprobs.token_logprobs
        assert [o for p in parts if p.logprobs for o in p.logprobs.text_offset] == choice.logprobs.text_offset
        assert [p.finish_reason for p in parts if p.finish_reason] == [choice.finish_reason]


@pytest.mark.reliability("client disconnects in the middle of a streamed answer", "the engine aborts that request")
def test_stream_is_sent_while_generating_and_a_disconnect_aborts_it(engine):
    client, url, _ = engine
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=1500, stream=True
    )
    try:
        first = next(c for c in stream if c.choices and c.choices[0].delta.content)
        # Hold the engine between two decode steps: the request can now end only by an abort.
        engine_call(url, "POST", "/pause_generation", {"mode": "in_place"})
        load = engine_call(url, "GET", "/v1/loads")
        assert load["num_running_reqs"] == 1, f"the answer was complete before its first chunk arrived: {load}"
        assert first.choices[0].finish_reason is None and first.usage is None
        stream.close()
        for _ in range(200):
            if engine_call(url, "GET", "/v1/loads")["num_total_reqs"] == 0:
                break
            time.sleep(0.05)
        assert engine_call(url, "GET", "/v1/loads")["num_total_reqs"] == 0, "the disconnected request kept running"
    finally:
        engine_call(url, "POST", "/continue_generation")


def test_top_logprobs_match_native_generate_and_a_forward_pass(engine, tiny_model_dir):
    client, url, tokenizer = engine
    k, temperature = 3, 0.7
    answer = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=temperature, seed=5, max_tokens=6, logprobs=True, top_logprobs=k
    )
    prompt_ids = chat_prompt_ids(tokenizer, MESSAGES)
    sampling = {"temperature": temperature, "max_new_tokens": 6, "sampling_seed": 5}
    native = native_generate(url, {"input_ids": prompt_ids, "sampling_params": sampling, "return_logprob": True})
    content = answer.choices[0].logprobs.content
    output_ids = native["output_ids"]
    assert [e.token for e in content] == [tokenizer.decode([t]) for t in output_ids]
    assert [e.logprob for e in content] == [lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1 : -1]
    expected = (logits / temperature).log_softmax(dim=-1).topk(k, dim=-1)
    for entry, values, ids in zip(content, expected.values.tolist(), expected.indices.tolist()):
        tops = entry.top_logprobs
        assert len(tops) == k
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].logprob >= entry.logprob
        assert [t.logprob for t in tops] == pytest.approx(values, abs=1e-4)
        assert [t.token for t in tops] == [tokenizer.decode([i]) for i in ids]

    completion = client.completions.create(model="tiny", prompt="the quick", temperature=0, max_tokens=5, logprobs=k)
    native = native_generate(
        url, {"text": "the quick", "sampling_params": {"temperature": 0, "max_new_tokens": 5}, "return_logprob": True}
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs.token_logprobs == [lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]]
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        # Keyed by text: tokens that decode alike (partial UTF-8) share one entry, the most likely one.
        assert 1 <= len(top) <= k and max(top.values()) == chosen  # greedy: the chosen token is the top one


def test_sglang_fields_forwarded_by_the_router_are_honoured(engine):
    client, _, _ = engine
    greedy = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=8)
    top1 = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=1, seed=3, max_tokens=8, extra_body={"top_k": 1}
    )
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"top_k": 0})
    _assert_openai_error(caught.value, 400, "top_k")


def test_settled_text_holds_back_what_may_still_change():
    assert _settled_text("abc\ufffd", [], False) == "abc"  # half a UTF-8 character
    assert _settled_text("say ST", ["STOP"], False) == "say "  # may grow into the stop string
    assert _settled_text("say SX", ["STOP"], False) == "say SX"
    assert _settled_text("ok <tool_call>{", ["<tool_call>"], True) == "ok"
    assert _settled_text("ok <tool", ["<tool_call>"], True) == "ok"


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


@pytest.mark.reliability(
    "OpenAI chat request with temperature -1, n=0, top_logprobs 21 or top_logprobs without logprobs",
    "400 naming the field",
)
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_sampling_fields_are_bad_requests(engine, fields, param):
    client, _, _ = engine
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **fields)
    _assert_openai_error(caught.value, 400, param)


@pytest.mark.reliability("OpenAI completion asking for logprobs 21", "400 in OpenAI's error shape, param 'logprobs'")
def test_completion_logprobs_over_20_is_a_bad_request(engine):
    client, _, _ = engine
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="the quick", max_tokens=2, logprobs=21)
    _assert_openai_error(caught.value, 400, "logprobs")


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
