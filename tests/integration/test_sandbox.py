"""The code sandbox (slime.agent.sandbox) against real misbehaving programs: each one ends as a tool message."""

import asyncio
import os
import random
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from slime.agent import sandbox
from slime.agent.sandbox import SandboxLimits, SandboxResult, run_python, run_python_sync

REPO = Path(__file__).resolve().parents[2]
FAST = SandboxLimits(wall_time_s=5, cpu_time_s=5, memory_mb=256, max_output_bytes=4096, max_processes=16)


@pytest.fixture
def isolated():
    """Skip where the kernel or container refuses namespaces (the sandbox then logs that it runs degraded)."""
    if not sandbox._plan().namespaces:
        pytest.skip("namespaces unavailable here: no network or /tmp isolation to test")


def limits(**overrides) -> SandboxLimits:
    return SandboxLimits(**{**FAST.__dict__, **overrides})


def survivors(children_before: set[int], uid: int | None = None) -> list[psutil.Process]:
    """Processes left by a sandbox: new descendants of this test, and (when it ran under its own uid) any
    process of that uid anywhere, zombies included."""
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in children_before]
    if uid is not None and uid != os.getuid():
        for p in psutil.process_iter():
            try:
                if p.uids().real == uid:
                    left.append(p)
            except psutil.NoSuchProcess:
                pass
    return left


def our_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def interpreter_folders_in_tmp() -> list[str]:
    """Top folders under /tmp of this interpreter's installation (a venv made under /tmp, say): the sandbox binds
    the interpreter back into its private /tmp, so they show there beside the program."""
    places = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)]
    inside = [Path(os.path.realpath(p)).relative_to("/tmp") for p in places if os.path.realpath(p).startswith("/tmp/")]
    return sorted({path.parts[0] for path in inside})


def test_normal_program_returns_its_stdout_in_a_fresh_minimal_environment(monkeypatch, isolated):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-must-not-leak")
    code = """
import os, sys
print(sum(i * i for i in range(1000)))
print(sorted(os.listdir(".")), os.getuid() != 0, sys.flags.isolated)
print("OPENAI_API_KEY" in os.environ, sorted(os.environ))
print(repr(sys.stdin.read()))
print([pid for pid in os.listdir("/proc") if pid.isdigit()])
"""
    result = run_python_sync(code, FAST)
    assert result.ok(), result
    lines = result.stdout.splitlines()
    assert lines[0] == str(sum(i * i for i in range(1000)))
    assert lines[1] == f"{sorted(['main.py', *interpreter_folders_in_tmp()])} True 1"
    assert lines[2].startswith("False ") and "PATH" in lines[2]
    assert lines[3] == "''"  # stdin is empty, not the parent's
    assert lines[4] == "['1']"  # its own PID namespace: it sees only itself
    assert result.as_tool_message() == result.stdout
    assert result.exit_code == 0 and result.violation is None and 0 < result.elapsed_s < 5


def test_each_run_gets_its_own_private_tmp(isolated):
    marker = f"slime-sandbox-marker-{uuid.uuid4().hex}"
    write = f"for d in ('.', '/tmp', '/var/tmp', '/dev/shm'): open(d + '/{marker}', 'w').write('x')\nprint('done')"
    assert run_python_sync(write, FAST).stdout == "done\n"
    check = f"import os\nprint([os.path.exists(d + '/{marker}') for d in ('.', '/tmp', '/var/tmp', '/dev/shm')])"
    assert run_python_sync(check, FAST).stdout == "[False, False, False, False]\n"
    assert not any((Path(d) / marker).exists() for d in ("/tmp", "/var/tmp", "/dev/shm"))


@pytest.mark.reliability("model code that sleeps forever", "killed at the wall-clock limit; tool message names it")
def test_sleeping_forever_is_killed_at_the_wall_clock_limit():
    before = our_children()
    start = time.monotonic()
    result = run_python_sync("import os, time\nprint(os.getuid(), flush=True)\ntime.sleep(600)", limits(wall_time_s=1))
    assert time.monotonic() - start < 4
    assert result.exit_code is None and result.violation == "wall-clock limit of 1 s"
    assert result.as_tool_message().endswith("Error: wall-clock limit of 1 s")
    assert survivors(before, int(result.stdout.split()[0])) == []


