"""The CPU engine over HTTP: SGLang response shapes, log-probs, sampling controls, batching,
abort/pause, weight updates (tensor, gloo broadcast, disk) and memory release.

Expected values come from a second, naive implementation here: the same checkpoint loaded
with transformers and run one full forward per token, no KV cache, no batching.
"""

from __future__ import annotations

import base64
import copy
import http.client
import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
import torch.distributed as dist
from support.engines import engine_server
from support.tiny_model import build_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime.backends.cpu_engine import ServerArgs, launch_server
from slime.backends.cpu_engine.engine import CpuEngine
from slime.backends.cpu_engine.protocol import GenerationRequest
from slime.backends.cpu_engine.sampling import SamplingParams
from slime.utils.http_utils import find_free_port
from slime.utils.weight_transport import init_process_group_like_sglang, serialize_named_tensors

PROMPT_IDS = [264, 224, 303, 296, 272]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with engine_server(tiny_model_dir, "--max-running-requests", "16") as (_, url):
        yield url


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def restore_weights(server, tiny_model_dir):
    """Put the original checkpoint back after a test that changes the engine's weights."""
    yield
    response = requests.post(f"{server}/update_weights_from_disk", json={"model_path": str(tiny_model_dir)})
    assert response.status_code == 200, response.text


def generate(url: str, input_ids=None, text=None, timeout: float = 120, **fields) -> requests.Response:
    body = {"input_ids": input_ids} if text is None else {"text": text}
    return requests.post(f"{url}/generate", json={**body, **fields}, timeout=timeout)


def generate_ok(url: str, input_ids=None, **fields) -> dict:
    response = generate(url, input_ids, **fields)
    assert response.status_code == 200, response.text
    return response.json()


def greedy(url: str, input_ids, max_new_tokens: int = 12, rid: str | None = None, **params) -> dict:
    sampling = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **params}
    return generate_ok(url, input_ids, sampling_params=sampling, return_logprob=True, rid=rid)


