"""The engine edge under abuse: API keys, a bounded queue, stuck weight-group joins, and server
processes that die with their owner.

One CPU engine runs for the whole module, started with `--api-key` and a tiny queue; the last test
stops it with SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from support.engines import router_args, router_for
from support.flags import slime_flags

from slime.backends.sglang_utils.engine_actor import RolloutEngine
from slime.backends.sglang_utils.http_client import EngineClient
from slime.backends.sglang_utils.server_process import launch_server_process, stop_server_process
from slime.utils.arguments import ArgumentValidationError, parse_args
from slime.utils.http_utils import HTTPRequestError, find_free_port, wait_until_healthy
from slime.utils.weight_transport import SHARED_MEMORY_FORMAT as FORMAT
from slime.utils.weight_transport import release_send_segments, segment_tag, stage_named_tensors

REPO_ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-4d1f"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUED = 3


def _engine_command(model_dir: Path, port: int, *flags: str) -> list[str]:
    command = [sys.executable, "-m", "slime.backends.cpu_engine", "--model-path", str(model_dir), "--port", str(port)]
    return [*command, "--num-threads", "1", *flags]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    """(process, base URL) of a keyed engine whose queue holds at most MAX_QUEUED requests."""
    port = find_free_port()
    log_path = tmp_path_factory.mktemp("keyed_engine") / "engine.log"
    flags = ("--api-key", KEY, "--max-queued-requests", str(MAX_QUEUED))
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            _engine_command(tiny_model_dir, port, *flags), cwd=REPO_ROOT, env=_env(), stdout=log, stderr=log
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(f"{url}/health", 180, process=process, log_path=log_path)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _generate_body(max_new_tokens: int = 3) -> dict:
    return {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}


# ---------------------------------------------------------------- API key


@pytest.mark.reliability("engine call without the API key, or with a wrong one", "HTTP 401 saying what to send")
def test_api_key_guards_every_endpoint_but_health(engine):
    _, url = engine
    calls = [
        ("POST", "/generate", _generate_body()),
        ("GET", "/get_model_info", None),
        ("GET", "/health_generate", None),
        ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": []}),
        ("POST", "/pause_generation", {}),
    ]
    for method, path, body in calls:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
            response = requests.request(method, f"{url}{path}", json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers, response.text)
            assert "Authorization: Bearer" in response.json()["error"]["message"]
    assert requests.get(f"{url}/health", timeout=30).status_code == 200  # probes need no key
    response = requests.post(f"{url}/generate", json=_generate_body(), headers=AUTH, timeout=60)
    assert response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] >= 1
    info = requests.get(f"{url}/get_server_info", headers=AUTH, timeout=30).json()
    assert info["api_key"] == "<set>" and KEY not in str(info)  # the key is never handed out


def test_keyed_engine_takes_shared_memory_pushes_only_from_its_jobs_segments(engine):
    _, url = engine
    client = EngineClient(url, api_key=KEY)
    release_send_segments()
    try:
        weight = ("model.norm.weight", torch.full((64,), 0.5))
        for tag in (None, segment_tag("another job's key")):
            with pytest.raises(HTTPRequestError) as refused:
                client.update_weights_from_tensor([stage_named_tensors([weight], 0, tag=tag)], load_format=FORMAT)
            assert refused.value.status == 400 and "is not one of this job's" in str(refused.value)
        answer = client.update_weights_from_tensor(
            [stage_named_tensors([weight], 0, tag=segment_tag(KEY))], load_format=FORMAT
        )
        assert answer["message"] == "updated 1 tensors"
    finally:
        release_send_segments()


def test_engine_client_sends_the_api_key(engine):
    _, url = engine
    assert EngineClient(url, api_key=KEY).get_model_info()["is_generation"] is True
    assert EngineClient(url, api_key=KEY).health_generate()
    with pytest.raises(HTTPRequestError) as error:
        EngineClient(url).get_model_info()
    assert error.value.status == 401 and "--api-key" in str(error.value)
    assert KEY not in repr(EngineClient(url, api_key=KEY))


@pytest.mark.reliability("engine asked to bind 0.0.0.0 without an API key", "refused at startup, saying why")
def test_public_host_without_a_key_is_refused(tiny_model_dir):
    result = subprocess.run(
        _engine_command(tiny_model_dir, find_free_port(), "--host", "0.0.0.0"),
        cwd=REPO_ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "0.0.0.0" in result.stderr and "--api-key" in result.stderr and "weight" in result.stderr
    args = slime_flags(hf_checkpoint=str(tiny_model_dir))
    with pytest.raises(ValueError, match="--sglang-api-key"):
        RolloutEngine(args, rank=0, backend="cpu", host="0.0.0.0")
    keyed = slime_flags(hf_checkpoint=str(tiny_model_dir), sglang_server_args={"api_key": KEY})
    assert RolloutEngine(keyed, rank=0, backend="cpu", host="0.0.0.0", port=30000).url() == "http://0.0.0.0:30000"


@pytest.mark.reliability("--sglang-api-key empty, or --cpu-engine-max-queued-requests 0", "refused at parse time")
def test_engine_flags_are_validated():
    base = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--hf-checkpoint", "/m", "--num-rollout", "1",
            "--prompt-data", "/p.jsonl"]  # fmt: skip
    with pytest.raises(ArgumentValidationError, match="--cpu-engine-max-queued-requests"):
        parse_args([*base, "--cpu-engine-max-queued-requests", "0"])
    with pytest.raises(ArgumentValidationError, match="--sglang-api-key"):
        parse_args([*base, "--sglang-api-key", " "])
    assert parse_args([*base, "--sglang-api-key", KEY]).sglang_server_args["api_key"] == KEY


def test_keyed_engine_works_behind_the_real_router(engine, tmp_path):
    _, url = engine
    # The router probes /model_info before it lists a worker: that probe carries the key too.
    with router_for([url], router_args(tmp_path, request_timeout=60), api_key=KEY) as router_url:
        response = requests.post(f"{router_url}/generate", json=_generate_body(), timeout=60)  # no key: router adds it
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["completion_tokens"] >= 1


def test_server_log_masks_the_api_key(tmp_path):
    log_path = tmp_path / "server.log"
    process = launch_server_process([sys.executable, "-c", "pass", "--api-key", "s3cret"], log_path)
    process.wait(timeout=30)
    stop_server_process(process)
    first_line = log_path.read_text().splitlines()[0]
    assert "--api-key ***" in first_line and "s3cret" not in first_line


# ---------------------------------------------------------------- bounded queue


@pytest.mark.reliability("more /generate requests than --max-queued-requests", "HTTP 503 with Retry-After")
def test_full_queue_answers_503_with_retry_after(engine):
    _, url = engine
    requests.post(f"{url}/pause_generation", json={"mode": "in_place"}, headers=AUTH, timeout=30).raise_for_status()
    try:
        with ThreadPoolExecutor(MAX_QUEUED) as pool:
            post = lambda: requests.post(f"{url}/generate", json=_generate_body(), headers=AUTH, timeout=120)  # noqa: E731
            waiting = [pool.submit(post) for _ in range(MAX_QUEUED)]
            deadline = time.monotonic() + 30
            while requests.get(f"{url}/v1/loads", headers=AUTH, timeout=30).json()["num_waiting_reqs"] < MAX_QUEUED:
                assert time.monotonic() < deadline, "the requests never queued"
                time.sleep(0.05)
            full = requests.post(f"{url}/generate", json=_generate_body(), headers=AUTH, timeout=30)
            assert full.status_code == 503 and full.headers["Retry-After"] == "1"
            assert "--max-queued-requests 3" in full.json()["error"]["message"]
            batch = {**_generate_body(), "input_ids": [[5, 6]] * (MAX_QUEUED + 1)}
            too_big = requests.post(f"{url}/generate", json=batch, headers=AUTH, timeout=30)
            assert too_big.status_code == 400 and "split it" in too_big.json()["error"]["message"]
            requests.post(f"{url}/continue_generation", headers=AUTH, timeout=30).raise_for_status()
            assert [future.result().status_code for future in waiting] == [200] * MAX_QUEUED
    finally:
        requests.post(f"{url}/continue_generation", headers=AUTH, timeout=30)


# ---------------------------------------------------------------- processes die with their owner


def _is_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a killed child nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.reliability("owner of a server process killed with SIGKILL", "the kernel kills the server too")
def test_server_dies_with_its_owner(tmp_path):
    # The owner launches from a short-lived thread: the server must outlive that thread, but not the owner.
    owner_script = f"""