@pytest.mark.reliability("model code in an endless busy loop", "killed at the CPU-time limit; tool message names it")
def test_busy_loop_is_killed_at_the_cpu_limit():
    before = our_children()
    code = "import os\nprint(os.getuid(), flush=True)\nwhile True: pass"
    result = run_python_sync(code, limits(cpu_time_s=1, wall_time_s=30))  # wall clock far: busy cores stretch it
    assert result.exit_code is None and result.violation == "CPU time limit of 1 s"
    assert 0.9 < result.elapsed_s < 20
    assert survivors(before, int(result.stdout.split()[0])) == []


@pytest.mark.reliability(
    "fork bomb whose children call setsid() to leave the process group",
    "contained by the process limit; every process killed and reaped afterwards",
)
def test_fork_bomb_is_contained_and_leaves_no_process():
    code = """
import os, time
print(os.getuid(), flush=True)
while True:
    try:
        if os.fork() == 0:
            os.setsid()
    except OSError:
        time.sleep(0.01)
"""
    before = our_children()
    result = run_python_sync(code, limits(wall_time_s=1.5, max_processes=16))
    assert result.violation == "wall-clock limit of 1.5 s" and result.exit_code is None
    assert survivors(before, int(result.stdout.split()[0])) == []


@pytest.mark.reliability("plain fork bomb (`while True: os.fork()`)", "tool message naming the process limit")
def test_plain_fork_bomb_reports_the_process_limit():
    result = run_python_sync("import os\nwhile True: os.fork()", limits(wall_time_s=2, max_processes=8))
    assert not result.ok()
    assert "process limit of 8" in result.violation
    # Tracebacks of many processes interleave on stderr, so only the violation is certain to be named.
    assert result.as_tool_message().startswith("Error: process limit of 8")


@pytest.mark.reliability("model code allocating 1 GB", "MemoryError inside; tool message names the memory limit")
def test_one_gigabyte_allocation_hits_the_memory_limit():
    result = run_python_sync("print('before', flush=True)\nx = bytearray(1 << 30)\nprint('after')", limits())
    assert result.exit_code == 1 and result.violation == "memory limit of 256 MB"
    assert result.stdout == "before\n"
    assert result.as_tool_message() == "before\nError: memory limit of 256 MB; MemoryError (line 2)"


@pytest.mark.reliability(
    "model code forking 6 children that each fill 100 MB (memory_mb=256; RLIMIT_AS alone allows each 256 MB)",
    "the run's memory cgroup holds them to 256 MB together: the kernel kills children past it; the tool message "
    "names the memory limit",
)
def test_memory_limit_bounds_the_whole_process_tree():
    if sandbox._plan().cgroup_parent is None:
        pytest.skip("no memory cgroup can be made on this machine (the sandbox logs that the limit is per process)")
    code = """
import os, time
children = []
for _ in range(6):
    if (pid := os.fork()) == 0:
        block = bytearray(100 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(2)
        os._exit(0)
    children.append(pid)
print(sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == -9 for pid in children), "killed")
"""
    result = run_python_sync(code, limits(wall_time_s=30, cpu_time_s=30))
    assert result.violation == "memory limit of 256 MB", result
    # The kernel picks its victims: children (at most two 100 MB ones fit in 256 MB), or the program itself.
    if result.exit_code is not None:
        assert int(result.stdout.split()[0]) >= 6 - 256 // 100, result
    parent = sandbox._plan().cgroup_parent
    assert not [d for d in os.listdir(parent) if d.startswith(f"slime-sandbox-{os.getpid()}-")]  # removed after


@pytest.mark.reliability(
    "model code making three SysV shared-memory segments and writing files in /run/lock and /var/lock",
    "all gone with the run: its own IPC namespace and a private tmpfs on those folders; the host sees none",
)
def test_ipc_objects_and_lock_files_do_not_outlive_the_run(isolated):
    keys = [random.randrange(1 << 24, 1 << 30) for _ in range(3)]
    name = f"slime-sandbox-probe-{uuid.uuid4().hex}"
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print([libc.shmget(key, 1 << 20, 0o1666) >= 0 for key in {keys}])
for folder in ("/run/lock", "/var/lock"):
    if os.path.isdir(folder):
        open(os.path.join(folder, "{name}"), "w").write("left behind?")
