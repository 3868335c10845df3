"""Upstream slime's helpers that start or talk to processes and servers, and its names resolved by dotted path:
a real sglang-router under `run_router`, process trees under `terminate_process`, a real aiohttp server behind
`init_http_client`/`post`/`get`, ports and host addresses checked by binding real sockets (`find_available_port`,
`get_host_info`), the per-sample CP helpers on two gloo ranks, and upstream's `slime_plugins` paths next to a user's
own `slime_plugins` package."""

import asyncio
import multiprocessing
import signal
import socket
import subprocess
import sys
import textwrap
import time
from argparse import Namespace

import psutil
import pytest
import torch
from aiohttp import web

from slime.utils import http_utils
from slime.utils.http_utils import (
    HTTPRequestError,
    find_available_port,
    find_free_port,
    get,
    get_host_info,
    init_http_client,
    post,
    run_router,
    terminate_process,
    wait_until_healthy,
)


def _gone(pid: int) -> bool:
    """No such process any more, or only its exit status is left (a zombie waiting for its new parent)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_run_router_serves_the_real_router_until_terminated():
    from sglang_router.router_args import RouterArgs

    port, metrics_port = find_free_port(), find_free_port()
    router_args = RouterArgs(
        host="127.0.0.1", port=port, prometheus_host="127.0.0.1", prometheus_port=metrics_port, log_level="warn"
    )
    process = multiprocessing.get_context("spawn").Process(target=run_router, args=(router_args,), daemon=True)
    process.start()
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}/health", timeout=60)
        # The router's own worker list, read with upstream's async GET: no engine registered yet.
        assert asyncio.run(_get_and_close(f"http://127.0.0.1:{port}/workers"))["workers"] == []
    finally:
        terminate_process(process, timeout=5)
    assert not process.is_alive() and process.exitcode is not None
    assert _gone(process.pid)


async def _get_and_close(url: str):
    try:
        return await get(url)
    finally:
        await http_utils.close_async_session()


def test_find_available_port_is_free_near_the_base_and_never_repeats():
    base = 20000
    ports = {find_available_port(base) for _ in range(5)}
    assert len(ports) == 5
    for port in ports:
        assert base <= port < base + 1000
        with socket.socket() as sock:
            sock.bind(("0.0.0.0", port))  # free on every interface
    with pytest.raises(ValueError, match="base_port 70000"):
        find_available_port(70000)


def test_get_host_info_names_this_machine(monkeypatch):
    monkeypatch.delenv("SLIME_HOST_IP", raising=False)
    hostname, ip = get_host_info()
    assert hostname == socket.gethostname()
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as sock:
        sock.bind((ip, 0))  # an address of one of this machine's interfaces
    monkeypatch.setenv("SLIME_HOST_IP", "10.1.2.3")
    assert get_host_info() == (hostname, "10.1.2.3")


def _stubborn_parent(pids: multiprocessing.Queue) -> None:
    """Ignores SIGTERM, as do one of its two children: only SIGKILL ends them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ignores_term = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(600)"
    )
    stubborn = subprocess.Popen([sys.executable, "-c", ignores_term], stdout=subprocess.PIPE)
    stubborn.stdout.readline()  # its handler is set
    plain = subprocess.Popen(["sleep", "600"])
    pids.put([stubborn.pid, plain.pid])
    time.sleep(600)


def test_terminate_process_ends_the_process_and_its_children_even_when_they_ignore_sigterm():
    context = multiprocessing.get_context("spawn")
    pids = context.Queue()
    process = context.Process(target=_stubborn_parent, args=(pids,))
    process.start()
    children = pids.get(timeout=60)
    assert all(psutil.Process(pid).ppid() == process.pid for pid in children)

    terminate_process(process, timeout=0.5)
    assert not process.is_alive()
    assert process.exitcode == -signal.SIGKILL  # SIGTERM was ignored
    assert all(_gone(pid) for pid in children)
    terminate_process(process)  # an ended process is left alone


def test_init_http_client_caps_connections_and_post_get_speak_json(monkeypatch):
    monkeypatch.setattr(http_utils, "_connection_limit", 0)  # restored after the test
    init_http_client(Namespace(sglang_server_concurrency=2, rollout_num_engines=1))
    assert asyncio.run(_six_concurrent_posts()) == {"most_in_flight": 2, "answers": list(range(6))}