import sys, threading, time
sys.path.insert(0, {str(REPO_ROOT)!r})
from slime.backends.sglang_utils.server_process import launch_server_process
box = []
command = [sys.executable, "-c", "import time; time.sleep(600)"]
thread = threading.Thread(target=lambda: box.append(launch_server_process(command, {str(tmp_path / "s.log")!r})))
thread.start()
thread.join()
print(box[0].pid, flush=True)
time.sleep(600)
"""
    owner = subprocess.Popen([sys.executable, "-c", owner_script], stdout=subprocess.PIPE, text=True)
    server_pid = None
    try:
        server_pid = int(owner.stdout.readline())
        time.sleep(1.0)
        assert _is_running(server_pid), "the server died with the thread that launched it"
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while _is_running(server_pid):
            assert time.monotonic() < deadline, f"server {server_pid} outlived its owner killed with SIGKILL"
            time.sleep(0.1)
    finally:
        owner.kill()
        if server_pid is not None and _is_running(server_pid):
            os.kill(server_pid, signal.SIGKILL)


# ---------------------------------------------------------------- stuck joins and SIGTERM (stops the engine: keep last)


@pytest.mark.reliability(
    "8 /init_weights_update_group calls to an address where nobody listens, then SIGTERM",
    "/health and control calls still answer, the join fails after its timeout, SIGTERM exits at once",
)
def test_stuck_weight_group_joins_neither_jam_the_engine_nor_delay_sigterm(engine):
    process, url = engine
    port = find_free_port()  # nothing listens there

    def join(name: str, timeout: float):
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": name, "backend": "gloo", "timeout": timeout}  # fmt: skip
        return requests.post(f"{url}/init_weights_update_group", json=body, headers=AUTH, timeout=300)

    names = [f"stuck-{i}" for i in range(8)]
    with ThreadPoolExecutor(len(names)) as pool:
        stuck = [pool.submit(join, name, 120) for name in names]
        deadline = time.monotonic() + 30
        for name in names:  # a name in progress is refused before the (invalid) timeout is looked at
            while "being joined" not in join(name, -1).text:
                assert time.monotonic() < deadline, f"{name} never started joining"
                time.sleep(0.05)
        assert requests.get(f"{url}/health", timeout=1).status_code == 200
        # More blocked joins than the default thread pool has workers: endpoints that use it still answer.
        empty = requests.post(
            f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": []}, headers=AUTH, timeout=30
        )
        assert empty.status_code == 200, empty.text
        quick = join("quick", 1)
        assert quick.status_code == 500 and "could not join" in quick.json()["message"]
        assert f"127.0.0.1:{port}" in quick.json()["message"]

        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)  # raises TimeoutExpired if the pending joins hold the shutdown
        for future in stuck:
            try:
                assert future.result().status_code == 503
            except requests.ConnectionError:
                pass
