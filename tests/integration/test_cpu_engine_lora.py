"""LoRA serving on the CPU engine, over HTTP: SGLang's load / unload endpoints and per-request `lora_path`.

Expected values come from peft itself: each adapter is made with `get_peft_model`, saved with `save_pretrained`,
loaded back with `PeftModel.from_pretrained` and run one full forward over the tokens the engine saw.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import threading
import time
from pathlib import Path

import openai
import pytest
import requests
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from support.engines import engine_server
from support.untrusted_payloads import MakesAFolderWhenUnpickled
from transformers import AutoModelForCausalLM

from slime.backends.cpu_engine.server import parse_args
from slime.backends.sglang_utils.http_client import EngineClient
from slime.utils.http_utils import HTTPRequestError
from slime.utils.weight_transport import (
    SHARED_MEMORY_FORMAT,
    release_send_segments,
    serialize_named_tensors,
    stage_named_tensors,
)

PROMPT = [264, 224, 303, 296, 272]
OTHER_PROMPT = [40, 41, 42]
MAX_RANK = 8
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def make_adapter(base_dir: Path, out_dir: Path, seed: int, **config) -> Path:
    """A PEFT LoRA adapter (r=4, alpha=8, all-linear unless `config` says otherwise) with random non-zero lora_B,
    saved to `out_dir`."""
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
        LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **config}),
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: the adapter would change nothing
                torch.nn.init.normal_(param, std=0.5)
    model.save_pretrained(out_dir)
    return out_dir


def peft_model(base_dir: Path, adapter_dir: Path):
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), adapter_dir)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(tiny_model_dir, root / name, seed) for name, seed in (("a1", 1), ("a2", 2))}


@pytest.fixture(scope="module")
def models(tiny_model_dir, adapters) -> dict:
    """adapter name (None: the base model) -> an independent model to check the engine against."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return {None: plain.eval(), **{name: peft_model(tiny_model_dir, path).eval() for name, path in adapters.items()}}


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters):
    """One engine for the module: a1 loaded at start (--lora-paths), a2 through /load_lora_adapter."""
    flags = ["--enable-lora", "--max-lora-rank", str(MAX_RANK), "--max-loras-per-batch", "2"]
    with engine_server(tiny_model_dir, *flags, "--lora-paths", f"a1={adapters['a1']}") as (_, url):
        EngineClient(url).load_lora_adapter("a2", str(adapters["a2"]))
        yield url


def generate(url: str, body: dict) -> requests.Response:
    return requests.post(f"{url}/generate", json=body, timeout=60)


def generate_ok(url: str, body: dict):
    response = generate(url, body)
    assert response.status_code == 200, response.text
    return response.json()


