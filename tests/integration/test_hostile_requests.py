"""Small hostile requests against one CPU engine process (with --api-key): each gets a fast, clear 4xx, /health
keeps answering, and the engine serves the next ordinary request as before."""

from __future__ import annotations

import os
import threading
import time

import openai
import pytest
import requests
import torch
from safetensors.torch import save_file
from support.engines import engine_server

from slime.backends.cpu_engine.engine import CpuEngine
from slime.backends.cpu_engine.protocol import GenerationRequest
from slime.backends.cpu_engine.sampling import SamplingParams
from slime.utils.weight_transport import serialize_named_tensors

API_KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HEALTH_TIMEOUT = 5.0  # a blocked event loop answered after 17-27 s before the fixes


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    with engine_server(tiny_model_dir, "--api-key", API_KEY) as (_, url):
        yield url


class HealthWatch(threading.Thread):
    """Probes /health every 50 ms while a hostile request is handled; records every probe that failed."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop, self.failures, self.probes = url, threading.Event(), [], 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                requests.get(f"{self.url}/health", timeout=HEALTH_TIMEOUT).raise_for_status()
            except requests.RequestException as error:
                self.failures.append(repr(error))
            self.probes += 1
            time.sleep(0.05)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join()


def ordinary_request_works(url: str) -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
    response = requests.post(f"{url}/generate", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["output_ids"]) == 2


@pytest.mark.reliability(
    "amplification: /v1/completions with 6000 one-token prompts and n=128 (a 30 KB body asking for 768k generations)",
    "400 naming the product and --max-queued-requests before anything is built; /health answers throughout",
)
def test_a_call_asking_for_more_generations_than_the_queue_holds_is_refused_before_building(url):
    body = {"model": "m", "prompt": [[5]] * 6000, "n": 128, "max_tokens": 1}
    with HealthWatch(url) as watch:
        response = requests.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "768000 generations (6000 prompts x n=128)" in message and "--max-queued-requests" in message
    assert watch.probes and not watch.failures
    ordinary_request_works(url)


@pytest.mark.reliability(
    "sampling_params.top_k = 10**20 (and max_new_tokens = 10**20) on /generate and /v1/chat/completions",
    "400 naming the field and its range (it used to pass validation and fail every request of the batch with 500)",
)
def test_numeric_fields_out_of_range_get_400_naming_the_field(url):
    for field in ("top_k", "max_new_tokens", "min_new_tokens"):
        body = {"input_ids": [5, 6], "sampling_params": {field: 10**20}}
        response = requests.post(f"{url}/generate", json=body, headers=AUTH, timeout=30)
        assert response.status_code == 400, (field, response.text)
        assert f"sampling_params.{field} must be" in response.text and "2147483647" in response.text
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError, match="top_k"):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1, extra_body={"top_k": 10**20}
        )
    # A top_k past the vocabulary keeps every token, as it says: no error.
    body = {"input_ids": [5, 6], "sampling_params": {"top_k": 10**6, "max_new_tokens": 1}}
    assert requests.post(f"{url}/generate", json=body, headers=AUTH, timeout=30).status_code == 200


@pytest.mark.reliability(
    "a request whose sampling fails inside the engine's batch (parameters no validation catches), next to an "
    "ordinary one",
    "only that request ends, with the error; the ordinary one in the same batch finishes its tokens",
)
def test_a_failure_inside_a_batch_fails_only_its_own_request(tiny_model_dir):
    engine = CpuEngine(str(tiny_model_dir))
    done = threading.Event()
    finished: list[GenerationRequest] = []

    def on_finish(request: GenerationRequest) -> None:
        finished.append(request)
        if len(finished) == 2:
            done.set()

    def request(rid: str, params: SamplingParams) -> GenerationRequest:
        return GenerationRequest(rid=rid, input_ids=[5, 6, 7], params=params, max_new_tokens=4, on_finish=on_finish)

    try:
        # Built directly, past the parser: a top_k torch cannot hold, which fails the batched sampler.
        bad = request("bad", SamplingParams(top_k=10**20, temperature=1.0, max_new_tokens=4))
        good = request("good", SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
        engine.submit([bad, good])
        assert done.wait(120), "the engine did not finish both requests"
    finally:
        engine.shutdown()
    assert bad.error and "sampling failed" in bad.error, bad.error
    assert good.error is None and len(good.output_ids) == 4


@pytest.mark.reliability(
    "8 MiB of text to /generate sent chunked (no Content-Length), and 6 MiB to /v1/completions and "
    "/v1/chat/completions",
    "400 saying the text cannot fit the context, decided from its length before tokenizing; the body is parsed off "
    "the event loop, so /health answers throughout",
)
def test_text_too_long_for_the_context_is_refused_before_tokenizing(url):
    def chunked(body: bytes):
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)]

    text = "word " * (8 * 2**20 // 5)
    body = ('{"text": "' + text + '", "sampling_params": {"max_new_tokens": 1}}').encode()
    with HealthWatch(url) as watch:
        response = requests.post(f"{url}/generate", data=chunked(body), headers=AUTH, timeout=120)
        assert response.status_code == 400, response.text[:300]
        assert "text has 8388605 characters" in response.text and "past the context length" in response.text
        big = "word " * (6 * 2**20 // 5)
        for path, payload in (
            ("/v1/completions", {"model": "m", "prompt": big, "max_tokens": 1}),
            ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": big}], "max_tokens": 1}),
        ):
            response = requests.post(f"{url}{path}", json=payload, headers=AUTH, timeout=120)
            assert response.status_code == 400 and "past the context length" in response.text, (path, response.text)
    assert watch.probes and not watch.failures, watch.failures
    ordinary_request_works(url)


@pytest.mark.reliability(
    "a lone UTF-16 surrogate (\\ud800) in /generate text or a chat message, and 'tool_calls': 5 in a chat message",
    "400 naming what is wrong (they were 500s)",
)
def test_lone_surrogates_and_malformed_tool_calls_get_400(url):
    cases = [
        ("/generate", b'{"text": "a \\ud800 b", "sampling_params": {"max_new_tokens": 1}}', "lone UTF-16 surrogate"),
        (
            "/v1/chat/completions",
            b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x\\udfff"}]}',
            "lone UTF-16 surrogate",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "m", "max_tokens": 1, "messages": [{"role": "assistant", "content": "", "tool_calls": 5}]}',
            "tool_calls must be a list",
        ),
    ]
    for path, body, expected in cases:
        response = requests.post(f"{url}{path}", data=body, headers=AUTH | {"Content-Type": "application/json"})
        assert response.status_code == 400 and expected in response.text, (path, response.status_code, response.text)
    # A surrogate pair is a real character (an emoji): accepted.
    pair = b'{"text": "\\ud83d\\ude00", "sampling_params": {"max_new_tokens": 1}}'
    assert requests.post(f"{url}/generate", data=pair, headers=AUTH).status_code == 200


def greedy_ids(url: str) -> list[int]:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    response = requests.post(f"{url}/generate", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def load_from_disk(url: str, folder) -> requests.Response:
    return requests.post(f"{url}/update_weights_from_disk", json={"model_path": str(folder)}, headers=AUTH, timeout=60)


@pytest.mark.reliability(
    "/update_weights_from_disk of a folder holding a FIFO named a.safetensors, a text file named b.safetensors, or a "
    "valid file beside one whose tensor is all NaN",
    "400 naming the file (the FIFO froze the whole engine, the text file was a 500, the NaN tensor was applied); "
    "the model is unchanged and /health answers throughout",
)
def test_disk_updates_read_only_regular_safetensors_files_and_refuse_non_finite_weights(url, tmp_path):
    before = greedy_ids(url)
    fifo_folder, junk_folder, nan_folder = (tmp_path / name for name in ("fifo", "junk", "nan"))
    for folder in (fifo_folder, junk_folder, nan_folder):
        folder.mkdir()
    os.mkfifo(fifo_folder / "a.safetensors")
    (junk_folder / "b.safetensors").write_text("not a safetensors file")
    # The first file alone would change the answers; the second holds NaN: all or nothing.
    save_file({"model.norm.weight": torch.zeros(64)}, nan_folder / "a.safetensors")
    save_file({"model.embed_tokens.weight": torch.full((320, 64), float("nan"))}, nan_folder / "b.safetensors")
    expected = {fifo_folder: "are not regular files", junk_folder: "is not a readable safetensors file",
                nan_folder: "NaN or infinite values in ['model.embed_tokens.weight']"}  # fmt: skip
    with HealthWatch(url) as watch:
        for folder, message in expected.items():
            response = load_from_disk(url, folder)
            assert response.status_code == 400 and message in response.text, (folder.name, response.text)
    assert watch.probes and not watch.failures, watch.failures
    assert greedy_ids(url) == before


def test_tensor_updates_refuse_non_finite_weights_and_change_nothing(url):
    before = greedy_ids(url)
    good = serialize_named_tensors([("model.norm.weight", torch.zeros(64))])
    bad = serialize_named_tensors([("lm_head.weight", torch.full((320, 64), float("inf")))])
    response = requests.post(
        f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": [good, bad]}, headers=AUTH, timeout=60
    )
    assert response.status_code == 400 and "NaN or infinite values in ['lm_head.weight']" in response.text
    assert greedy_ids(url) == before


@pytest.mark.reliability(
    "/init_weights_update_group naming a listener that accepts no connection, with timeout 2",
    "an error naming the group, the address and the timeout after about 2 s (it used to wait for ever); /health "
    "answers throughout",
)
def test_a_weight_group_join_ends_at_its_timeout(url):
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # never accept()ed
    body = {"master_address": "127.0.0.1", "master_port": listener.getsockname()[1], "rank_offset": 1,
            "world_size": 2, "group_name": "stalled", "backend": "gloo", "timeout": 2}  # fmt: skip
    try:
        with HealthWatch(url) as watch:
            response = requests.post(f"{url}/init_weights_update_group", json=body, headers=AUTH, timeout=60)
    finally:
        listener.close()
    assert response.status_code == 500, response.text
    assert "could not join weight update group 'stalled'" in response.text and "within 2s" in response.text
    assert watch.probes and not watch.failures
