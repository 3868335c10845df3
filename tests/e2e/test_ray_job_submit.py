"""`ray job submit -- python train.py` as the README's usage block says, on a `ray start --head` cluster of this test.

The block's three commands run as written, with this test's free ports added to `ray start` (and `--block`, so
every Ray process is a descendant of the one this test started and is stopped by its id), the dashboard port in
the submit address, the plugin folder in `--runtime-env-json` and a tiny run's flags after `python train.py`.
HOME points at a folder of the test, so the token is the test's own.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.ray_head import free_start_ports, stop_tree, with_test_interpreter
from support.runs import REPO, rollout_rows, small_run_flags, write_addition_prompts

from slime.utils.tracking import format_step_line

README_ADDRESS = 'http://127.0.0.1:8265"'
README_PLUGINS = "/path/to/my_plugins"

PLUGIN = """
async def reward(args, sample):
    return 0.25


class UnreachableSource:
    def __init__(self, args):
        raise ConnectionError("job_plugin: the prompt store at db.internal:5432 is unreachable")
"""


def shell_commands(page: Path, heading: str) -> list[str]:
    """The commands of the first bash block under `heading` in `page`, continuation lines joined, comments left out."""
    block = page.read_text().split(f"{heading}\n\n```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]
    return [" ".join(command.split()) for command in commands]


def readme_usage_commands() -> list[str]:
    return shell_commands(REPO / "README.md", "## Usage")


def test_gpu_guide_shows_the_readmes_commands():
    guide = shell_commands(REPO / "docs" / "get-started" / "gpu.md", "## Start a cluster and submit")
    assert guide == readme_usage_commands()


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """The README's token and `ray start --head`; yields (commands' environment, dashboard URL, submit command).

    Stopped by SIGTERM to the `ray start --block` process, then SIGKILL to any of its descendants still there.
    """
    generate, start, submit = readme_usage_commands()
    assert README_ADDRESS in submit and README_PLUGINS in submit and " -- python train.py " in submit, submit
    root = tmp_path_factory.mktemp("ray_job")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "PYTHONPATH")}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # the README's commands set what they need
    env = with_test_interpreter(env) | {"HOME": str(root / "home"), "TMPDIR": str(root)}
    (root / "home").mkdir()
    subprocess.run(["bash", "-c", generate], env=env, cwd=REPO, check=True, timeout=60)
    assert (root / "home" / ".ray" / "auth_token").stat().st_size > 0

    ports = free_start_ports()
    # Run directly rather than through bash, so the process this test stops is `ray start` itself.
    words = shlex.split(start)
    assignments = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        assignments[name] = value
    ports_flags = [str(word) for flag, port in ports.items() for word in (flag, port)]
    extra = ["--block", "--num-cpus", "4", *ports_flags, "--include-dashboard", "true"]
    dashboard = f"http://127.0.0.1:{ports['--dashboard-port']}"
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # Ray's socket paths must stay short
    process = None
    try:
        with (root / "ray_start.log").open("w") as log:
            command = [*words, *extra, "--temp-dir", temp_dir]
            process = subprocess.Popen(command, env=env | assignments, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        wait_for_dashboard(dashboard, process, root / "ray_start.log")
        yield env, dashboard, submit.replace(README_ADDRESS, f'{dashboard}"')
    finally:
        if process is not None:
            stop_tree(process)
        shutil.rmtree(temp_dir, ignore_errors=True)


def wait_for_dashboard(url: str, process: subprocess.Popen, log_path: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"ray start exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=5)
            return
        except urllib.error.HTTPError:  # 401: it serves, and wants the token
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the dashboard at {url} did not answer within {timeout} s:\n{log_path.read_text()[-3000:]}")


def submit_train(head, plugins: Path, flags: list[str]) -> tuple[subprocess.CompletedProcess, str]:
    """The README's `ray job submit` with the plugin folder and `flags` after `python train.py`; (result, job id)."""
    env, _, submit = head
    prefix = submit.split(" -- python train.py ", 1)[0].replace(README_PLUGINS, str(plugins))
    command = f"{prefix} -- python train.py {shlex.join(flags)}"
    result = subprocess.run(["bash", "-c", command], env=env, cwd=REPO, capture_output=True, text=True, timeout=480)
    job_id = re.search(r"Job '(raysubmit_\w+)'", result.stdout + result.stderr)
    assert job_id, f"no job id in the output of {command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result, job_id.group(1)


def job_cli(head, *args: str) -> str:
    """`RAY_AUTH_MODE=token ray job <args> --address <dashboard>`: its output, as plain text."""
    env, dashboard, _ = head
    command = ["ray", "job", *args, "--address", dashboard]
    result = subprocess.run(command, env=env | {"RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    return re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)  # without the terminal colours


@pytest.fixture
def plugins(tmp_path):
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "job_plugin.py").write_text(PLUGIN)
    return folder


@pytest.mark.slow
@pytest.mark.reliability(
    "`ray job submit` without RAY_AUTH_MODE=token, to the README's token-authenticated cluster",
    "the cluster refuses the job: missing authentication token",
)
def test_submit_without_the_token_is_refused(head):
    env, dashboard, _ = head
    result = subprocess.run(
        ["ray", "job", "submit", "--address", dashboard, "--", "echo", "hello"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "Missing authentication token" in result.stdout + result.stderr


@pytest.mark.slow
def test_submitted_train_py_runs_with_the_runtime_env_plugins(head, plugins, tiny_model_dir, tmp_path):
    save = tmp_path / "save"
    flags = [
        *small_run_flags(tiny_model_dir, write_addition_prompts(tmp_path / "train.jsonl"), save),
        "--num-rollout", "1", "--custom-rm-path", "job_plugin.reward",
    ]  # fmt: skip
    result, job_id = submit_train(head, plugins, flags)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-3000:]}"
    assert f"Job '{job_id}' succeeded" in result.stdout + result.stderr
    (row,) = rollout_rows(save)
    assert row["rollout/reward"] == 0.25  # the plugin, found through --runtime-env-json, scored every sample
    assert format_step_line(0, row) in job_cli(head, "logs", job_id)
    assert f"Job '{job_id}' succeeded" in job_cli(head, "status", job_id)


@pytest.mark.slow
@pytest.mark.reliability(
    "a job under `ray job submit` whose plugin raises in a Ray worker (its --data-source-path)",
    "the job ends FAILED; `ray job logs` holds the plugin's error and ends with slime's one-line summary",
)
def test_failing_job_error_reaches_ray_job_logs(head, plugins, tiny_model_dir, tmp_path):
    flags = [
        *small_run_flags(tiny_model_dir, write_addition_prompts(tmp_path / "train.jsonl"), tmp_path / "save"),
        "--num-rollout", "1", "--data-source-path", "job_plugin.UnreachableSource",
    ]  # fmt: skip
    result, job_id = submit_train(head, plugins, flags)
    assert result.returncode != 0
    logs = job_cli(head, "logs", job_id)
    assert "ConnectionError: job_plugin: the prompt store at db.internal:5432 is unreachable" in logs
    summary = [line for line in logs.splitlines() if line.strip()][-1]  # run_driver's one line: the cause, not Ray's
    assert summary.startswith("slime: ") and "ConnectionError: job_plugin: the prompt store" in summary, summary
    assert f"Job '{job_id}' failed" in job_cli(head, "status", job_id)