async def _six_concurrent_posts() -> dict:
    in_flight, most = 0, 0
    third_arrived = asyncio.Event()

    async def generate(request: web.Request) -> web.Response:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        if in_flight == 3:
            third_arrived.set()
        # Hold each request until a third one is in flight (never, under a cap of 2) or for half a second.
        try:
            await asyncio.wait_for(third_arrived.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
        in_flight -= 1
        return web.json_response({"index": (await request.json())["index"]})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "/models/tiny"})

    app = web.Application()
    app.add_routes([web.post("/generate", generate), web.get("/info", info)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = find_free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        answers = await asyncio.gather(*(post(f"{url}/generate", {"index": i}) for i in range(6)))
        assert await get(f"{url}/info") == {"model_path": "/models/tiny"}
        with pytest.raises(HTTPRequestError) as missing:
            await get(f"{url}/nowhere")
        assert missing.value.status == 404
    finally:
        await http_utils.close_async_session()
        await runner.cleanup()
    return {"most_in_flight": most, "answers": [answer["index"] for answer in answers]}


# (total length, response length): chunks of 4, 3 and 1 tokens over CP=2 (4 chunks per sample), a response inside
# one rank's chunks only, and a one-token prompt.
CP_CASES = [(13, 5), (11, 3), (4, 3), (8, 7)]


def _cp_worker(rank: int, world_size: int) -> list[dict]:
    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp
    from slime.backends.megatron_utils.model import initialize_model_parallel

    initialize_model_parallel(context_parallel_size=world_size)
    results = []
    for total, response in CP_CASES:
        full = torch.arange(response, dtype=torch.float32) * 10 + 1
        share = slice_log_prob_with_cp(full, total, response).clone().requires_grad_()
        gathered = all_gather_with_cp(share, total, response)
        weights = torch.arange(response, dtype=torch.float32) + 100
        (gathered * weights).sum().backward()
        results.append(
            {
                "share": share.detach().tolist(),
                "list_share": slice_log_prob_with_cp(full.tolist(), total, response),
                "gathered": gathered.detach().tolist(),
                "grad": share.grad.tolist(),
            }
        )
    return results


def test_cp_helpers_slice_and_gather_one_sample_over_two_ranks():
    pytest.importorskip("megatron.core")
    from support.megatron_cpu import run_in_processes

    ranks = run_in_processes(_cp_worker, world_size=2)
    for case, (total, response) in enumerate(CP_CASES):
        prompt = total - response
        chunk = -(-total // 4)  # the sample padded to 4 equal chunks; rank r keeps chunks r and 3 - r
        full = [i * 10 + 1.0 for i in range(response)]
        covered = []
        for rank, results in enumerate(ranks):
            kept = {*range(rank * chunk, (rank + 1) * chunk), *range((3 - rank) * chunk, (4 - rank) * chunk)}
            # Response token i is scored by the logits at position prompt - 1 + i.
            mine = [i for i in range(response) if prompt - 1 + i in kept]
            covered += mine
            result = results[case]
            assert result["share"] == result["list_share"] == [full[i] for i in mine], (total, response, rank)
            assert result["gathered"] == full
            assert result["grad"] == [100.0 + i for i in mine]  # each rank's own share of the gradient
        assert sorted(covered) == list(range(response))


def test_upstream_plugin_paths_resolve_beside_a_users_own_slime_plugins(tmp_path):
    package = tmp_path / "slime_plugins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "my_reward.py").write_text("async def rm(args, sample):\n    return 1.0\n")
    (package / "broken.py").write_text("import a_module_nobody_has\n")
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from slime.utils.misc import load_function

        rm = load_function("slime_plugins.my_reward.rm")
        assert rm.__module__ == "slime_plugins.my_reward" and rm.__code__.co_filename.startswith({str(tmp_path)!r})
        spec = load_function("slime_plugins.models.glm4.get_glm_spec")
        assert spec is load_function("slime.plugins.models.glm4.get_glm_spec"), spec.__module__
        for path, error in [
            ("slime_plugins.broken.f", "No module named 'a_module_nobody_has'"),  # the user's error, not a fallback
            ("slime_plugins.models.nowhere.f", "No module named 'slime_plugins.models'"),
        ]:
            try:
                load_function(path)
            except ValueError as e:
                assert error in str(e), (path, str(e))
            else:
                raise AssertionError(path + " loaded")
        print("resolved")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "resolved"