@torch.no_grad()
def teacher_forced_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of each output token, from one forward over prompt + output."""
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    log_probs = (logits / temperature).log_softmax(-1)
    return log_probs.gather(-1, torch.tensor(output).unsqueeze(-1)).squeeze(-1).tolist()


@torch.no_grad()
def naive_greedy(model, prompt, steps, banned_before=0, banned=(), stop_ids=()) -> list[int]:
    """Greedy decoding with a full forward per token; `banned` tokens are masked for the first `banned_before`."""
    ids, out = list(prompt), []
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1]
        if len(out) < banned_before:
            logits[list(banned)] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if len(out) >= banned_before and token in stop_ids:
            break
    return out


# ---------------------------------------------------------------- response shape and log-probs


def test_generate_response_matches_the_sglang_contract(server, tokenizer):
    text = "the quick brown fox"
    by_text = generate_ok(
        server,
        text=text,
        rid="req-text",
        sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        return_logprob=True,
    )
    input_ids = tokenizer.encode(text)
    by_ids = greedy(server, input_ids, max_new_tokens=6)

    assert set(by_text) == {"text", "output_ids", "meta_info"}
    meta = by_text["meta_info"]
    assert set(meta) == {
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "weight_version",
        "e2e_latency",
        "output_token_logprobs",
    }
    assert meta["id"] == "req-text"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(input_ids)
    assert meta["completion_tokens"] == len(by_text["output_ids"]) == 6
    assert meta["cached_tokens"] == 0
    assert isinstance(meta["weight_version"], str)
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] > 0
    assert [item[1] for item in meta["output_token_logprobs"]] == by_text["output_ids"]
    assert all(
        isinstance(lp, float) and lp <= 0 and text_slot is None for lp, _, text_slot in meta["output_token_logprobs"]
    )
    assert by_text["text"] == tokenizer.decode(by_text["output_ids"], skip_special_tokens=True)
    # Text and its token ids are the same prompt.
    assert by_ids["output_ids"] == by_text["output_ids"]
    # Without return_logprob there are no log-probs; with return_text_in_logprobs the third slot is the token text.
    plain = generate_ok(server, input_ids, sampling_params={"temperature": 0, "max_new_tokens": 2})
    assert "output_token_logprobs" not in plain["meta_info"]
    with_text = generate_ok(
        server, input_ids, sampling_params={"temperature": 0, "max_new_tokens": 2}, return_logprob=True,
        return_text_in_logprobs=True,
    )  # fmt: skip
    assert [t for _, _, t in with_text["meta_info"]["output_token_logprobs"]] == [
        tokenizer.decode([token]) for token in with_text["output_ids"]
    ]


def test_batch_request_returns_a_list(server):
    single = [greedy(server, ids, max_new_tokens=4) for ids in ([5, 6, 7], [8, 9])]
    batch = generate_ok(
        server,
        [[5, 6, 7], [8, 9]],
        rid="batch",
        sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
    )
    assert [r["meta_info"]["id"] for r in batch] == ["batch_0", "batch_1"]
    assert [r["output_ids"] for r in batch] == [r["output_ids"] for r in single]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_logprobs_equal_teacher_forced_forward(server, ref_model, temperature):
    response = generate_ok(
        server,
        PROMPT_IDS,
        sampling_params={"temperature": temperature, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 11},
        return_logprob=True,
    )
    output = response["output_ids"]
    reported = [lp for lp, _, _ in response["meta_info"]["output_token_logprobs"]]
    expected = teacher_forced_logprobs(ref_model, PROMPT_IDS, output, temperature or 1.0)
    assert max(abs(a - b) for a, b in zip(reported, expected)) < 1e-4
    if temperature == 0.0:
        assert output == naive_greedy(ref_model, PROMPT_IDS, 16)


def test_top_p_samples_inside_the_nucleus_but_reports_full_distribution_logprobs(server, ref_model):
    temperature, top_p = 0.7, 0.5
    response = generate_ok(
        server,
        PROMPT_IDS,
        sampling_params={"temperature": temperature, "top_p": top_p, "max_new_tokens": 12, "ignore_eos": True},
        return_logprob=True,
    )
    output = response["output_ids"]
    with torch.no_grad():
        logits = ref_model(torch.tensor([PROMPT_IDS + output])).logits[0, len(PROMPT_IDS) - 1 : -1]
    for step, token in enumerate(output):
        probs = (logits[step] / temperature).softmax(-1)
        # The nucleus: most likely tokens until the mass before a token reaches top_p.
        order = probs.argsort(descending=True).tolist()
        nucleus, mass = [], 0.0
        for candidate in order:
            if mass >= top_p:
                break
            nucleus.append(candidate)
            mass += probs[candidate].item()
        assert token in nucleus
    reported = [lp for lp, _, _ in response["meta_info"]["output_token_logprobs"]]
    expected = teacher_forced_logprobs(ref_model, PROMPT_IDS, output, temperature)
    assert max(abs(a - b) for a, b in zip(reported, expected)) < 1e-4


def test_input_token_logprobs_for_scoring(server, ref_model):
    sequence = PROMPT_IDS + [40, 41, 42]
    response = generate_ok(
        server,
        sequence,
        sampling_params={"temperature": 0, "max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    meta = response["meta_info"]
    assert response["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"]["type"] == "length"
    entries = meta["input_token_logprobs"]
    assert [token for _, token, _ in entries] == sequence and entries[0][0] is None
    expected = teacher_forced_logprobs(ref_model, sequence[:1], sequence[1:])
    assert max(abs(lp - e) for (lp, _, _), e in zip(entries[1:], expected)) < 1e-4


def test_sampling_seed_makes_sampling_reproducible(server):
    def sample(seed):
        params = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": seed}
        return generate_ok(server, PROMPT_IDS, sampling_params=params)["output_ids"]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


# ---------------------------------------------------------------- stopping


def test_max_new_tokens_finishes_with_length(server):
    response = greedy(server, PROMPT_IDS, max_new_tokens=5)
    assert response["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert response["meta_info"]["completion_tokens"] == 5


def test_stop_token_ids_finish_with_stop_and_trim_text(server, tokenizer):
    full = greedy(server, PROMPT_IDS, max_new_tokens=12)["output_ids"]
    stop_at = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    stop_token = full[stop_at]
    response = greedy(server, PROMPT_IDS, max_new_tokens=12, ignore_eos=False, stop_token_ids=[stop_token])
    assert response["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    assert response["output_ids"] == full[: stop_at + 1]
    assert response["text"] == tokenizer.decode(full[:stop_at], skip_special_tokens=True)
    kept = greedy(
        server, PROMPT_IDS, max_new_tokens=12, ignore_eos=False, stop_token_ids=[stop_token], no_stop_trim=True
    )
    assert kept["text"] == tokenizer.decode(full[: stop_at + 1], skip_special_tokens=True)


def test_stop_string_finishes_with_stop_and_cuts_text(server, tokenizer):
    full = greedy(server, PROMPT_IDS, max_new_tokens=16)["output_ids"]
    # A stop string from the middle of the output: the printable text of one output token.
    candidates = [i for i in range(3, len(full)) if tokenizer.decode([full[i]]).strip().isascii()]
    candidates = [i for i in candidates if tokenizer.decode([full[i]]).strip().isprintable()]
    index = next(i for i in candidates if tokenizer.decode([full[i]]).strip())
    stop = tokenizer.decode([full[index]]).strip()
    # Naive expectation: the first prefix whose decoded text contains the stop string.
    steps = next(n for n in range(1, len(full) + 1) if stop in tokenizer.decode(full[:n]))
    decoded = tokenizer.decode(full[:steps], skip_special_tokens=True)

    response = greedy(server, PROMPT_IDS, max_new_tokens=16, stop=stop)
    assert response["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert response["output_ids"] == full[:steps]
    assert response["text"] == decoded[: decoded.index(stop)]
    kept = greedy(server, PROMPT_IDS, max_new_tokens=16, stop=[stop, "never-there"], no_stop_trim=True)
    assert kept["text"] == decoded


def test_min_new_tokens_masks_stop_tokens_until_reached(server, ref_model):
    first = greedy(server, PROMPT_IDS, max_new_tokens=1)["output_ids"][0]
    params = {"ignore_eos": False, "stop_token_ids": [first], "min_new_tokens": 4}
    response = greedy(server, PROMPT_IDS, max_new_tokens=20, **params)
    expected = naive_greedy(
        ref_model, PROMPT_IDS, 20, banned_before=4, banned=[first, ref_model.config.eos_token_id],
        stop_ids=[first, ref_model.config.eos_token_id],
    )  # fmt: skip
    assert response["output_ids"] == expected
    assert response["meta_info"]["completion_tokens"] >= 4
    assert first not in response["output_ids"][:4]


# ---------------------------------------------------------------- batching, abort, pause


def test_concurrent_requests_are_batched_and_equal_their_solo_results(server):
    # pairs of identical prompts (prefilled once per pair when they start together)
    prompts = [PROMPT_IDS[: 1 + (i // 2) % 5] + [10 + i // 2] * ((i // 2) % 3) for i in range(8)]
    lengths = [6 + 3 * (i % 4) for i in range(8)]
    solo = [greedy(server, p, max_new_tokens=n) for p, n in zip(prompts, lengths)]

    # All eight wait behind a pause, so they start as one batch.
    requests.post(f"{server}/pause_generation", json={"mode": "in_place"}).raise_for_status()
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(greedy, server, p, n) for p, n in zip(prompts, lengths)]
        deadline = time.time() + 30
        while requests.get(f"{server}/v1/loads").json()["num_waiting_reqs"] < 8:
            assert time.time() < deadline
            time.sleep(0.05)
        requests.post(f"{server}/continue_generation").raise_for_status()
        together = [f.result() for f in futures]
    # Staggered arrivals join a running batch (its cache is merged with theirs).
    with ThreadPoolExecutor(8) as pool:
        futures = []
        for p, n in zip(prompts, lengths):
            futures.append(pool.submit(greedy, server, p, n))
            time.sleep(0.003)
        staggered = [f.result() for f in futures]

    for expected, *got in zip(solo, together, staggered):
        for response in got:
            assert response["output_ids"] == expected["output_ids"]
            pairs = zip(response["meta_info"]["output_token_logprobs"], expected["meta_info"]["output_token_logprobs"])
            assert max(abs(a[0] - b[0]) for a, b in pairs) < 1e-4


def test_merged_and_shrunk_batches_decode_like_single_sequences(ref_model):
    """Cache merging (continuous batching) and row dropping, checked against full forwards."""
    from slime.backends.cpu_engine import batch as batching
    from slime.backends.cpu_engine.protocol import GenerationRequest
    from slime.backends.cpu_engine.sampling import SamplingParams

    long_prompt = [(7 * i) % 300 for i in range(90)]  # leaves 80+ padding columns behind when dropped
    prompts = [PROMPT_IDS, long_prompt, [5, 6], PROMPT_IDS[:3] + [40]]
    expected = [naive_greedy(ref_model, p, 10) for p in prompts]
    produced: dict[int, list[int]] = {i: [] for i in range(4)}

    def take_greedy(batch, logits, rows):
        tokens = logits.argmax(-1)
        batch.last_tokens = tokens
        for row, index in enumerate(rows):
            produced[index].append(int(tokens[row]))

    def requests_for(indices):
        return [GenerationRequest(rid=str(i), input_ids=prompts[i], params=SamplingParams()) for i in indices]

    running, logits = batching.prefill(ref_model, requests_for([0, 1]), pad_id=0)
    rows = [0, 1]
    take_greedy(running, logits, rows)
    for _ in range(3):
        take_greedy(running, batching.decode(ref_model, running), rows)
    joining, logits = batching.prefill(ref_model, requests_for([2, 3]), pad_id=0)
    take_greedy(joining, logits, [2, 3])
    running, rows = batching.merge(ref_model, running, joining), rows + [2, 3]
    take_greedy(running, batching.decode(ref_model, running), rows)
    width = running.attention_mask.shape[1]
    running, rows = batching.keep_rows(ref_model, running, [0, 2, 3]), [0, 2, 3]
    assert running.attention_mask.shape[1] < width - 64  # the long prompt's columns were dropped
    for _ in range(4):
        take_greedy(running, batching.decode(ref_model, running), rows)

    for index, tokens in produced.items():
        assert tokens == expected[index][: len(tokens)]
    assert [len(produced[i]) for i in range(4)] == [9, 5, 6, 6]


def _wait_until_running(url: str, count: int = 1) -> None:
    deadline = time.time() + 30
    while requests.get(f"{url}/v1/loads").json()["num_running_reqs"] < count:
        assert time.time() < deadline
        time.sleep(0.01)


def test_abort_returns_partial_output(server):
    long_run = greedy(server, PROMPT_IDS, max_new_tokens=500)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(greedy, server, PROMPT_IDS, 500, rid="long")
        _wait_until_running(server)
        # Freeze it mid-generation so the abort lands at a known state.
        requests.post(f"{server}/pause_generation", json={"mode": "in_place"}).raise_for_status()
        abort = requests.post(f"{server}/abort_request", json={"rid": "long"})
        response = future.result(timeout=30)
    requests.post(f"{server}/continue_generation").raise_for_status()
    assert abort.status_code == 200
    meta = response["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 500
    assert response["output_ids"] == long_run["output_ids"][: meta["completion_tokens"]]


def test_client_that_disconnects_frees_its_slot(server):
    # Paused, the request can only leave the queue through the disconnect -> abort path.
    requests.post(f"{server}/pause_generation", json={"mode": "in_place"}).raise_for_status()
    try:
        with pytest.raises(requests.Timeout):
            generate(server, PROMPT_IDS, timeout=0.5, sampling_params={"max_new_tokens": 5}, rid="gone")
        deadline = time.time() + 10
        while requests.get(f"{server}/v1/loads").json()["num_total_reqs"]:
            assert time.time() < deadline, "the abandoned request is still queued"
            time.sleep(0.02)
    finally:
        requests.post(f"{server}/continue_generation").raise_for_status()


def test_abort_all_ends_waiting_and_running_requests(server):
    requests.post(f"{server}/pause_generation", json={"mode": "in_place"}).raise_for_status()
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(greedy, server, PROMPT_IDS, 50) for _ in range(3)]
        deadline = time.time() + 30
        while requests.get(f"{server}/v1/loads").json()["num_waiting_reqs"] < 3:
            assert time.time() < deadline
            time.sleep(0.05)
        requests.post(f"{server}/abort_request", json={"abort_all": True}).raise_for_status()
        responses = [f.result(timeout=30) for f in futures]
    requests.post(f"{server}/continue_generation").raise_for_status()
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in responses)
    assert all(r["meta_info"]["completion_tokens"] == 0 for r in responses)
    assert requests.get(f"{server}/v1/loads").json()["num_total_reqs"] == 0


def test_pause_in_place_holds_requests_until_continue(server):
    expected = greedy(server, PROMPT_IDS, max_new_tokens=500)
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(greedy, server, PROMPT_IDS, 500)
        _wait_until_running(server)
        requests.post(f"{server}/pause_generation", json={"mode": "in_place"}).raise_for_status()
        waiting = pool.submit(greedy, server, PROMPT_IDS, 10)
        time.sleep(0.5)
        assert not running.done() and not waiting.done()
        assert requests.get(f"{server}/flush_cache").status_code == 400  # a request is still running
        assert requests.get(f"{server}/health_generate").status_code == 200
        requests.post(f"{server}/continue_generation").raise_for_status()
        assert running.result(timeout=60)["output_ids"] == expected["output_ids"]
        assert waiting.result(timeout=60)["output_ids"] == expected["output_ids"][:10]
    assert requests.get(f"{server}/flush_cache").status_code == 200


def test_pause_abort_mode_aborts_running_and_holds_new_requests(server):
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(greedy, server, PROMPT_IDS, 500)
        _wait_until_running(server)
        requests.post(f"{server}/pause_generation", json={}).raise_for_status()
        aborted = running.result(timeout=30)
        assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
        assert aborted["meta_info"]["completion_tokens"] < 500
        later = pool.submit(greedy, server, PROMPT_IDS, 5)
        time.sleep(0.3)
        assert not later.done()
        requests.post(f"{server}/continue_generation").raise_for_status()
        assert later.result(timeout=30)["meta_info"]["completion_tokens"] == 5


def test_an_abort_pause_returns_after_the_requests_it_aborted_have_ended(tiny_model_dir):
    """A weight push pauses the engines, then flushes their cache, and the flush refuses while requests run. The pause
    (abort mode) must therefore end the running requests before it returns, not at the step after: a fully async
    run's push once failed on `Cache not flushed: 4 request(s) are running` right after the pause."""
    engine = CpuEngine(str(tiny_model_dir))
    gate = threading.Event()
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=500, ignore_eos=True)
        running = [
            GenerationRequest(rid=f"r{i}", input_ids=PROMPT_IDS, params=params, max_new_tokens=500) for i in (0, 1)
        ]
        engine.submit(running)
        deadline = time.time() + 60
        while engine.load()["num_running_reqs"] < 2 or engine.generated_tokens_in_flight() == 0:
            assert time.time() < deadline, engine.load()
            time.sleep(0.01)
        # Hold the worker between two steps, so the pause completes on the worker thread after this test has
        # subscribed: the callback then sees the engine as a flush right after the pause would.
        engine.call(gate.wait)
        paused = engine.pause("abort")
        seen_at_pause: list[dict[str, int]] = []
        paused.add_done_callback(lambda _: seen_at_pause.append(engine.load()))
        gate.set()
        paused.result(timeout=30)
        assert seen_at_pause == [{"num_running_reqs": 0, "num_waiting_reqs": 0, "num_total_reqs": 0}]
        assert all(r.finish_reason["type"] == "abort" and 0 < len(r.output_ids) < 500 for r in running)
    finally:
        gate.set()
        engine.shutdown()


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input_ids": PROMPT_IDS, "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"min_p": 2}}, "min_p"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 100000}}, "max_new_tokens"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 5}}, "min_new_tokens"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"stop_token_ids": [1.5]}}, "stop_token_ids"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"stop": [""]}}, "stop"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"temprature": 1}}, "temprature"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"repetition_penalty": 1.3}}, "repetition_penalty"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"sampling_seed": "x"}}, "sampling_seed"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"sampling_seed": 2**63}}, "sampling_seed"),
        ({"input_ids": PROMPT_IDS, "sampling_params": {"sampling_seed": 2**64}}, "sampling_seed"),  # was a 500
        ({"input_ids": PROMPT_IDS, "sampling_params": {"sampling_seed": -1}}, "sampling_seed"),
        ({"input_ids": PROMPT_IDS, "sampling_params": [1]}, "sampling_params"),
        ({"input_ids": ["a", "b"]}, "input_ids"),
        ({"input_ids": [5, 99999]}, "input_ids"),
        ({"input_ids": []}, "input_ids"),
        ({"sampling_params": {}}, "text"),
        ({"text": "hi", "input_ids": PROMPT_IDS}, "input_ids"),
        ({"input_ids": PROMPT_IDS, "stream": True}, "stream"),
        ({"input_ids": PROMPT_IDS, "image_data": ["x.png"]}, "image_data"),
        ({"input_ids": PROMPT_IDS, "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ],
)
@pytest.mark.reliability(
    "/generate with a bad field (sampling_seed >= 2**63, negative max_new_tokens, top_p 0, typo, ...)",
    "HTTP 400 naming the field",
)
def test_bad_requests_get_400_naming_the_field(server, body, field):
    response = requests.post(f"{server}/generate", json=body)
    assert response.status_code == 400
    assert field in response.json()["error"]["message"]


def test_router_added_fields_are_ignored(server):
    # sglang-router re-serializes requests and adds fields of its own.
    extra = {"model": None, "return_bytes": False, "log_metrics": True, "stream": False, "return_hidden_states": False}
    response = generate_ok(server, PROMPT_IDS, sampling_params={"temperature": 0, "max_new_tokens": 3}, **extra)
    assert response["output_ids"] == greedy(server, PROMPT_IDS, max_new_tokens=3)["output_ids"]


def test_non_json_body_gets_400(server):
    response = requests.post(f"{server}/generate", data=b"{not json")
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


@pytest.mark.reliability(
    "/generate body nested 100000 deep, a 5000-digit integer, or temperature NaN", "HTTP 400 saying why, not 500"
)
def test_bodies_json_cannot_hold_get_400(server):
    bodies = [
        (b"[" * 100_000, "nested too deeply"),
        (b'{"input_ids": [' + b"7" * 5000 + b"]}", "JSON"),
        (b'{"input_ids": [5, 6], "sampling_params": {"temperature": NaN}}', "temperature"),  # Python's json reads NaN
    ]
    for body, words in bodies:
        response = requests.post(f"{server}/generate", data=body)
        assert response.status_code == 400 and words in response.json()["error"]["message"]
    assert requests.get(f"{server}/health", timeout=5).status_code == 200


@pytest.mark.reliability("50 MB POST to /generate", "HTTP 413 naming the limit; /health answers meanwhile")
def test_health_answers_while_a_huge_body_arrives(server):
    # Headers first: the size limit is answered before a byte of the body is read.
    host, port = server.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.putrequest("POST", "/generate")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(50 * 2**20))
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413 and "MiB" in response.read().decode()
    connection.close()

    body = b'{"input_ids": [' + b"1, " * (50 * 2**20 // 3) + b"1]}"  # valid token ids: all of it gets checked
    latencies = []
    with ThreadPoolExecutor(1) as pool:
        upload = pool.submit(requests.post, f"{server}/generate", data=body, timeout=120)
        while not upload.done() or len(latencies) < 5:
            started = time.monotonic()
            assert requests.get(f"{server}/health", timeout=10).status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.05)
        try:
            assert upload.result().status_code == 413
        except requests.ConnectionError:
            pass  # the server may close the connection while the client is still sending
    assert max(latencies) < 1.0, latencies