"""
    result = run_python_sync(code, limits())
    assert result.ok() and result.stdout == "[True, True, True]\n", result
    host_keys = {int(line.split()[0]) for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]}
    assert not host_keys & set(keys)
    assert not any(Path(folder, name).exists() for folder in ("/run/lock", "/var/lock"))


@pytest.mark.reliability(
    "model code creating a user namespace (ctypes unshare(CLONE_NEWUSER)) to get a full capability set",
    "EPERM: no_new_privs and a seccomp filter refuse new user namespaces inside the sandbox",
)
def test_no_user_namespaces_and_no_new_privileges_inside():
    code = """
import ctypes, os, threading, subprocess
libc = ctypes.CDLL(None, use_errno=True)
print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))
status = dict(line.split(":\t") for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
print(status["NoNewPrivs"], status["Seccomp"])
thread = threading.Thread(target=print, args=("threads work",))
thread.start()
thread.join()
print(subprocess.run(["/bin/echo", "subprocesses work"], capture_output=True, text=True).stdout.strip())
"""
    result = run_python_sync(code, limits())
    assert result.ok(), result
    assert result.stdout.splitlines() == ["-1 Operation not permitted", "1 2", "threads work", "subprocesses work"]


def _listening_server() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    return server


def _accepted(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
        return True
    except TimeoutError:
        return False


@pytest.mark.reliability(
    "model code connecting to a server of the host on 127.0.0.1, to an external address and to DNS",
    "every connection fails inside (own network namespace); tool message says network is disabled",
)
def test_network_is_unreachable_from_inside(isolated):
    with _listening_server() as server:
        port = server.getsockname()[1]
        code = f"""
import socket
import sys
for target in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("example.com", 80)]:
    try:
        socket.create_connection(target, timeout=2).close()
        print("connected", target)
    except OSError as e:
        print("failed", type(e).__name__)
socket.create_connection(("127.0.0.1", {port}), timeout=2)
"""
        result = run_python_sync(code, limits())
        assert not _accepted(server)
    assert result.stdout.splitlines() == ["failed OSError", "failed OSError", "failed gaierror"]
    assert result.violation == "network is disabled"
    assert "Network is unreachable" in result.as_tool_message()


def test_allow_network_reaches_the_host_server():
    """The control for the test above: the same connection works when the network is allowed."""
    with _listening_server() as server:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)"
        result = run_python_sync(code, limits(allow_network=True))
        assert _accepted(server)
    assert result.ok(), result


@pytest.mark.reliability(
    "model code writing to a file of the parent (under tmp_path), to the repository and to /root",
    "permission denied or not found; the files stay as they were",
)
def test_writes_outside_the_sandbox_fail(tmp_path):
    existing = tmp_path / "existing.txt"
    existing.write_text("original")
    existing.chmod(0o666)  # even a world-writable file of the parent is out of reach
    targets = [existing, tmp_path / "new.txt", REPO / f"sandbox-escape-{uuid.uuid4().hex}.txt", Path("/root/escape")]
    code = f"""
for path in {[str(t) for t in targets]!r}:
    try:
        with open(path, "a") as f:
            f.write("escaped")
        print("wrote", path)
    except OSError as e:
        print("failed", type(e).__name__)
