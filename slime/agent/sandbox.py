"""Run model-written Python (a code-interpreter tool, as in ReTool) in a subprocess with limits.

Whatever the code does (loops forever, forks, allocates, prints gigabytes, opens sockets, writes files), the
caller gets a `SandboxResult` whose `as_tool_message()` goes into the conversation; the rollout never crashes.

How the child is confined (Linux):
- `python -I -u main.py` with stdin on /dev/null, a minimal environment (nothing inherited, so no API keys), its
  own session, and rlimits on CPU time, address space, processes, file size and core dumps.
- As root, each sandbox runs under its own fresh unprivileged uid, so RLIMIT_NPROC (which root ignores) applies
  and counts only this sandbox, and files of every real user are protected by their permissions. As non-root, a
  user namespace is used instead (RLIMIT_NPROC is then counted per namespace, Linux >= 5.14).
- A new PID namespace: the program is pid 1 there, so when it ends or is killed the kernel kills and reaps all it
  started, even processes that left the process group. A new network namespace (only a loopback that is down)
  unless `allow_network`. A new IPC namespace (SysV shared memory, semaphores and message queues die with the
  run). A new mount namespace where /tmp, /var/tmp, /dev/shm, /run/lock and /var/lock are one private tmpfs of
  `memory_mb` (also the working directory), /proc shows only the sandbox, and directories the sandbox uid cannot
  enter on the way to the interpreter (e.g. /root for a pyenv Python) are covered by an empty tmpfs with only the
  interpreter's prefix bound back.
- `memory_mb` bounds the whole process tree, not only each process (RLIMIT_AS alone lets 32 processes take 32
  times the limit): each run gets its own memory cgroup (v2 `memory.max`, or v1 `memory.limit_in_bytes`) where the
  machine lets slime make one, and the kernel's OOM killer acts inside it. Elsewhere it logs once that the limit
  is per process.
- `PR_SET_NO_NEW_PRIVS` and a seccomp filter that refuses new user namespaces (`unshare`/`clone` with
  CLONE_NEWUSER; `clone3` answers ENOSYS so libc falls back to `clone`): inside, no process gains capabilities
  (unless `allow_user_namespaces`).
- If namespaces cannot be set up (e.g. a container without CAP_SYS_ADMIN), the sandbox still runs with the uid
  and rlimits in a temporary directory, is cleaned up by process group and uid, and logs once that network and
  /tmp isolation are missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import functools
import logging
import os
import random
import re
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 22, 38
# Host directories anyone may write, each covered by the sandbox's own tmpfs.
SHARED_WRITABLE_DIRS = ("/var/tmp", "/dev/shm", "/run/lock", "/var/lock")

# Fresh uids for sandboxes, far above ordinary accounts and system ranges (subuid ranges start at 100000).
UID_BASE, UID_RANGE = 1_500_000_000, 1 << 24
SETUP_ERROR = "slime sandbox setup failed: "
SCRIPT = "main.py"


@dataclass
class SandboxLimits:
    """Limits for one run. Sizes are in MB / bytes, times in seconds; `memory_mb` also caps the files it writes."""

    wall_time_s: float = 10.0
    cpu_time_s: float = 10.0
    memory_mb: int = 512
    max_output_bytes: int = 16_384
    max_processes: int = 32
    allow_network: bool = False
    allow_user_namespaces: bool = False  # for a program that runs sandboxes of its own (slime's tests do)


@dataclass
class SandboxResult:
    """What a run produced. `exit_code` is None when the process was killed; `violation` names the limits hit
    (several are joined by "; "), or is None for a clean run; `max_output_bytes` is the cap `as_tool_message` keeps."""

    stdout: str
    stderr: str
    exit_code: int | None
    violation: str | None
    elapsed_s: float
    max_output_bytes: int = 16_384

    def ok(self) -> bool:
        """True when the program exited with code 0 and hit no limit."""
        return self.exit_code == 0 and self.violation is None

    def as_tool_message(self) -> str:
        """The text for the conversation: stdout for a clean run; otherwise the stdout printed so far followed by
        one `Error: ...` line naming the violation and/or the traceback's last line. At most `max_output_bytes`."""
        if self.ok():
            return _cut(self.stdout, self.max_output_bytes)
        reasons = [self.violation] if self.violation else []
        if error := _last_error_line(self.stderr):
            reasons.append(error)
        if not reasons:
            reasons.append(f"exit code {self.exit_code}")
        error_line = _cut("Error: " + "; ".join(reasons), self.max_output_bytes // 2)
        head = _cut(self.stdout, self.max_output_bytes - len(error_line.encode()) - 1)
        return f"{head}\n{error_line}" if head and not head.endswith("\n") else head + error_line


async def run_python(code: str, limits: SandboxLimits | None = None, workdir: str | None = None) -> SandboxResult:
    """Run `code` as a Python script in a fresh sandbox and return what happened. Never raises because of what the
    code does; raises RuntimeError only when this machine cannot run a sandbox at all (the message says why).

    Args:
        workdir: A host directory the program runs in, seen at the same path inside; what it writes there outlives
            the run (`LocalSandbox` keeps one per sandbox). None: a private empty /tmp that dies with the run.
    """
    limits = limits or SandboxLimits()
    plan = await asyncio.to_thread(_plan)
    start = time.monotonic()
    spawn = _Spawn.make(plan, limits, workdir)
    capture = _Capture(limits.max_output_bytes)
    killed = False
    try:
        try:
            proc = await asyncio.create_subprocess_exec(*spawn.argv, **spawn.popen_kwargs(code))
        except OSError as e:  # the machine could not fork (no memory, no process slots): a tool error, not a crash
            logger.warning("sandbox could not start a process: %r", e)
            return SandboxResult("", "", None, f"sandbox could not start: {e}", 0.0, limits.max_output_bytes)

        def kill() -> None:
            nonlocal killed
            killed = True
            spawn.stop(proc)

        pumps = asyncio.gather(
            _pump(proc.stdout, capture.stdout, capture, kill), _pump(proc.stderr, capture.stderr, capture, kill)
        )
        try:
            await asyncio.wait_for(proc.wait(), limits.wall_time_s)
        except TimeoutError:
            capture.timed_out = True
            kill()
        finally:
            spawn.stop(proc)  # without namespaces: background children of a program that exited
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:  # the relay did not answer: kill it too (its sandbox dies with it)
                logger.warning("sandbox relay %d did not exit; killing its process group", proc.pid)
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            try:  # every writer is dead, so the pipes drain at once; the timeout only guards against the unforeseen
                await asyncio.wait_for(pumps, 2.0)
            except TimeoutError:
                logger.warning("sandbox output pipes stayed open after its processes were killed")
        elapsed = time.monotonic() - start
        oom_kills = spawn.cgroup.oom_kills() if spawn.cgroup is not None else 0
    finally:
        spawn.cleanup()
    return _result(capture, proc.returncode, killed, limits, elapsed, oom_kills)


def run_python_sync(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """`run_python` for synchronous code. Inside a running event loop, `await run_python(...)` instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_python(code, limits))
    raise RuntimeError("run_python_sync was called inside a running event loop; use `await run_python(code)`")


# ---- upstream's sandbox interface (slime.agent.sandbox.Sandbox) --------------------------------------------------
ExecResult = tuple[int, str, str]
FileContent = str | bytes | Path
# exec_and_wait's exit code when the command outran its time budget and was killed.
EXIT_TIME_BUDGET_EXCEEDED = -2
# GNU timeout's exit status for a command it had to stop.
_TIMEOUT_STATUS = 124


@runtime_checkable
class Sandbox(Protocol):
    """What agent code may ask of a sandbox, wherever it runs (upstream's contract): an async context manager with
    `exec` (a shell command -> (exit_code, stdout, stderr)), `write_file` (text, bytes, or a host `Path` to copy in)
    and `read_file`. `LocalSandbox` runs on this machine; `E2BSandbox` in E2B's cloud."""

    sandbox_id: str

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(self, exc_type, exc, tb) -> None: ...

    async def exec(
        self,
        cmd: str,
        *,
        user: str = "root",
        env: dict[str, str] | None = None,
        timeout: int = 120,
        check: bool = False,
    ) -> ExecResult: ...

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None: ...

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str: ...


class LocalSandbox:
    """`Sandbox` on this machine: each `exec` is a `run_python` sandbox (limits, no network unless
    `limits.allow_network`, private /tmp) running `sh -c cmd` in the sandbox's working directory, a host temporary
    directory whose files persist from one command to the next and are removed on exit.

        async with LocalSandbox() as sb:
            await sb.write_file("solution.py", code)
            exit_code, stdout, stderr = await sb.exec("python3 solution.py", timeout=10)

    Paths may be relative (to `workdir`) or absolute inside `workdir`. `user` is accepted for upstream's interface and
    has no effect: every command runs as the sandbox's own unprivileged uid. A command stopped at `timeout` seconds
    exits with 124 (as under GNU `timeout`); another limit hit (memory, CPU, output) kills it with 137. The limit that
    stopped it is the last line of stderr.

    Args:
        limits: Per-command limits (`wall_time_s` is replaced by each call's `timeout`).
    """

    def __init__(self, limits: SandboxLimits | None = None):
        self.limits = limits or SandboxLimits()
        self.workdir = ""
        self.sandbox_id = ""

    async def __aenter__(self) -> LocalSandbox:
        self.workdir = os.path.realpath(tempfile.mkdtemp(prefix="slime-workdir-"))
        self.sandbox_id = os.path.basename(self.workdir)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def path(self, sandbox_path: str) -> str:
        """The absolute path of `sandbox_path` (relative paths are taken from `workdir`).

        Raises:
            ValueError: The path leads outside `workdir`, or the sandbox is not entered.
        """
        if not self.workdir:
            raise ValueError("the LocalSandbox is not open; use it as `async with LocalSandbox() as sb:`")
        path = os.path.realpath(os.path.join(self.workdir, sandbox_path))
        if path != self.workdir and not path.startswith(self.workdir + os.sep):
            raise ValueError(f"{sandbox_path!r} is outside this sandbox's working directory {self.workdir}")
        return path

    async def exec(
        self,
        cmd: str,
        *,
        user: str = "root",
        env: dict[str, str] | None = None,
        timeout: int = 120,
        check: bool = False,
    ) -> ExecResult:
        """Run `cmd` with `sh -c` in `workdir`, `env` added to the sandbox's minimal environment.

        Raises:
            RuntimeError: `check` is set and the command did not exit with 0 (the message holds its stderr).
        """
        limits = dataclasses.replace(self.limits, wall_time_s=float(timeout), cpu_time_s=float(timeout))
        # A Python stub replaces itself with the shell: the exit status and output are the command's own.
        stub = f"import os\nos.execve('/bin/sh', ['sh', '-c', {cmd!r}], {{**os.environ, **{dict(env or {})!r}}})\n"
        result = await run_python(stub, limits, workdir=self.path("."))
        stderr = result.stderr
        if result.violation:
            stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + f"slime sandbox: {result.violation}\n"
        code = result.exit_code
        if code is None:
            code = _TIMEOUT_STATUS if result.violation and "wall-clock" in result.violation else 137
        if check and code != 0:
            raise RuntimeError(f"sandbox command failed (exit code {code}): {cmd[:200]}\n{stderr[-2000:]}")
        return code, result.stdout, stderr

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None:
        """Write text, bytes, or a copy of the host file `content` (a `Path`); parent directories are made."""
        path = self.path(sandbox_path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if isinstance(content, Path):
            await asyncio.to_thread(shutil.copyfile, content, path)
        else:
            with open(path, "wb" if isinstance(content, bytes) else "w") as f:
                f.write(content)

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        """The file's text; "" when it does not exist (as upstream's sandboxes answer)."""
        try:
            with open(self.path(sandbox_path), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""


async def exec_and_wait(
    sb: Sandbox,
    *,
    cmd: str,
    user: str = "root",
    env: dict[str, str] | None = None,
    workdir: str | None = None,
    time_budget_sec: float,
    tag: str = "exec",
    want_output: bool = False,
) -> tuple[int, str]:
    """Run a long command (an agent CLI, a test suite) to completion in `sb` within `time_budget_sec`.

    The command runs under `timeout`, which stops it and everything it started at the budget; the exit code is
    then `EXIT_TIME_BUDGET_EXCEEDED`. `tag` names the run in logs.

    Returns:
        (exit_code, output): `output` is stdout and stderr together when `want_output`, else "".
    """
    budget = max(1, int(time_budget_sec + 0.999))
    line = f"timeout -k 5 {budget} sh -c {shlex.quote(cmd)} 2>&1"
    if workdir:
        line = f"cd {shlex.quote(workdir)} && {line}"
    # The sandbox's own limit comes after `timeout`'s, so the command's exit status always comes back.
    code, stdout, stderr = await sb.exec(line, user=user, env=env, timeout=budget + 30)
    if code == _TIMEOUT_STATUS:
        logger.warning("sandbox %s: %s ran past its time budget of %s s", sb.sandbox_id, tag, budget)
        code = EXIT_TIME_BUDGET_EXCEEDED
    return code, (stdout + stderr if want_output else "")


class E2BSandbox:
    """`Sandbox` in E2B's cloud (`pip install e2b`, credentials in `E2B_API_KEY`), started from the template
    `image`.

    Args:
        image: The E2B template to start.
        timeout: Seconds the sandbox may live (default 3600).
        metadata: E2B metadata of the sandbox.
    """

    def __init__(self, image: str, *, timeout: int | None = None, metadata: dict[str, str] | None = None):
        self.image, self.timeout, self.metadata = image, timeout or 3600, dict(metadata or {})
        self.sandbox_id = ""
        self._sb = None

    async def __aenter__(self) -> E2BSandbox:
        if not os.environ.get("E2B_API_KEY"):
            raise RuntimeError(
                "E2BSandbox needs E2B credentials: set the E2B_API_KEY environment variable to your E2B API key, "
                "or run the agent in slime.agent.sandbox.LocalSandbox on this machine"
            )
        try:
            from e2b import AsyncSandbox
        except ImportError:
            raise RuntimeError("E2BSandbox needs the e2b package: pip install e2b") from None
        self._sb = await AsyncSandbox.create(template=self.image, timeout=self.timeout, metadata=self.metadata)
        self.sandbox_id = self._sb.sandbox_id
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self._sb is not None:
            await self._sb.kill()

    async def exec(
        self,
        cmd: str,
        *,
        user: str = "root",
        env: dict[str, str] | None = None,
        timeout: int = 120,
        check: bool = False,
    ) -> ExecResult:
        """Run `cmd` in the sandbox (see `Sandbox`)."""
        from e2b.sandbox.commands.command_handle import CommandExitException

        try:
            result = await self._sb.commands.run(cmd, user=user, envs=env, timeout=timeout)
        except CommandExitException as error:  # e2b raises for a non-zero exit
            if check:
                raise RuntimeError(f"sandbox command failed (exit code {error.exit_code}): {cmd[:200]}") from None
            return error.exit_code, error.stdout or "", error.stderr or ""
        return result.exit_code, result.stdout or "", result.stderr or ""

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None:
        """Write text, bytes, or a copy of the host file `content` (a `Path`)."""
        data = content.read_bytes() if isinstance(content, Path) else content
        await self._sb.files.write(sandbox_path, data, user=user)

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        """The file's text."""
        return await self._sb.files.read(sandbox_path, user=user)


@dataclass
class _Capture:
    limit: int
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    cut: bool = False
    timed_out: bool = False


async def _pump(stream: asyncio.StreamReader, into: bytearray, capture: _Capture, kill: Callable[[], None]) -> None:
    """Read `stream` as it comes; past the shared stdout+stderr budget, keep nothing more and kill the program."""
    while chunk := await stream.read(1 << 16):
        room = capture.limit - len(capture.stdout) - len(capture.stderr)
        into += chunk[: max(room, 0)]
        if len(chunk) > room and not capture.cut:
            capture.cut = True
            kill()


@dataclass(frozen=True)
class _Plan:
    """How this machine can confine a child, probed once per process."""

    as_root: bool
    namespaces: bool
    holes: tuple[str, ...]  # directories to cover with an empty tmpfs (the sandbox uid cannot enter them)
    interpreter: tuple[str, ...]  # directories bound back into the mount namespace so the interpreter runs
    cgroup_parent: str | None = None  # where each run's memory cgroup is made; None: the limit is per process


@functools.cache
def _plan() -> _Plan:
    as_root = os.geteuid() == 0
    interpreter = _interpreter_dirs()
    holes = tuple(sorted({h for d in interpreter if (h := _first_closed_ancestor(d))})) if as_root else ()
    cgroup_parent = _memory_cgroup_parent()
    if cgroup_parent is None:
        logger.warning(
            "sandbox: no memory cgroup can be made here, so memory_mb bounds each sandboxed process, not the "
            "processes of one run together. Run slime where it may create cgroups (root, or a delegated cgroup v2 "
            "subtree with the memory controller) to bound the whole run."
        )
    full = _Plan(as_root, True, holes, interpreter, cgroup_parent)
    error = _probe(full)
    if not error:
        return full
    logger.warning(
        "sandbox: could not set up network and mount namespaces (%s); sandboxed code CAN reach the network and "
        "shared /tmp. Run with CAP_SYS_ADMIN (or unprivileged user namespaces enabled) for full isolation.",
        error,
    )
    degraded = _Plan(as_root, False, (), interpreter, cgroup_parent)
    if error := _probe(degraded):
        raise RuntimeError(
            f"the code sandbox cannot run {sys.executable}: {error}. Without mount namespaces the interpreter "
            "must be readable by an unprivileged user: install Python outside /root (e.g. /usr/local or /opt), "
            "or allow mount namespaces (CAP_SYS_ADMIN)."
        )
    return degraded


def _probe(plan: _Plan) -> str | None:
    """None when a sandbox with this plan runs a trivial program, else the reason it does not."""
    spawn = _Spawn.make(plan, SandboxLimits(), None)
    try:
        out = subprocess.run(spawn.argv, timeout=30, **spawn.popen_kwargs("print('ok')"))
    except (OSError, subprocess.SubprocessError) as e:
        return repr(e)
    finally:
        spawn.cleanup()
    if out.stdout == b"ok\n":
        return None
    return out.stderr.decode(errors="replace").strip().removeprefix(SETUP_ERROR) or f"exit code {out.returncode}"


def _memory_cgroup_parent() -> str | None:
    """A cgroup folder under which this process can make a memory-limited child cgroup (v2 or v1), or None."""
    candidates = []
    with contextlib.suppress(OSError):
        for line in open("/proc/self/cgroup").read().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2 (mounted at the top, or beside v1 as "unified"); needs memory delegated
                candidates += [
                    os.path.join(root, path.lstrip("/")) for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
                ]
            elif "memory" in controllers.split(","):
                candidates.append(os.path.join("/sys/fs/cgroup/memory", path.lstrip("/")))
    # Only real cgroup folders: the kernel fills them with cgroup.procs (a plain folder, e.g. the tmpfs that holds
    # v1 mounts, would take a mkdir and look like one).
    for parent in [c for c in candidates if os.path.isfile(os.path.join(c, "cgroup.procs"))]:
        _remove_cgroups_of_dead_processes(parent)
        probe = _MemoryCgroup.create(parent, 64)
        if probe is not None:
            probe.remove()
            return parent
    return None


def _remove_cgroups_of_dead_processes(parent: str) -> None:
    """Run cgroups left by a slime process that was killed (rmdir removes only a cgroup with no process in it)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            match = re.fullmatch(r"slime-sandbox-(\d+)-[0-9a-f]{8}", name)
            if match and not os.path.exists(f"/proc/{match.group(1)}"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(parent, name))


class _MemoryCgroup:
    """One run's memory cgroup: its processes together may use `memory_mb` (swap included where it can be set)."""

    def __init__(self, path: str, v2: bool):
        self.path, self.v2 = path, v2

    @staticmethod
    def create(parent: str, memory_mb: int) -> _MemoryCgroup | None:
        v2 = os.path.isfile(os.path.join(parent, "cgroup.controllers"))
        limit_file = "memory.max" if v2 else "memory.limit_in_bytes"
        path = os.path.join(parent, f"slime-sandbox-{os.getpid()}-{random.randrange(1 << 32):08x}")
        try:
            os.mkdir(path, 0o755)
        except OSError:
            return None
        group = _MemoryCgroup(path, v2)
        try:
            group._write(limit_file, memory_mb << 20)
            for swap_file in ("memory.swap.max",) if v2 else ("memory.memsw.limit_in_bytes",):
                if os.path.exists(os.path.join(path, swap_file)):
                    group._write(swap_file, 0 if v2 else memory_mb << 20)
        except OSError:
            group.remove()
            return None
        return group

    def _write(self, name: str, value: int) -> None:
        # No O_CREAT: a control file the kernel did not make means this is no memory cgroup.
        fd = os.open(os.path.join(self.path, name), os.O_WRONLY)
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)

    def join(self) -> None:
        """Move the calling process in (its children follow)."""
        self._write("cgroup.procs", os.getpid())

    def oom_kills(self) -> int:
        """Processes the kernel killed for the limit (v1 without an `oom_kill` count: times the limit was hit)."""
        with contextlib.suppress(OSError, ValueError):
            name = "memory.events" if self.v2 else "memory.oom_control"
            for line in open(os.path.join(self.path, name)).read().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
            if not self.v2:
                return int(open(os.path.join(self.path, "memory.failcnt")).read())
        return 0

    def remove(self) -> None:
        for _ in range(50):  # the kernel takes a moment to let go of the last, just-killed processes
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
        logger.warning("sandbox: could not remove cgroup %s", self.path)


def _interpreter_dirs() -> tuple[str, ...]:
    dirs = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix)}
    dirs.add(os.path.dirname(os.path.realpath(sys.executable)))
    # Drop directories inside others: binding the outer one brings them along.
    return tuple(sorted(d for d in dirs if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in dirs)))


def _first_closed_ancestor(path: str) -> str | None:
    """The topmost directory above `path` that others may not enter. None if there is none, or once the walk
    reaches /tmp: the sandbox covers /tmp with its own tmpfs, and the interpreter is bound back into it anyway."""
    parts = path.strip("/").split("/")
    for ancestor in ("/" + "/".join(parts[:i]) for i in range(1, len(parts))):
        if ancestor == "/tmp":
            return None
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


@dataclass
class _Spawn:
    """One child's identity, working directory and setup."""

    plan: _Plan
    limits: SandboxLimits
    uid: int | None  # the fresh uid when running as root
    workdir: str | None  # host temporary directory, only without a mount namespace (else a private tmpfs)
    cgroup: _MemoryCgroup | None  # bounds the memory of the whole run, where the machine allows one
    user_dir: str | None = None  # the caller's working directory (run_python's `workdir`), bound in at its own path

    @property
    def argv(self) -> tuple[str, ...]:
        return (sys.executable, "-I", "-u", os.path.join(self.workdir or "/tmp", SCRIPT))

    @staticmethod
    def make(plan: _Plan, limits: SandboxLimits, user_dir: str | None) -> _Spawn:
        uid = UID_BASE + random.randrange(UID_RANGE) if plan.as_root else None
        workdir = None
        if not plan.namespaces:
            workdir = tempfile.mkdtemp(prefix="slime-sandbox-")
            if uid is not None:
                os.chown(workdir, uid, uid)
        if user_dir is not None:
            user_dir = os.path.realpath(user_dir)
            if uid is not None:  # each run has a fresh uid: hand it the directory and all the earlier runs left there
                for root, dirs, files in os.walk(user_dir):
                    for name in (root, *(os.path.join(root, n) for n in dirs + files)):
                        os.lchown(name, uid, uid)
        cgroup = _MemoryCgroup.create(plan.cgroup_parent, limits.memory_mb) if plan.cgroup_parent else None
        return _Spawn(plan, limits, uid, workdir, cgroup, user_dir)

    def popen_kwargs(self, code: str) -> dict:
        home = self.workdir or "/tmp"
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": home,
            "TMPDIR": home,
            "LANG": "C.UTF-8",
            "MPLBACKEND": "Agg",
            # Each BLAS/OpenMP thread counts against RLIMIT_NPROC; one per library is plenty for a tool call.
            **{k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")},
        }
        return dict(
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=self.workdir or "/",
            env=env,
            start_new_session=True,
            preexec_fn=functools.partial(_child_setup, self, code.encode(errors="surrogateescape")),
        )

    def stop(self, proc: asyncio.subprocess.Process | subprocess.Popen) -> None:
        """Kill the sandbox and everything it started. With namespaces, SIGTERM asks the relay to SIGKILL the
        sandbox (pid 1 of its PID namespace, so the kernel kills the rest) and reap it, which leaves no zombies."""
        if self.plan.namespaces:
            if proc.returncode is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.uid is not None:  # processes that left the process group
            _kill_uid(self.uid)

    def cleanup(self) -> None:
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self.cgroup is not None:
            self.cgroup.remove()


def _kill_uid(uid: int) -> None:
    """`kill(-1, SIGKILL)` from a helper running as `uid`: the kernel signals all of that uid's processes at once,
    so a fork bomb cannot outrun it."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


_libc = ctypes.CDLL(None, use_errno=True)


def _sys(name: str, *args) -> None:
    if getattr(_libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}{args}: {os.strerror(errno)}")


def _child_setup(spawn: _Spawn, code: bytes) -> None:
    """Runs in the forked child before exec. With namespaces, the child only unshares, forks the real sandbox
    (pid 1 of a new PID namespace, so when it dies the kernel kills and reaps everything it started) and relays its
    exit status. Failures are reported on stderr with exit code 126 instead of raising, so the reason reaches the
    parent."""
    try:
        plan, limits, uid = spawn.plan, spawn.limits, spawn.uid
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if spawn.cgroup is not None:
            spawn.cgroup.join()
        if plan.namespaces:
            _unshare(plan, limits)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # until the relay knows whom to kill
            if pid := os.fork():
                _relay_exit(pid)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            _mount_private_tree(plan, limits, uid, spawn.user_dir)
        with open(spawn.argv[-1], "xb") as f:
            f.write(code)
            if uid is not None:
                os.fchown(f.fileno(), uid, uid)
        if spawn.user_dir is not None:
            os.chdir(spawn.user_dir)
        cpu = max(1, int(limits.cpu_time_s + 0.999))
        mb = 1 << 20
        for res, value in (
            # SIGKILL at the limit: pid 1 of a PID namespace ignores a SIGXCPU it does not handle.
            (resource.RLIMIT_CPU, (cpu, cpu)),
            (resource.RLIMIT_AS, (limits.memory_mb * mb,) * 2),
            (resource.RLIMIT_FSIZE, (limits.memory_mb * mb,) * 2),
            (resource.RLIMIT_NPROC, (limits.max_processes,) * 2),
        ):
            resource.setrlimit(res, value)
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        if plan.namespaces:  # set after the uid change, which clears it: die with the relaying parent
            _sys("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _sys("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if not limits.allow_user_namespaces:
            _refuse_user_namespaces()
    except BaseException as e:
        os.write(2, f"{SETUP_ERROR}{e!r}\n".encode())
        os._exit(126)


def _unshare(plan: _Plan, limits: SandboxLimits) -> None:
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | (0 if limits.allow_network else CLONE_NEWNET)
    if plan.as_root:
        _sys("unshare", flags)
        return
    uid, gid = os.getuid(), os.getgid()
    _sys("unshare", flags | CLONE_NEWUSER)
    # Map ourselves to ourselves: inside we are no one special once we exec, and tmpfs owners resolve.
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


# seccomp filter (classic BPF over `struct seccomp_data`: nr at offset 0, arch at 4, args[0] at 16).
_AUDIT_ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SYSCALLS = {
    "x86_64": {"unshare": 272, "clone": 56, "clone3": 435},
    "aarch64": {"unshare": 97, "clone": 220, "clone3": 435},
}
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JSET_K, _BPF_RET_K = 0x20, 0x15, 0x45, 0x06
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO, _SECCOMP_MODE_FILTER = 0x7FFF0000, 0x00050000, 2


def _user_namespace_filter(machine: str) -> bytes | None:
    """The BPF program: unshare/clone with CLONE_NEWUSER get EPERM, clone3 gets ENOSYS (its flags sit in memory a
    filter cannot read; libc then uses clone), everything else passes. None on an architecture not listed."""
    if machine not in _SYSCALLS:
        return None
    nr = _SYSCALLS[machine]
    allow, enosys = _SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO | errno.ENOSYS
    program = [  # (code, jump if true, jump if false, k)
        (_BPF_LD_W_ABS, 0, 0, 4),
        (_BPF_JEQ_K, 1, 0, _AUDIT_ARCHES[machine]),
        (_BPF_RET_K, 0, 0, allow),
        (_BPF_LD_W_ABS, 0, 0, 0),
        (_BPF_JEQ_K, 0, 1, nr["clone3"]),
        (_BPF_RET_K, 0, 0, enosys),
        (_BPF_JEQ_K, 1, 0, nr["unshare"]),
        (_BPF_JEQ_K, 0, 3, nr["clone"]),
        (_BPF_LD_W_ABS, 0, 0, 16),
        (_BPF_JSET_K, 0, 1, CLONE_NEWUSER),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.EPERM),
        (_BPF_RET_K, 0, 0, allow),
    ]
    return b"".join(struct.pack("HBBI", *instruction) for instruction in program)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _refuse_user_namespaces() -> None:
    program = _user_namespace_filter(os.uname().machine)
    if program is None:
        return
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _sys("prctl", PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0)


def _kill_if_alive(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _relay_exit(pid: int) -> None:
    """In the intermediate process: wait for the sandbox and exit the way it did."""
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # incl. Popen's exec-status pipe, which the parent waits on
    # The sandbox may have exited (and been reaped below) by the time the kill comes: nothing left to kill.
    signal.signal(signal.SIGTERM, lambda *_: _kill_if_alive(pid))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    status = os.waitpid(pid, 0)[1]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _mount_private_tree(plan: _Plan, limits: SandboxLimits, uid: int | None, user_dir: str | None) -> None:
    """In the sandbox (pid 1, still privileged): private /tmp, /var/tmp, /dev/shm and /proc; interpreter and
    `user_dir` visible at their own paths."""
    owner, group = (uid, uid) if uid is not None else (os.getuid(), os.getgid())
    _sys("mount", b"none", b"/", None, MS_REC | MS_PRIVATE, None)  # nothing below propagates to the host
    bound = [*plan.interpreter, *([user_dir] if user_dir else [])]
    # Opened before the tmpfs mounts below can cover them (e.g. a directory under /tmp or /root).
    keep = [os.open(d, os.O_PATH | os.O_DIRECTORY) for d in bound]
    for hole in plan.holes:
        _sys("mount", b"tmpfs", hole.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=755,size=1m")
    tmp_options = f"mode=700,uid={owner},gid={group},size={limits.memory_mb}m".encode()
    _sys("mount", b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, tmp_options)
    for directory, fd in zip(bound, keep):
        os.makedirs(directory, exist_ok=True)
        _sys("mount", f"/proc/self/fd/{fd}".encode(), directory.encode(), None, MS_BIND | MS_REC, None)
        os.close(fd)
    for shared in SHARED_WRITABLE_DIRS:
        if os.path.isdir(shared):
            _sys("mount", b"/tmp", shared.encode(), None, MS_BIND, None)
    _sys("mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)  # only our own processes
    os.chdir("/tmp")


def _result(
    capture: _Capture, returncode: int, killed: bool, limits: SandboxLimits, elapsed: float, oom_kills: int = 0
) -> SandboxResult:
    stdout = capture.stdout.decode(errors="replace")
    stderr = capture.stderr.decode(errors="replace")
    violations = []
    if capture.timed_out:
        violations.append(f"wall-clock limit of {limits.wall_time_s:g} s")
    if returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and not killed and not oom_kills):
        violations.append(f"CPU time limit of {limits.cpu_time_s:g} s")
    if oom_kills or re.search(r"MemoryError\b|Cannot allocate memory", stderr):
        violations.append(f"memory limit of {limits.memory_mb} MB")
    if re.search(r"BlockingIOError: \[Errno 11\]|can't start new thread", stderr):
        violations.append(f"process limit of {limits.max_processes}")
    if not limits.allow_network and re.search(
        r"Network is unreachable|Temporary failure in name resolution|Cannot assign requested address", stderr
    ):
        violations.append("network is disabled")
    if capture.cut:
        violations.append(f"output cut at {limits.max_output_bytes} bytes")
    if returncode == 126 and stderr.startswith(SETUP_ERROR):
        violations.append(stderr.strip())
    if returncode < 0 and not violations:
        violations.append(f"killed by {signal.Signals(-returncode).name}")
    exit_code = None if returncode < 0 else returncode
    return SandboxResult(stdout, stderr, exit_code, "; ".join(violations) or None, elapsed, limits.max_output_bytes)


def _last_error_line(stderr: str) -> str | None:
    """The exception line of a traceback ("ValueError: ..."), with the line of the user's script it points to."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    if 'File "' not in stderr or not re.fullmatch(r"[A-Za-z_][\w.]*(: .*)?", lines[-1]):
        return None
    at = re.findall(rf'File "(?:[^"]*/)?{re.escape(SCRIPT)}", line (\d+)', stderr)
    return lines[-1] + (f" (line {at[-1]})" if at else "")


def _cut(text: str, max_bytes: int) -> str:
    return text.encode()[: max(max_bytes, 0)].decode(errors="ignore")