# ---------------------------------------------------------------- info endpoints


def test_info_endpoints(server, tiny_model_dir):
    assert requests.get(f"{server}/health").status_code == 200
    assert requests.get(f"{server}/health_generate").status_code == 200
    info = requests.get(f"{server}/get_model_info").json()
    assert Path(info["model_path"]).is_absolute()
    assert Path(info["model_path"]) == Path(tiny_model_dir).resolve()
    assert info["is_generation"] is True and isinstance(info["weight_version"], str)
    server_info = requests.get(f"{server}/get_server_info").json()
    assert server_info["max_running_requests"] == 16 and server_info["num_threads"] == 1
    assert server_info["weight_version"] == info["weight_version"]
    assert requests.get(f"{server}/get_weight_version").json() == {"weight_version": info["weight_version"]}
    assert requests.post(f"{server}/flush_cache").status_code == 200


# ---------------------------------------------------------------- weight updates


def _perturbed_state(ref_model, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + 0.3 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in ref_model.state_dict().items()
        if name.endswith("proj.weight") or name == "lm_head.weight"
    }


def _model_with(tiny_model_dir, state: dict[str, torch.Tensor]):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    return model


def _version(url: str) -> str:
    return requests.get(f"{url}/get_weight_version").json()["weight_version"]


