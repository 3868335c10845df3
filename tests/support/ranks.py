"""Processes a test starts (FSDP and Megatron ranks, CPU engine servers): forked from one fork server per test
process that has already imported the heavy modules, instead of fresh interpreters that each import them again
(~4 s of a busy core each)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable

import torch.multiprocessing as torch_mp

# What a rank or an engine imports anyway; the fork server imports them once (a module that fails to import is skipped, as
# megatron-core is when it is not installed). The fork server does not see the tests' sys.path: installed names only.
PRELOAD = [
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",  # the tiny test model's classes: transformers imports them lazily
    "peft",  # the LoRA tests' reference models
    "slime.backends.fsdp_utils.actor",
    "megatron.core",
    "megatron.core.models.gpt",
    "slime.backends.megatron_utils.actor",
    "slime.backends.cpu_engine.server",
]


def rank_process_context() -> multiprocessing.context.BaseContext:
    """A fork server that has imported torch, transformers, megatron-core and slime's actors once (`PRELOAD`):
    every rank is a fresh process forked from it, so no state leaks between tests and none pays the imports again.
    The fork server itself never applies the CPU patch or touches torch.distributed."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def spawn_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)` with the ranks forked from the preloaded fork server."""
    rank_process_context()
    torch_mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


class ForkedProcess:
    """A `multiprocessing.Process` from the fork server with the part of `subprocess.Popen`'s interface the tests and
    `wait_until_healthy` use: `pid`, `poll()`, `returncode`, `terminate()`, `kill()`, `wait(timeout)`."""

    def __init__(self, target: Callable, args: tuple = ()):
        self._process = rank_process_context().Process(target=target, args=args)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        return self._process.exitcode
