"""Upstream's sandbox interface on the local sandbox (`LocalSandbox`, `exec_and_wait`), the CLI harnesses' refusal
when their CLI is absent, and `run_app_in_thread`'s lifecycle, with real sandboxed processes and a real server."""

import asyncio
import os
import shutil
import socket
import urllib.request

import pytest
from support.tiny_model import build_tokenizer

from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.agent.harness import CLAUDE_CODE, CODEX
from slime.agent.sandbox import EXIT_TIME_BUDGET_EXCEEDED, LocalSandbox, Sandbox, SandboxLimits, exec_and_wait
from slime.agent.trajectory_proxy import TrajectoryProxy


def test_local_sandbox_keeps_files_between_commands():
    async def main():
        async with LocalSandbox() as sb:
            assert isinstance(sb, Sandbox)
            await sb.write_file("pkg/data.txt", "12 34\n")
            first = await sb.exec("python3 -c \"print(sum(map(int, open('pkg/data.txt').read().split())))\" > out.txt")
            second = await sb.exec('cat out.txt; echo "$GREETING"; echo oops >&2; exit 3', env={"GREETING": "hi"})
            escaped = await sb.exec("echo x > /etc/slime-escape || echo refused")
            result = await sb.read_file("out.txt"), await sb.read_file("missing.txt")
            workdir = sb.workdir
        return first, second, escaped, result, workdir

    first, second, escaped, (out, missing), workdir = asyncio.run(main())
    assert first == (0, "", "") and second == (3, "46\nhi\n", "oops\n")
    assert escaped[1] == "refused\n"
    assert (out, missing) == ("46\n", "")
    assert not os.path.exists(workdir)  # removed on exit


@pytest.mark.reliability(
    "an agent command runs past its time budget", "exec_and_wait kills it and returns EXIT_TIME_BUDGET_EXCEEDED"
)
def test_exec_and_wait_returns_the_exit_code_or_the_budget_marker():
    async def main():
        async with LocalSandbox() as sb:
            done = await exec_and_wait(
                sb, cmd="echo built; echo warn >&2; exit 4", time_budget_sec=30, want_output=True
            )
            quiet = await exec_and_wait(sb, cmd="pwd", workdir=sb.workdir, time_budget_sec=30)
            late = await exec_and_wait(
                sb, cmd="echo started; sleep 60", time_budget_sec=1, tag="slow", want_output=True
            )
            return done, quiet, late

    done, quiet, late = asyncio.run(main())
    assert done == (4, "built\nwarn\n") and quiet == (0, "")
    assert late == (EXIT_TIME_BUDGET_EXCEEDED, "started\n")


@pytest.mark.reliability(
    "a CLI harness is run where its CLI (claude / codex) is not installed, or in a sandbox without network",
    "RuntimeError naming the binary and its npm install command / ValueError asking for allow_network",
)
@pytest.mark.parametrize(
    ("harness", "install"),
    [(CLAUDE_CODE, "npm install -g @anthropic-ai/claude-code"), (CODEX, "npm install -g @openai/codex")],
)
def test_harness_refuses_when_its_cli_is_absent(harness, install):
    if shutil.which(harness.binary):
        pytest.skip(f"{harness.binary} is installed here")

    async def main():
        run = dict(session_id="sid", adapter_url="http://127.0.0.1:1", time_budget_sec=5, prompt="hi")
        async with LocalSandbox() as offline:
            with pytest.raises(ValueError, match="allow_network=True"):
                await harness.run(offline, workdir=offline.workdir, **run)
        async with LocalSandbox(SandboxLimits(allow_network=True)) as sb:
            with pytest.raises(RuntimeError) as refused:
                await harness.run(sb, workdir=sb.workdir, **run)
            return str(refused.value), await sb.exec("ls -A")

    message, (_, listing, _) = asyncio.run(main())
    assert f"needs the `{harness.binary}` CLI" in message and install in message
    assert listing == ""  # refused before writing its settings


def test_run_app_in_thread_serves_until_stopped_and_names_a_taken_port():
    proxy = TrajectoryProxy(build_tokenizer(), model_name="tiny")
    handle = run_app_in_thread(proxy.app(), thread_name="proxy")
    proxy.open_session(["http://127.0.0.1:1"], session_id="sid-1")
    request = urllib.request.Request(f"{handle.url}/v1/models", headers={"x-api-key": "sid-1"})
    with urllib.request.urlopen(request, timeout=10) as response:
        models = response.read().decode()
    assert '"id": "tiny"' in models and proxy.loop is handle.loop  # turns run in the app's own loop
    with pytest.raises(OSError, match=f"cannot serve 127.0.0.1:{handle.port}"):
        run_app_in_thread(proxy.app(), port=handle.port)
    handle.stop()
    assert not handle.thread.is_alive()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", handle.port), timeout=2):
        pass