def _next_version(version: str) -> str:
    return str(int(version) + 1) if version.isdigit() else "1"


def test_update_weights_from_tensor(server, ref_model, tiny_model_dir, restore_weights):
    before = greedy(server, PROMPT_IDS)["output_ids"]
    state = _perturbed_state(ref_model, seed=1)
    expected = naive_greedy(_model_with(tiny_model_dir, state), PROMPT_IDS, 12)
    assert expected != before
    version = _version(server)

    items = list(state.items())
    buckets = [serialize_named_tensors(items[: len(items) // 2]), serialize_named_tensors(items[len(items) // 2 :])]
    response = requests.post(
        f"{server}/update_weights_from_tensor", json={"serialized_named_tensors": buckets, "flush_cache": True}
    )
    assert response.status_code == 200 and response.json()["success"] is True
    assert _version(server) == _next_version(version)
    after = greedy(server, PROMPT_IDS)
    assert after["output_ids"] == expected
    assert after["meta_info"]["weight_version"] == _next_version(version)

    # An unknown name rejects the whole update and changes nothing.
    bad = serialize_named_tensors([("model.layers.0.mlp.up_proj.weight", items[0][1]), ("no.such.weight", items[0][1])])
    response = requests.post(
        f"{server}/update_weights_from_tensor", json={"serialized_named_tensors": [bad], "weight_version": "x"}
    )
    assert response.status_code == 400 and "no.such.weight" in response.json()["message"]
    assert greedy(server, PROMPT_IDS)["output_ids"] == expected and _version(server) == _next_version(version)


@pytest.mark.reliability(
    "weight update with an integer tensor for a float parameter", "HTTP 400 naming it; no parameter changes"
)
def test_update_with_a_wrong_dtype_changes_nothing(server, ref_model, restore_weights):
    before, version = greedy(server, PROMPT_IDS)["output_ids"], _version(server)
    state = _perturbed_state(ref_model, seed=5)
    name = "model.layers.0.mlp.up_proj.weight"
    # Every other tensor is fine and listed first: a check after the first writes would change them.
    named = [(n, t) for n, t in state.items() if n != name] + [(name, torch.ones_like(state[name], dtype=torch.int64))]
    response = requests.post(
        f"{server}/update_weights_from_tensor", json={"serialized_named_tensors": [serialize_named_tensors(named)]}
    )
    assert response.status_code == 400
    assert "wrong dtypes" in response.json()["message"] and name in response.json()["message"]
    assert greedy(server, PROMPT_IDS)["output_ids"] == before and _version(server) == version


class _TouchesFile:
    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.mark.reliability(
    "/update_weights_from_tensor payload whose pickle runs a shell command", "HTTP 400 naming the global; nothing runs"
)
def test_crafted_pickle_payload_is_refused(server, tmp_path):
    marker = tmp_path / "pwned"
    payload = base64.b64encode(pickle.dumps([("lm_head.weight", _TouchesFile(marker))])).decode("ascii")
    version = _version(server)
    response = requests.post(f"{server}/update_weights_from_tensor", json={"serialized_named_tensors": [payload]})
    assert response.status_code == 400, response.text
    assert "posix.system" in response.json()["message"]
    assert not marker.exists() and _version(server) == version


def test_update_weights_from_distributed_over_gloo(server, ref_model, tiny_model_dir, restore_weights):
    state = _perturbed_state(ref_model, seed=2)
    expected = naive_greedy(_model_with(tiny_model_dir, state), PROMPT_IDS, 12)
    port, group_name = find_free_port(), "test-broadcast"
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(
            requests.post,
            f"{server}/init_weights_update_group",
            json={
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": group_name,
                "backend": "gloo",
            },
        )
        # this process is the trainer
        group = init_process_group_like_sglang("gloo", "127.0.0.1", port, 0, 2, group_name)
        assert joined.result(timeout=60).json()["success"] is True
        names = list(state)
        received = pool.submit(
            requests.post,
            f"{server}/update_weights_from_distributed",
            json={
                "names": names,
                "dtypes": ["float32"] * len(names),
                "shapes": [list(state[n].shape) for n in names],
                "group_name": group_name,
                "weight_version": "step-7",
            },
        )
        for name in names:
            dist.broadcast(state[name].contiguous(), src=0, group=group)
        response = received.result(timeout=60)
        # A rejected update still takes every broadcast (no hang) and changes nothing; a bfloat16 tensor
        # goes through a buffer and is cast into the float32 parameter.
        bad = {names[0]: torch.zeros_like(state[names[0]]), "no.such.weight": torch.zeros(3)}
        rejected = pool.submit(
            requests.post,
            f"{server}/update_weights_from_distributed",
            json={"names": list(bad), "dtypes": ["bfloat16"] * 2, "shapes": [list(t.shape) for t in bad.values()],
                  "group_name": group_name},
        )  # fmt: skip
        for tensor in bad.values():
            dist.broadcast(tensor.to(torch.bfloat16), src=0, group=group)
        rejected = rejected.result(timeout=60)
        dist.destroy_process_group(group)
    assert response.status_code == 200, response.text
    assert rejected.status_code == 400 and "no.such.weight" in rejected.json()["message"]
    after = greedy(server, PROMPT_IDS)
    assert after["output_ids"] == expected and after["meta_info"]["weight_version"] == "step-7"
    assert requests.post(f"{server}/destroy_weights_update_group", json={"group_name": group_name}).json()["success"]
    again = requests.post(f"{server}/destroy_weights_update_group", json={"group_name": group_name})
    assert again.status_code == 400 and "no weight update group" in again.json()["message"]


def test_update_weights_from_disk(server, ref_model, tiny_model_dir, tmp_path, restore_weights):
    original = greedy(server, PROMPT_IDS)["output_ids"]
    state = _perturbed_state(ref_model, seed=3)
    model = _model_with(tiny_model_dir, state)
    model.save_pretrained(tmp_path)
    response = requests.post(f"{server}/update_weights_from_disk", json={"model_path": str(tmp_path)})
    assert response.status_code == 200 and response.json()["success"] is True
    assert greedy(server, PROMPT_IDS)["output_ids"] == naive_greedy(model, PROMPT_IDS, 12) != original
    missing = requests.post(f"{server}/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
    assert missing.status_code == 400 and "nope" in missing.json()["message"]
    requests.post(f"{server}/update_weights_from_disk", json={"model_path": str(tiny_model_dir)}).raise_for_status()
    assert greedy(server, PROMPT_IDS)["output_ids"] == original


# ---------------------------------------------------------------- memory release


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


@pytest.fixture(scope="module")
def larger_model_dir(tmp_path_factory):
    # About 9M parameters (37 MiB): big enough to see the release in the process RSS.
    return build_tiny_model(tmp_path_factory.mktemp("larger"), hidden_size=512, num_layers=4, num_heads=8)


def test_release_and_resume_memory(larger_model_dir):
    with engine_server(larger_model_dir) as (proc, url):
        model = AutoModelForCausalLM.from_pretrained(larger_model_dir, dtype=torch.float32)
        param_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        # Weights that exist only in memory must survive a release: push a perturbation first.
        state = _perturbed_state(model, seed=4)
        expected = naive_greedy(_model_with(larger_model_dir, state), PROMPT_IDS, 8)
        buckets = [serialize_named_tensors(list(state.items()))]
        requests.post(
            f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": buckets}
        ).raise_for_status()
        assert greedy(url, PROMPT_IDS, 8)["output_ids"] == expected

        rss_before = _rss_mib(proc.pid)
        response = requests.post(f"{url}/release_memory_occupation", json={})
        assert response.status_code == 200 and response.json()["success"] is True
        assert rss_before - _rss_mib(proc.pid) > 0.6 * param_mib
        refused = generate(url, PROMPT_IDS)
        assert refused.status_code == 503 and "resume_memory_occupation" in refused.json()["error"]["message"]
        assert requests.get(f"{url}/health").status_code == 200
        assert requests.get(f"{url}/health_generate").status_code == 503

        response = requests.post(f"{url}/resume_memory_occupation", json={"tags": ["weights"]})
        assert response.status_code == 200 and response.json()["success"] is True
        assert greedy(url, PROMPT_IDS, 8)["output_ids"] == expected


def test_release_is_refused_while_requests_are_in_flight(server):
    requests.post(f"{server}/pause_generation", json={"mode": "in_place"}).raise_for_status()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(greedy, server, PROMPT_IDS, 3)
        deadline = time.time() + 30
        while requests.get(f"{server}/v1/loads").json()["num_total_reqs"] < 1:
            assert time.time() < deadline
            time.sleep(0.05)
        response = requests.post(f"{server}/release_memory_occupation", json={})
        assert response.status_code == 400 and "in flight" in response.json()["message"]
        requests.post(f"{server}/continue_generation").raise_for_status()
        assert waiting.result(timeout=30)["meta_info"]["completion_tokens"] == 3


# ---------------------------------------------------------------- in-process entry point


def test_launch_server_in_process(tiny_model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # not the budget below, so that the engine's 1 is its own (scripts/test.sh runs with 1)
    handle = launch_server(ServerArgs(model_path=str(tiny_model_dir), port=0, num_threads=1))
    try:
        assert requests.get(f"{handle.url}/health").status_code == 200
        response = greedy(handle.url, PROMPT_IDS, max_new_tokens=3)
        assert response["meta_info"]["completion_tokens"] == 3
        # The worker thread runs with the thread budget it was given.
        assert handle.engine.call(torch.get_num_threads).result(timeout=30) == 1
    finally:
        handle.stop()
        torch.set_num_threads(threads)
    assert not handle.thread.is_alive()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{handle.url}/health", timeout=2)


@pytest.mark.reliability(
    "a broadcast weight update whose sender fails on the second tensor, or whose last tensor holds NaN",
    "the model is left as it was (every tensor is received and checked before the first parameter is written)",
)
def test_received_weights_land_only_once_every_tensor_arrived_and_is_finite(ref_model):
    from slime.backends.cpu_engine import weights

    model = copy.deepcopy(ref_model)
    targets = weights.weight_targets(model)
    name_fp32, name_bf16 = list(targets)[:2]
    original = {name: targets[name].clone() for name in (name_fp32, name_bf16)}
    sent = {name_fp32: torch.randn(targets[name_fp32].shape), name_bf16: torch.randn(targets[name_bf16].shape)}
    layout = [(name_fp32, torch.float32, tuple(sent[name_fp32].shape)),
              (name_bf16, torch.bfloat16, tuple(sent[name_bf16].shape))]  # fmt: skip

    def sender(second):
        queue = [sent[name_fp32], second]

        def receive(buffer):
            tensor = queue.pop(0)
            if tensor is None:
                raise ConnectionError("the sender died")
            buffer.copy_(tensor)

        return receive

    for second, error in ((None, ConnectionError), (torch.full(sent[name_bf16].shape, float("nan")), ValueError)):
        with pytest.raises(error):
            weights.receive_named_tensors(targets, layout, sender(second))
        assert all(torch.equal(targets[name], original[name]) for name in original)  # nothing written
    weights.receive_named_tensors(targets, layout, sender(sent[name_bf16].to(torch.bfloat16)))
    assert torch.equal(targets[name_fp32], sent[name_fp32])
    assert torch.equal(targets[name_bf16], sent[name_bf16].to(torch.bfloat16).float())
