"""The real `openai` client against sglang-router's /v1, in front of one real CPU engine, as with SGLang.

What sglang-router 0.3.2 does with /v1 (measured here):
- /v1/chat/completions is parsed and validated by the router, then re-serialized: unknown fields are
  dropped, `max_tokens` becomes `max_completion_tokens`, and SGLang's own fields are filled in
  (`ignore_eos`, `skip_special_tokens`, `no_stop_trim`, `separate_reasoning`, ...). A request the router
  finds invalid (top_logprobs > 20, empty messages, ...) is answered by the router itself, in OpenAI's
  error shape but without `param`.
- /v1/completions is forwarded with SGLang's fields added and unknown ones kept; the engine validates it.
- Streamed answers are relayed chunk by chunk; a client that disconnects makes the router drop its
  connection to the engine when the next chunk comes, which aborts the request there.
"""

import time

import openai
import pytest
import requests
from support.engines import engine_server, router_args, router_for

MESSAGES = [{"role": "user", "content": "What is 12 + 34?"}]


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir):
    # Room for a long answer (the tiny model's RoPE extends past its 512 positions).
    with engine_server(tiny_model_dir, "--context-length", "4096") as (_, url):
        yield url


@pytest.fixture(scope="module")
def router_url(engine_url, tmp_path_factory):
    with router_for([engine_url], router_args(tmp_path_factory.mktemp("router_logs"))) as url:
        yield url


@pytest.fixture(scope="module")
def clients(engine_url, router_url):
    """(through the router, straight to the engine)."""

    def client(url: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

    return client(router_url), client(engine_url)


def engine_load(engine_url: str) -> dict:
    return requests.get(f"{engine_url}/v1/loads", timeout=10).json()


def test_chat_through_the_router_equals_the_engine_answer(clients):
    routed, direct = clients
    fields = dict(model="tiny", messages=MESSAGES, temperature=1, seed=4, n=2, max_tokens=8, logprobs=True)
    via_router = routed.chat.completions.create(**fields, top_logprobs=2)
    at_engine = direct.chat.completions.create(**fields, top_logprobs=2)
    assert [c.message.content for c in via_router.choices] == [c.message.content for c in at_engine.choices]
    assert via_router.usage.model_dump() == at_engine.usage.model_dump()
    for routed_choice, direct_choice in zip(via_router.choices, at_engine.choices):
        assert routed_choice.logprobs.model_dump() == direct_choice.logprobs.model_dump()
        assert all(len(entry.top_logprobs) == 2 for entry in routed_choice.logprobs.content)
    # SGLang's own sampling fields reach the engine too: top_k=1 samples the greedy answer.
    greedy = routed.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=8)
    top1 = routed.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=1, seed=9, max_tokens=8, extra_body={"top_k": 1}
    )
    assert top1.choices[0].message.content == greedy.choices[0].message.content


def test_streamed_chat_through_the_router_arrives_token_by_token(clients, engine_url):
    routed, _ = clients
    plain = routed.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=200)
    # On a loaded machine the engine can finish the 200 tokens between the first chunk and the pause: that attempt
    # shows nothing either way, and the next one is made.
    for _ in range(5):
        stream = routed.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            temperature=0,
            max_tokens=200,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = []
        try:
            for chunk in stream:
                chunks.append(chunk)
                if chunk.choices and chunk.choices[0].delta.content:
                    break
            # The first token reached the client through the router while the engine still generates.
            requests.post(f"{engine_url}/pause_generation", json={"mode": "in_place"}, timeout=30).raise_for_status()
            still_generating = engine_load(engine_url)["num_running_reqs"] == 1
        finally:
            requests.post(f"{engine_url}/continue_generation", timeout=30).raise_for_status()
        chunks += list(stream)
        if still_generating:
            break
    assert still_generating, "in 5 attempts the engine had always finished when the first chunk arrived"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.model_dump() == plain.usage.model_dump()


def test_completions_through_the_router(clients):
    routed, direct = clients
    fields = dict(model="tiny", prompt="the quick", temperature=0, max_tokens=6, logprobs=2)
    via_router = routed.completions.create(**fields)
    assert via_router.choices[0].text == direct.completions.create(**fields).choices[0].text
    assert (
        via_router.choices[0].logprobs.model_dump()
        == direct.completions.create(**fields).choices[0].logprobs.model_dump()
    )
    streamed = list(routed.completions.create(**fields, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == via_router.choices[0].text
    assert len(streamed) > 1


@pytest.mark.reliability(
    "client disconnects from a streamed answer relayed by sglang-router",
    "the router drops its engine connection at the next chunk and the engine aborts the request",
)
def test_disconnect_through_the_router_aborts_the_request(clients, engine_url):
    routed, _ = clients
    # 3000 tokens take ~10 s here; an abort ends the request within a fraction of a second.
    stream = routed.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=3000, stream=True
    )
    next(c for c in stream if c.choices and c.choices[0].delta.content)
    assert engine_load(engine_url)["num_total_reqs"] == 1
    stream.close()
    deadline = time.monotonic() + 5
    while engine_load(engine_url)["num_total_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_load(engine_url)["num_total_reqs"] == 0, "the engine kept generating for a client that left"


@pytest.mark.reliability(
    "OpenAI chat request with top_logprobs 21 sent to sglang-router",
    "the router answers 400 itself, in OpenAI's error shape without 'param'",
)
def test_router_refuses_an_invalid_chat_request_itself(clients):
    routed, _ = clients
    with pytest.raises(openai.BadRequestError) as caught:
        routed.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=21)
    error = caught.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and "top_logprobs" in error["message"]