def scored(url: str, prompts: list[list[int]], adapters: list[str | None], max_new_tokens: int = 0, **params) -> list:
    """One /generate batch, one row per (prompt, adapter): input log-probs from position 0, output log-probs."""
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True, **params}
    body = {
        "input_ids": prompts,
        "lora_path": adapters,
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    return generate_ok(url, body)


@torch.no_grad()
def forward_log_probs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of one forward over `tokens`: the log-prob of each token after the first."""
    log_probs = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float().log_softmax(-1)
    return log_probs.gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)


def engine_log_probs(row: dict) -> torch.Tensor:
    """The row's log-prob of every token after the first: prompt then output."""
    meta = row["meta_info"]
    prompt = [lp for lp, _, _ in meta["input_token_logprobs"][1:]]
    return torch.tensor(prompt + [lp for lp, _, _ in meta["output_token_logprobs"]])


def assert_matches(row: dict, prompt: list[int], model) -> None:
    expected = forward_log_probs(model, prompt + row["output_ids"])
    torch.testing.assert_close(engine_log_probs(row), expected, atol=1e-5, rtol=0)


def loaded(url: str) -> dict[str, str]:
    return requests.get(f"{url}/get_server_info", timeout=10).json()["loaded_adapters"]


def assert_refused(response: requests.Response, *words: str) -> None:
    assert response.status_code == 400, response.text
    body = response.json()
    message = body["error_message"] if "error_message" in body else body["error"]["message"]
    for word in words:
        assert word in message, message


# ---------------------------------------------------------------- log-probs under adapters


def test_adapter_log_probs_equal_peft_and_base_rows_equal_the_plain_model(server, models):
    for adapter in ("a1", None):
        [prompt_only] = scored(server, [PROMPT], [adapter])
        assert prompt_only["output_ids"] == []
        assert_matches(prompt_only, PROMPT, models[adapter])
        [sampled] = scored(server, [PROMPT], [adapter], max_new_tokens=10, sampling_seed=7)
        assert len(sampled["output_ids"]) == 10
        assert_matches(sampled, PROMPT, models[adapter])
    # The adapter changes the model: its log-probs are not the base model's.
    assert not torch.allclose(forward_log_probs(models["a1"], PROMPT), forward_log_probs(models[None], PROMPT))


def test_adapter_of_some_modules_with_rslora_equals_peft(server, tiny_model_dir, tmp_path):
    # Leaf-name targets, one of their modules excluded, and rsLoRA's scaling alpha / sqrt(r).
    folder = make_adapter(
        tiny_model_dir,
        tmp_path / "some",
        seed=3,
        target_modules=["q_proj", "v_proj", "down_proj"],
        exclude_modules=["model.layers.1.self_attn.v_proj"],
        use_rslora=True,
    )
    client = EngineClient(server)
    client.load_lora_adapter("some", str(folder))
    try:
        [row] = scored(server, [PROMPT], ["some"], max_new_tokens=6, temperature=0)
        assert_matches(row, PROMPT, peft_model(tiny_model_dir, folder).eval())
    finally:
        client.unload_lora_adapter("some")


def test_one_batch_mixes_two_adapters_and_the_base_model(server, models):
    # The same prompt under three models (prefill must not share their rows) and a shorter prompt under a1.
    prompts = [PROMPT, PROMPT, PROMPT, OTHER_PROMPT]
    names = ["a1", "a2", None, "a1"]
    rows = scored(server, prompts, names, max_new_tokens=8, temperature=0)
    for row, prompt, name in zip(rows, prompts, names):
        assert_matches(row, prompt, models[name])
    assert rows[0]["output_ids"] != rows[1]["output_ids"], "two random adapters gave the same greedy output"


def test_adapter_from_tensors_equals_the_folder_load(server, adapters):
    client = EngineClient(server)
    config = json.loads((adapters["a2"] / CONFIG).read_text())
    tensors = list(load_file(adapters["a2"] / WEIGHTS).items())
    answer = client.load_lora_adapter_from_tensors("a2-tensors", config, serialize_named_tensors(tensors))
    assert answer["success"] and answer["error_message"] == ""
    assert answer["loaded_adapters"]["a2-tensors"] == "a2-tensors"
    client.update_weight_version("lora-1")  # what a trainer sends after each adapter push
    try:
        # Three adapters in one call with --max-loras-per-batch 2: the third waits for a slot, then runs.
        rows = scored(server, [PROMPT] * 3, ["a2", "a2-tensors", "a1"], max_new_tokens=6, temperature=0)
        assert rows[0]["output_ids"] == rows[1]["output_ids"]
        torch.testing.assert_close(engine_log_probs(rows[1]), engine_log_probs(rows[0]), atol=1e-5, rtol=0)
        assert rows[2]["output_ids"] != rows[0]["output_ids"]
        assert {row["meta_info"]["weight_version"] for row in rows} == {"lora-1"}
    finally:
        assert set(client.unload_lora_adapter("a2-tensors")["loaded_adapters"]) == {"a1", "a2"}


def test_server_info_reports_lora(server, adapters):
    info = requests.get(f"{server}/get_server_info", timeout=10).json()
    assert info["lora_enabled"] is True and info["max_loras_per_batch"] == 2
    assert info["loaded_adapters"] == {"a1": str(adapters["a1"]), "a2": str(adapters["a2"])}


def test_adapters_survive_a_weight_update_and_a_memory_release(server, tiny_model_dir, adapters):
    client = EngineClient(server)
    name = "model.layers.0.mlp.down_proj.weight"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    new_weight = base.state_dict()[name] * 1.5
    base.load_state_dict({name: new_weight}, strict=False)
    expected = PeftModel.from_pretrained(base, adapters["a1"]).eval()
    try:
        client.update_weights_from_tensor([serialize_named_tensors([(name, new_weight)])])
        assert_matches(scored(server, [PROMPT], ["a1"])[0], PROMPT, expected)
        client.release_memory_occupation()
        client.resume_memory_occupation()
        assert set(loaded(server)) == {"a1", "a2"}
        assert_matches(scored(server, [PROMPT], ["a1"])[0], PROMPT, expected)
    finally:
        client.update_weights_from_disk(str(tiny_model_dir))


def test_chat_and_completions_take_lora_path_or_model_suffix(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "What is 12 + 34?"}]
    by_field = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=6, extra_body={"lora_path": "a2"}
    )
    by_model = client.chat.completions.create(model="tiny:a2", messages=messages, temperature=0, max_tokens=6)
    base = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6)
    assert by_field.choices[0].message.content == by_model.choices[0].message.content
    assert by_field.choices[0].message.content != base.choices[0].message.content
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, temperature=0, max_tokens=6, extra_body={"lora_path": "a1"}
    )
    native = generate_ok(
        server, {"input_ids": PROMPT, "lora_path": "a1", "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    )
    assert completion.choices[0].text == native["text"]


# ---------------------------------------------------------------- refusals


@pytest.mark.reliability(
    "/generate or /v1/chat/completions naming a LoRA adapter that is not loaded",
    "HTTP 400 naming the loaded adapters; the engine goes on serving",
)
def test_unknown_adapter_is_refused(server):
    response = generate(server, {"input_ids": [PROMPT, PROMPT], "lora_path": ["a1", "nope"]})
    assert_refused(response, "'nope'", "loaded: ['a1', 'a2']", "/load_lora_adapter")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="'nope' is not a loaded adapter"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body={"lora_path": "nope"})
    with pytest.raises(openai.BadRequestError, match="'nope' is not a loaded adapter"):
        client.chat.completions.create(model="tiny:nope", messages=messages, max_tokens=2)
    assert generate_ok(server, {"input_ids": PROMPT, "lora_path": "a1", "sampling_params": {"max_new_tokens": 2}})


def _copy(adapter: Path, folder: Path, config_changes: dict | None = None, tensors=None) -> Path:
    """A copy of `adapter` in `folder`, its config updated with `config_changes`, its tensors replaced by `tensors`."""
    folder.mkdir()
    config = json.loads((adapter / CONFIG).read_text()) | (config_changes or {})
    (folder / CONFIG).write_text(json.dumps(config))
    save_file(tensors if tensors is not None else load_file(adapter / WEIGHTS), folder / WEIGHTS)
    return folder


def _without_one_lora_b(adapter: Path) -> dict:
    tensors = load_file(adapter / WEIGHTS)
    del tensors["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
    return tensors


def _with_nan(adapter: Path) -> dict:
    tensors = load_file(adapter / WEIGHTS)
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"][0, 0] = float("nan")
    return tensors


def _bad_folder(case: str, adapter: Path, tmp_path: Path) -> Path:
    folder = tmp_path / case
    if case == "rank above --max-lora-rank":
        tensors = {
            name: torch.zeros(MAX_RANK + 1, t.shape[1]) if ".lora_A." in name else torch.zeros(t.shape[0], MAX_RANK + 1)
            for name, t in load_file(adapter / WEIGHTS).items()
        }
        return _copy(adapter, folder, {"r": MAX_RANK + 1}, tensors)
    if case == "missing lora_B":
        return _copy(adapter, folder, tensors=_without_one_lora_b(adapter))
    if case == "NaN in lora_A":
        return _copy(adapter, folder, tensors=_with_nan(adapter))
    if case == "DoRA":
        return _copy(adapter, folder, {"use_dora": True})
    if case == "lm_head target":
        return _copy(adapter, folder, {"target_modules": ["q_proj", "lm_head"]})
    if case == "FIFO as adapter_model.safetensors":
        folder.mkdir()
        shutil.copy(adapter / CONFIG, folder / CONFIG)
        os.mkfifo(folder / WEIGHTS)
        return folder
    if case == "pickle adapter_model.bin":
        folder.mkdir()
        shutil.copy(adapter / CONFIG, folder / CONFIG)
        (folder / "adapter_model.bin").write_bytes(pickle.dumps(MakesAFolderWhenUnpickled(str(tmp_path / "pwned"))))
        return folder
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("already loaded name", ["'a1' is already loaded", "unload it first"]),
        ("rank above --max-lora-rank", ["r=9", "--max-lora-rank 8"]),
        ("missing lora_B", ["layers.1.mlp.up_proj.lora_B.weight", "both lora_A and lora_B"]),
        ("NaN in lora_A", ["layers.0.self_attn.q_proj.lora_A.weight", "NaN"]),
        ("DoRA", ["use_dora=True", "DoRA"]),
        ("lm_head target", ["'lm_head'", "no embeddings, no lm_head"]),
        ("FIFO as adapter_model.safetensors", [WEIGHTS, "not a regular file"]),
        ("pickle adapter_model.bin", ["adapter_model.bin", "pickle", "safe_serialization"]),
        ("from tensors: a pickle of another object", ["serialized_tensors", "refusing to unpickle"]),
        ("from tensors: wrong shape", ["lora_A.weight", "shape [4, 63]", "expected [4, 64]"]),
        ("from tensors: not PEFT's names", ["'model.layers.0.self_attn.q_proj.lora_A'", "PEFT"]),
    ],
)
@pytest.mark.reliability(
    "LoRA adapter that is bad: name already loaded, rank above --max-lora-rank, a lora_B missing, NaN, DoRA, an "
    "lm_head target, a FIFO or a pickle as its weights file, a crafted pickle, wrong shapes, unknown tensor names",
    "HTTP 400 naming the problem and the fix; nothing is loaded or unpickled; the engine goes on serving",
)
def test_bad_adapters_are_refused_and_change_nothing(server, adapters, tmp_path, case, words):
    before = loaded(server)
    if case == "already loaded name":
        response = requests.post(
            f"{server}/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(adapters["a2"])}, timeout=30
        )
    elif case.startswith("from tensors"):
        config = json.loads((adapters["a1"] / CONFIG).read_text())
        tensors = list(load_file(adapters["a1"] / WEIGHTS).items())
        q = next(i for i, (name, _) in enumerate(tensors) if name.endswith("layers.0.self_attn.q_proj.lora_A.weight"))
        if case.endswith("pickle of another object"):
            payload = base64.b64encode(pickle.dumps(MakesAFolderWhenUnpickled(str(tmp_path / "pwned")))).decode()
        elif case.endswith("wrong shape"):
            tensors[q] = (tensors[q][0], tensors[q][1][:, :-1])
            payload = serialize_named_tensors(tensors)
        else:
            tensors[q] = (tensors[q][0].removeprefix("base_model.model.").removesuffix(".weight"), tensors[q][1])
            payload = serialize_named_tensors(tensors)
        response = requests.post(
            f"{server}/load_lora_adapter_from_tensors",
            json={"lora_name": "bad", "config_dict": config, "serialized_tensors": payload, "load_format": None},
            timeout=30,
        )
    else:
        folder = _bad_folder(case, adapters["a1"], tmp_path)
        response = requests.post(
            f"{server}/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(folder)}, timeout=30
        )
    assert_refused(response, *words)
    assert response.json()["success"] is False and response.json()["loaded_adapters"] == before
    assert loaded(server) == before
    assert not (tmp_path / "pwned").exists()
    assert generate_ok(server, {"input_ids": PROMPT, "lora_path": "a1", "sampling_params": {"max_new_tokens": 2}})