"""
    result = run_python_sync(code, limits())
    assert result.ok(), result
    assert all(line.startswith("failed ") for line in result.stdout.splitlines()), result.stdout
    assert len(result.stdout.splitlines()) == len(targets)
    assert existing.read_text() == "original"
    assert not any(t.exists() for t in targets[1:])


@pytest.mark.reliability(
    "model code printing without end", "output cut at max_output_bytes and the program killed at once"
)
def test_endless_output_is_cut_and_stopped():
    result = run_python_sync("while True: print('x' * 1000)", limits(wall_time_s=30, max_output_bytes=4096))
    assert result.violation == "output cut at 4096 bytes" and result.exit_code is None
    assert len(result.stdout.encode()) + len(result.stderr.encode()) <= 4096
    assert result.elapsed_s < 10  # stopped when the cap was reached, not at the 30 s wall clock
    message = result.as_tool_message()
    assert message.endswith("Error: output cut at 4096 bytes") and len(message.encode()) <= 4096


@pytest.mark.reliability("model code with a syntax error", "tool message with the SyntaxError and its line")
def test_syntax_error_becomes_a_tool_message():
    result = run_python_sync("x = 1\nprint((x,)\n", limits())
    assert result.exit_code == 1 and result.violation is None and not result.ok()
    assert result.as_tool_message() == "Error: SyntaxError: '(' was never closed (line 2)"


def test_exception_message_keeps_partial_stdout():
    result = run_python_sync("print('step 1')\nraise ValueError('bad input 7')", limits())
    assert result.as_tool_message() == "step 1\nError: ValueError: bad input 7 (line 2)"


def test_many_sandboxes_run_concurrently():
    async def main():
        codes = [f"import time\ntime.sleep(1)\nprint({i} * {i})" for i in range(8)]
        return await asyncio.gather(*(run_python(code, limits()) for code in codes))

    start = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - start < 6  # one after another would take at least 8 s
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(8)]


@pytest.mark.reliability(
    "rollout cancelled while its sandbox runs", "the sandbox is killed and reaped; nothing is left"
)
def test_cancelling_a_run_kills_the_sandbox():
    async def main():
        task = asyncio.create_task(run_python("import os, time\nprint(os.getuid(), flush=True)\ntime.sleep(60)"))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    before = our_children()
    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < 5
    assert survivors(before) == []  # the sandbox and its PID namespace hang below this process, or nowhere


def test_sync_api_works_from_a_worker_thread_and_refuses_a_running_loop():
    out = []
    thread = threading.Thread(target=lambda: out.append(run_python_sync("print(6 * 7)", limits())))
    thread.start()
    thread.join(30)
    assert out and out[0].stdout == "42\n"

    async def inside_loop():
        run_python_sync("print(1)")

    with pytest.raises(RuntimeError, match="await run_python"):
        asyncio.run(inside_loop())


@pytest.mark.reliability(
    "tool output that is huge, binary, cut inside a UTF-8 character, or a tiny output cap",
    "as_tool_message never raises and stays within max_output_bytes",
)
def test_tool_message_never_raises_and_respects_the_cap():
    cases = [
        ("print('é' * 5000)", 7),
        ("import sys\nsys.stdout.buffer.write(bytes(range(256)) * 50)", 100),
        ("import sys\nprint('ü' * 100, file=sys.stderr)\nraise SystemExit(3)", 400),
        ("raise KeyError('k' * 10000)", 64),
        ("print('ok')", 1),
    ]
    results = [run_python_sync(code, limits(max_output_bytes=cap)) for code, cap in cases]
    results += [
        SandboxResult("", "", None, None, 0.0, 10),
        SandboxResult("😀" * 10, "Traceback\n" + "🐍" * 100 + "\n", 1, None, 0.0, 9),
        SandboxResult("a", "", None, "v" * 1000, 0.0, 0),
    ]
    for result in results:
        message = result.as_tool_message()
        assert len(message.encode()) <= result.max_output_bytes, (result, message)
    assert results[2].as_tool_message().startswith("Error: exit code 3")


def test_without_root_the_sandbox_uses_a_user_namespace():
    """Run the sandbox from inside a sandbox, i.e. as an unprivileged user, once with namespaces (a user
    namespace) and once forced into the degraded mode without them (no root, no namespaces)."""
    # The sandbox module needs only the standard library, so its source runs inside as the program itself (the
    # repository may sit under /tmp, which the outer sandbox replaces with its own private tmpfs).
    module = (REPO / "slime" / "agent" / "sandbox.py").read_text()
    inner = (
        module
        + """
limits = SandboxLimits(wall_time_s=1, max_processes=8)
r = run_python_sync("import os, socket\\nprint(os.getuid())\\nsocket.create_connection(('1.1.1.1', 53))", limits)
print(_plan().namespaces, r.stdout.strip(), r.violation)
_plan = lambda: _Plan(False, False, (), _interpreter_dirs())
r = run_python_sync("import os, time\\nprint(os.getuid(), flush=True)\\ntime.sleep(60)", limits)
print(r.stdout.strip(), r.violation)
"""
    )
    outer = limits(wall_time_s=20, cpu_time_s=20, memory_mb=1024, max_processes=64, allow_user_namespaces=True)
    result = run_python_sync(inner, outer)
    assert result.ok(), result
    first, second = result.stdout.splitlines()
    namespaces, uid, violation = first.split(" ", 2)
    assert namespaces == "True" and int(uid) != 0 and violation == "network is disabled"
    assert second == f"{uid} wall-clock limit of 1 s"
