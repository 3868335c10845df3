"""Run a repository script (`tools/*.py`) as a user would, `python SCRIPT ARGS` from the repository root, but in a
process forked from the preloaded fork server (support.ranks): the script's own `__main__` code, argument parsing,
exit status and output, without a fresh interpreter importing torch, transformers and megatron-core again (~5 s of
a busy core per run)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

from support.ranks import ForkedProcess

REPO = Path(__file__).resolve().parents[2]


def _run_as_main(script: str, argv: list[str], out_path: str, err_path: str) -> None:
    os.chdir(REPO)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    import torch

    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a fresh interpreter
    sys.argv = [script, *argv]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_script(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`subprocess.run([python, script, *args], cwd=REPO, capture_output=True, text=True)`, forked instead of spawned.

    Args:
        script: Path relative to the repository root, e.g. "tools/convert_to_hf.py".
        timeout: Seconds before the process is killed and `subprocess.TimeoutExpired` raised.
    """
    with tempfile.TemporaryDirectory(prefix="slime_script_") as folder:
        out_path, err_path = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        for path in (out_path, err_path):
            Path(path).touch()
        process = ForkedProcess(_run_as_main, (script, list(args), out_path, err_path))
        returncode = process.wait(timeout)
        if returncode is None:
            process.kill()
            process.wait(10)
            raise subprocess.TimeoutExpired([script, *args], timeout)
        return subprocess.CompletedProcess(
            [script, *args], returncode, Path(out_path).read_text(), Path(err_path).read_text()
        )