@pytest.mark.reliability(
    "LoRA adapter targeting a module outside --lora-target-modules; --max-lora-rank 0 or --lora-target-modules "
    "without --enable-lora",
    "HTTP 400 naming the module and the flag; bad flags refused at startup naming flag and value",
)
def test_lora_flags_bound_what_loads(tiny_model_dir, adapters, capsys):
    for argv, words in (
        (["--enable-lora", "--max-lora-rank", "0"], "--max-lora-rank must be >= 1, got 0"),
        (["--enable-lora", "--max-loras-per-batch", "0"], "--max-loras-per-batch must be >= 1, got 0"),
        (["--lora-target-modules", "q_proj"], "--lora-target-modules only apply with --enable-lora"),
        (["--enable-lora", "--lora-paths", "=x"], "'=x' must be NAME=PATH or PATH"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--model-path", str(tiny_model_dir), *argv])
        assert words in capsys.readouterr().err
    with engine_server(tiny_model_dir, "--enable-lora", "--lora-target-modules", "q_proj", "v_proj") as (_, url):
        response = requests.post(
            f"{url}/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(adapters["a1"])}, timeout=30
        )
        assert_refused(response, "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'up_proj']", "--lora-target-modules")
        assert loaded(url) == {}
        assert generate_ok(url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})


@pytest.mark.reliability(
    "LoRA load / unload or a request with lora_path on an engine started without --enable-lora",
    "HTTP 400 saying to start the engine with --enable-lora",
)
def test_engine_without_enable_lora_refuses_lora(tiny_model_dir, adapters):
    with engine_server(tiny_model_dir) as (_, url):
        bodies = {
            "load_lora_adapter": {"lora_name": "a1", "lora_path": str(adapters["a1"])},
            "load_lora_adapter_from_tensors": {"lora_name": "a1", "config_dict": {}, "serialized_tensors": ""},
            "unload_lora_adapter": {"lora_name": "a1"},
        }
        for endpoint, body in bodies.items():
            assert_refused(requests.post(f"{url}/{endpoint}", json=body, timeout=30), "--enable-lora")
        assert_refused(generate(url, {"input_ids": PROMPT, "lora_path": "a1"}), "lora_path", "--enable-lora")
        info = requests.get(f"{url}/get_server_info", timeout=10).json()
        assert info["lora_enabled"] is False and info["loaded_adapters"] == {}
        assert generate_ok(url, {"input_ids": PROMPT, "lora_path": None, "sampling_params": {"max_new_tokens": 2}})


# ---------------------------------------------------------------- unload


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)))
    thread.start()
    return thread, result


