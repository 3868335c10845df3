"""The job reaper (slime.utils.job_reaper) on a stand-in driver: a process that starts the reaper, a child that
ignores SIGTERM, that child's own child, and a registered process outside its tree, then exits or is killed; and
its scan of /proc finding a child whatever the child's name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

DRIVER = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from slime.utils.job_reaper import register_this_process, start_job_reaper

    pids_file = start_job_reaper(grace=1.0)
    stubborn = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    # A child that ignores SIGTERM and starts one of its own, in a session of its own (no group signal reaches it).
    child = subprocess.Popen(
        [sys.executable, "-c", stubborn + "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
         "time.sleep(600)"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    # A process outside the driver's tree that registers, as a worker of a running Ray cluster does.
    outsider = subprocess.Popen(
        [sys.executable, "-c", "import os, time; from slime.utils.job_reaper import register_this_process; "
         "register_this_process(); time.sleep(600)"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    # The child's own child started and the outsider registered (an interpreter start can take seconds on a loaded
    # machine), then two of the reaper's polls (0.5 s apart) to note the child's tree: it finds descendants only while
    # the driver lives.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
        psutil.Process(child.pid).children() and f"{outsider.pid} " in open(pids_file).read()
    ):
        time.sleep(0.05)
    time.sleep(1.5)
    job = [(p.pid, p.create_time()) for p in [psutil.Process(child.pid), *psutil.Process(child.pid).children()]]
    job.append((outsider.pid, psutil.Process(outsider.pid).create_time()))
    print(json.dumps(job), flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), 9)
    """
).replace("import json, os", "import json, os, psutil")


def alive(job: list) -> list:
    left = []
    for pid, created in job:
        try:
            process = psutil.Process(pid)
            if process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.mark.reliability(
    "a process of the job that ignores SIGTERM and left the driver's session, its child, and a registered worker "
    "outside the driver's tree, when the driver ends normally or is killed with kill -9",
    "the job reaper stops them all within seconds (grace, SIGTERM, grace, SIGKILL); a bystander process is left alone",
)
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_every_process_of_the_job_is_stopped_after_its_driver(how):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    job: list = []
    try:
        driver = subprocess.run(
            [sys.executable, "-c", DRIVER, how], capture_output=True, text=True, timeout=60, env=dict(os.environ)
        )
        assert driver.returncode == (-signal.SIGKILL if how == "kill" else 0), driver.stderr
        job = json.loads(driver.stdout.strip().splitlines()[-1])
        assert len(job) == 3
        deadline = time.monotonic() + 15
        while alive(job) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(job), f"still running 15 s after the driver: {alive(job)}"
        assert bystander.poll() is None
    finally:
        bystander.kill()
        for pid in alive(job):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_child_named_with_spaces_and_parentheses_is_noted():
    from slime.utils.job_reaper import _with_descendants

    # /proc/<pid>/stat holds "pid (name) state ppid ...": this name would throw off a plain split.
    child = subprocess.Popen(
        [sys.executable, "-c", "open('/proc/self/comm', 'w').write('a) 1 (b'); import time; time.sleep(60)"]
    )
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(child.pid).name() != "a) 1 (b" and time.monotonic() < deadline:
            time.sleep(0.05)
        me = psutil.Process()
        noted = _with_descendants([(me.pid, me.create_time())])
        assert (child.pid, psutil.Process(child.pid).create_time()) in noted
    finally:
        child.kill()
        child.wait()
