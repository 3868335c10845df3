"""Run a function in N fresh gloo processes (forked from a fork server with the heavy imports done) with
megatron-core redirected to the CPU.

The CUDA->CPU patch (`slime.backends.megatron_utils.cpu_compat`) is applied only inside the spawned
workers, never in the pytest process: HF reference models run in the pytest process untouched.

    results = run_in_processes(worker, world_size=2, args=(model_dir,))

`worker(rank, world_size, *args)` must be a module-level function (it is pickled by name); its
return value must be picklable (tensors are fine) and comes back as `results[rank]`.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from slime.utils.http_utils import find_free_port
from support.ranks import rank_process_context

# A module-level `pytestmark`: checks that megatron-core is installed without importing it (~3 s) in every test
# process that collects the module; the ranks import it, in the fork server.
requires_megatron_core = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed: pip install -e '.[megatron]'",
)

# Generous: two processes share two busy cores.
DEFAULT_TIMEOUT_S = 240


def _worker_main(fn: Callable, rank: int, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    out = Path(out_dir) / f"rank{rank}"
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)

        from slime.backends.megatron_utils.cpu_compat import apply_cpu_patch

        apply_cpu_patch()
        result = fn(rank, world_size, *args)
        torch.save(result, out.with_suffix(".pt"))
    except BaseException:
        out.with_suffix(".err").write_text(traceback.format_exc())
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_in_processes(
    fn: Callable[..., Any], world_size: int, args: tuple = (), timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned gloo processes and return their results.

    Raises:
        RuntimeError: a worker failed (its traceback is in the message) or timed out.
    """
    context = rank_process_context()
    port = find_free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        processes = [
            context.Process(target=_worker_main, args=(fn, rank, world_size, port, out_dir, args))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        # Poll: when one worker fails the others may wait forever in a collective, so stop them all.
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
            if any(Path(out_dir).glob("*.err")):
                break
            time.sleep(0.2)
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()
        errors = sorted(Path(out_dir).glob("*.err"))
        if errors:
            raise RuntimeError("\n".join(f"{e.stem}:\n{e.read_text()}" for e in errors))
        results = []
        for rank, process in enumerate(processes):
            result_file = Path(out_dir) / f"rank{rank}.pt"
            if process.exitcode != 0 or not result_file.is_file():
                raise RuntimeError(f"worker {rank} exited with {process.exitcode} (timeout {timeout_s}s?)")
            results.append(torch.load(result_file, weights_only=False))
        return results