def _wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.reliability(
    "LoRA adapter unloaded while requests that use it run or wait",
    "they end with finish_reason abort; requests of other adapters go on; later requests naming it get HTTP 400",
)
def test_unload_aborts_the_requests_that_use_it(server, adapters):
    client = EngineClient(server)
    client.load_lora_adapter("doomed", str(adapters["a2"]))
    long = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}
    state = lambda: requests.get(f"{server}/get_server_info", timeout=10).json()["internal_states"][0]  # noqa: E731

    running, running_result = _in_thread(
        generate_ok, server, {"input_ids": PROMPT, "lora_path": "doomed", "sampling_params": long}
    )
    other, other_result = _in_thread(
        generate_ok, server, {"input_ids": PROMPT, "lora_path": "a1", "sampling_params": long}
    )
    # Both admitted and decoding: under load the second may still be queued after the first's tokens.
    _wait_for(lambda: (lambda s: s["num_running_reqs"] == 2 and s["num_generated_tokens_in_flight"] >= 2)(state()))
    client.pause_generation("in_place")  # a request sent now waits in the queue
    waiting, waiting_result = _in_thread(
        generate_ok, server, {"input_ids": OTHER_PROMPT, "lora_path": "doomed", "sampling_params": long}
    )
    _wait_for(lambda: state()["num_waiting_reqs"] == 1)
    assert set(client.unload_lora_adapter("doomed")["loaded_adapters"]) == {"a1", "a2"}
    client.continue_generation()
    for thread in (running, waiting, other):
        thread.join(60)
    [aborted_running], [aborted_waiting], [finished] = running_result, waiting_result, other_result
    assert aborted_running["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted_running["output_ids"]) < 400
    assert aborted_waiting["meta_info"]["finish_reason"]["type"] == "abort"
    assert aborted_waiting["output_ids"] == []
    assert finished["meta_info"]["finish_reason"]["type"] == "length" and len(finished["output_ids"]) == 400

    assert_refused(generate(server, {"input_ids": PROMPT, "lora_path": "doomed"}), "'doomed' is not a loaded adapter")
    with pytest.raises(HTTPRequestError, match="no adapter named 'doomed'"):
        client.unload_lora_adapter("doomed")


@pytest.mark.reliability(
    "a request naming an adapter that a weight push is replacing (unloaded while generation is paused)",
    "it waits in the queue and runs under the new adapter once generation continues; if none was loaded again, it "
    "gets HTTP 400 naming the adapter, and the engine serves on",
)
def test_a_paused_engine_queues_requests_for_an_adapter_being_replaced(server, adapters, models):
    client = EngineClient(server)
    client.load_lora_adapter("policy", str(adapters["a1"]))
    state = lambda: requests.get(f"{server}/get_server_info", timeout=10).json()["internal_states"][0]  # noqa: E731
    client.pause_generation("abort")
    client.unload_lora_adapter("policy")  # the push's first half: the name is gone for a while
    score = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "return_logprob": True}
    replaced, replaced_result = _in_thread(
        generate_ok, server, {**score, "lora_path": "policy", "logprob_start_len": 0}
    )
    never, never_result = _in_thread(generate, server, {**score, "lora_path": "never-loaded"})
    _wait_for(lambda: state()["num_waiting_reqs"] == 2)
    client.load_lora_adapter("policy", str(adapters["a2"]))  # the push's second half: the new adapter
    client.continue_generation()
    for thread in (replaced, never):
        thread.join(60)
    [row], [ended] = replaced_result, never_result
    assert_matches(row, PROMPT, models["a2"])  # generated under the adapter loaded after it was queued
    assert_refused(ended, "'never-loaded' is not a loaded adapter")
    assert_refused(generate(server, {**score, "lora_path": "never-loaded"}), "is not a loaded adapter")  # not paused
    client.unload_lora_adapter("policy")


