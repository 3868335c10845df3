"""The real sglang-router in front of two real CPU engines, and engine/router process lifecycle."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.engines import router_args, router_options
from support.flags import slime_flags

from slime.backends.sglang_utils.engine_actor import RolloutEngine
from slime.backends.sglang_utils.router import (
    add_worker,
    list_workers,
    remove_worker,
    start_router,
    wait_for_workers,
)
from slime.utils.http_utils import find_free_port, get_json, post_json


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("server_logs")


@pytest.fixture(scope="module")
def router(log_dir):
    # round_robin: the default cache_aware policy would send identical prompts to one engine.
    handle = start_router(router_args(log_dir, policy="round_robin"))
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def engines(tiny_model_dir, log_dir):
    args = slime_flags(hf_checkpoint=str(tiny_model_dir), server_log_dir=str(log_dir))
    engines = [RolloutEngine(args, rank=rank, backend="cpu") for rank in range(2)]
    try:
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda engine: engine.start(timeout=180), engines))
        # Tag each engine so a response tells which engine produced it.
        for rank, engine in enumerate(engines):
            engine.update_weights_from_disk(str(tiny_model_dir), weight_version=f"engine-{rank}")
        yield engines
    finally:
        for engine in engines:
            engine.shutdown()


def _register(router, engines):
    for engine in engines:
        add_worker(router.url, engine.url())
    wait_for_workers(router.url, [engine.url() for engine in engines], timeout=30)


def _generate_versions(router, num_requests):
    versions = []
    for _ in range(num_requests):
        response = post_json(
            f"{router.url}/generate",
            {
                "input_ids": [5, 6, 7],
                "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
                "return_logprob": True,
            },
        )
        meta = response["meta_info"]
        assert meta["prompt_tokens"] == 3 and 1 <= meta["completion_tokens"] == len(response["output_ids"]) <= 3
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
        assert meta["finish_reason"]["type"] in ("stop", "length")
        versions.append(meta["weight_version"])
    return versions


def test_router_spreads_generate_over_both_engines(router, engines):
    _register(router, engines)
    assert sorted(w["url"] for w in list_workers(router.url)) == sorted(e.url() for e in engines)
    versions = _generate_versions(router, num_requests=4)
    assert sorted(versions) == ["engine-0", "engine-0", "engine-1", "engine-1"]  # round robin over two


def test_router_command_line_has_changes_and_slime_defaults_only(router):
    command = router.log_path.read_text().splitlines()[0].split()
    launched = command[command.index("slime.backends.sglang_utils.launch_router") + 1 :]
    flags = [word for word in launched if word.startswith("--")]
    assert sorted(flags) == sorted(
        ["--host", "--port", "--prometheus-port", "--request-timeout-secs", "--disable-circuit-breaker",
         "--disable-health-check", "--log-level", "--prometheus-host", "--policy"]
    )  # fmt: skip
    values = dict(zip(launched, launched[1:]))
    assert values["--policy"] == "round_robin" and values["--request-timeout-secs"] == "120"
    assert values["--host"] == values["--prometheus-host"] == "127.0.0.1" and values["--log-level"] == "warn"


def test_removed_engine_gets_no_traffic(router, engines):
    _register(router, engines)
    remove_worker(router.url, engines[1].url())
    assert [w["url"] for w in list_workers(router.url)] == [engines[0].url()]
    assert _generate_versions(router, num_requests=3) == ["engine-0"] * 3
    with pytest.raises(ValueError, match="has no worker"):
        remove_worker(router.url, engines[1].url())
    _register(router, engines)  # leave both registered for later tests


def test_wait_for_workers_names_missing_worker(router):
    missing = f"http://127.0.0.1:{find_free_port()}"
    with pytest.raises(TimeoutError, match=missing):
        wait_for_workers(router.url, [missing], timeout=1)


def test_running_router_is_reused_not_launched(router):
    host, port = router.url.removeprefix("http://").split(":")
    args = slime_flags(sglang_router_ip=host, sglang_router_port=int(port), router_args=router_options(policy="random"))
    external = start_router(args)
    assert external.process is None and external.url == router.url
    external.stop()
    assert get_json(f"{router.url}/health") == "OK"  # stopping an external handle leaves the router up


def test_router_refuses_managed_router_args():
    args = slime_flags(router_args={"port": 1234})
    with pytest.raises(ValueError, match="--sglang-router-port"):
        start_router(args)


def test_stop_leaves_no_router_process(log_dir):
    args = slime_flags(server_log_dir=str(log_dir))
    handle = start_router(args)
    pid = handle.process.pid
    assert os.path.exists(f"/proc/{pid}")
    assert handle.url.startswith("http://127.0.0.1:")
    assert (args.sglang_router_ip, args.sglang_router_port) == (None, None)  # the handle names it; args as parsed
    handle.stop()
    assert not os.path.exists(f"/proc/{pid}")
    with pytest.raises(ConnectionError):
        get_json(f"{handle.url}/health", max_retries=0)


def test_engine_on_bogus_model_path_fails_with_path_and_log_tail(log_dir):
    bogus = "/nonexistent/bogus-model-dir"
    engine = RolloutEngine(slime_flags(server_log_dir=str(log_dir)), rank=7, backend="cpu", model_path=bogus)
    with pytest.raises(RuntimeError) as error:
        engine.start(timeout=120)
    message = str(error.value)
    assert bogus in message and str(engine.log_path) in message
    log_tail = message.split("--- last lines of", 1)[1]
    assert bogus in log_tail  # the engine's own complaint, not only our prefix
    assert not engine.is_alive()


def test_engine_startup_timeout_kills_the_server(tiny_model_dir, log_dir):
    engine = RolloutEngine(
        slime_flags(server_log_dir=str(log_dir)), rank=8, backend="cpu", model_path=str(tiny_model_dir)
    )
    with pytest.raises(TimeoutError, match="not healthy after 0.2s"):
        engine.start(timeout=0.2)
    assert not engine.is_alive() and not os.path.exists(f"/proc/{engine.process.pid}")