@pytest.mark.reliability(
    "an adapter file far larger than any adapter of the model could be, or more adapters than --max-loaded-loras",
    "refused (HTTP 400) before the file is read, or before the adapter is held; unload one first",
)
def test_adapter_files_and_counts_are_bounded(tiny_model_dir, adapters, tmp_path):
    from slime.backends.cpu_engine import lora

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    store = lora.LoraStore(model, max_rank=MAX_RANK, max_loaded=1)
    cap = store.max_adapter_bytes()
    config, tensors = lora.read_adapter_folder(adapters["a1"], cap)  # a real adapter fits
    huge = tmp_path / "huge"
    shutil.copytree(adapters["a1"], huge)
    with open(huge / WEIGHTS, "ab") as weights:
        weights.truncate(cap + 1)  # sparse: nothing of it is written, and none of it may be read
    with pytest.raises(ValueError, match=f"larger than the {cap} bytes it may hold"):
        lora.read_adapter_folder(huge, cap)
    store.add(store.build("first", "a1", config, tensors))
    with pytest.raises(ValueError, match="already holds 1 adapters \\(--max-loaded-loras 1\\); unload one first"):
        store.check_free("second")


def test_adapter_from_a_shared_memory_segment_is_copied_out(server, adapters, models):
    """A colocated trainer's adapter push: a stage_named_tensors segment the engine copies the adapter out of, so
    the trainer rewrites the same segment at the next push without touching what the engine serves."""
    client = EngineClient(server)
    tensors = list(load_file(adapters["a1"] / WEIGHTS).items())
    config = json.loads((adapters["a1"] / CONFIG).read_text())
    release_send_segments()
    try:
        payload = stage_named_tensors(tensors, index=-1)
        client.load_lora_adapter_from_tensors("shm", config, payload, load_format=SHARED_MEMORY_FORMAT)
        [row] = scored(server, [PROMPT], ["shm"])
        assert_matches(row, PROMPT, models["a1"])
        rewritten = stage_named_tensors([(name, torch.zeros_like(t)) for name, t in tensors], index=-1)
        assert json.loads(rewritten)["segment"] == json.loads(payload)["segment"]  # the same memory, now zeros
        [row] = scored(server, [PROMPT], ["shm"])
        assert_matches(row, PROMPT, models["a1"])
        client.unload_lora_adapter("shm")
        forged = {**json.loads(payload), "segment": "slime_w_" + "0" * 16}
        with pytest.raises(HTTPRequestError, match="no shared-memory segment"):
            client.load_lora_adapter_from_tensors("shm", config, json.dumps(forged), load_format=SHARED_MEMORY_FORMAT)
        assert "shm" not in loaded(server)
    finally:
        release_send_segments()
