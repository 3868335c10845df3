"""One inference engine: its server process and the control calls that go to it.

`RolloutEngine` is a plain class; the RolloutManager turns it into a Ray actor with
`ray.remote(num_cpus=..., num_gpus=...)(RolloutEngine)`. The server is SGLang on GPU
(`python -m sglang.launch_server`) or slime's CPU engine (`python -m slime.backends.cpu_engine`);
both speak the same HTTP API, so the control methods (inherited from `EngineClient`) are shared.
With `--sglang-api-key KEY` both servers require `Authorization: Bearer KEY`, which the control
methods send; without a key an engine may only bind a loopback address.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

from slime.backends.sglang_utils.engine_command_line import (
    build_cpu_engine_args,
    build_sglang_server_args,
    cpu_engine_num_threads,
    engine_api_key,
)
from slime.backends.sglang_utils.http_client import EngineClient
from slime.backends.sglang_utils.server_process import launch_server_process, server_log_path, stop_server_process
from slime.utils.engine_args import ENGINE_API_KEY_ENV
from slime.utils.http_utils import find_free_port, wait_until_healthy
from slime.utils.perf import process_tree_peak_memory_gb

logger = logging.getLogger(__name__)

BACKENDS = ("sglang", "cpu")
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")


class RolloutEngine(EngineClient):
    """Launches one engine server and forwards control calls to it.

    Args:
        args: slime's parsed arguments (`hf_checkpoint`, `rollout_num_gpus_per_engine`,
            `sglang_server_args`, `offload_rollout`, `cpu_engine_*`, `server_log_dir`).
        rank: Engine index, used in log names.
        backend: "sglang" (GPU) or "cpu".
        host: Address the server binds and is reached at: 127.0.0.1, or on a multi-node cluster this node's IP
            (the RolloutManager passes `PlacementSlice.host`); a non-loopback host needs an API key.
        port: HTTP port; a free one when None.
        model_path: Checkpoint to serve; `args.hf_checkpoint` when None.
        base_gpu_id: First GPU index of this engine on its node (SGLang only).
        nnodes: Nodes one engine spans (SGLang only).
        node_rank: This actor's node within the engine; only node 0 serves HTTP (SGLang only).
        dist_init_addr: "ip:port" of node 0 for multi-node engines (SGLang only).
    """

    def __init__(
        self,
        args: Namespace,
        rank: int,
        backend: str = "sglang",
        host: str = "127.0.0.1",
        port: int | None = None,
        model_path: str | None = None,
        base_gpu_id: int = 0,
        nnodes: int = 1,
        node_rank: int = 0,
        dist_init_addr: str | None = None,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"unknown engine backend {backend!r}; choose one of {BACKENDS}")
        api_key = engine_api_key(args)
        if not api_key and not is_loopback_host(host):
            raise ValueError(
                f"refusing to start engine {rank} on host {host!r} without an API key: engines map weight handles "
                "sent in request bodies and accept weight pushes from anyone who can reach them. Pass "
                "--sglang-api-key KEY (on a multi-node Ray cluster engines listen on their node's IP), or keep the "
                "engine on 127.0.0.1."
            )
        self.args = args
        self.rank = rank
        self.backend = backend
        self.host = host
        self.port = port or find_free_port(host)
        self.model_path = model_path or args.hf_checkpoint
        if not self.model_path:
            raise ValueError("no model to serve: pass --hf-checkpoint (or model_path=) to the rollout engine")
        self.base_gpu_id = base_gpu_id
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.dist_init_addr = dist_init_addr
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        super().__init__(f"http://{host}:{self.port}", api_key=api_key)

    def url(self) -> str:
        """Base URL of the engine's HTTP server, e.g. "http://127.0.0.1:30001"."""
        return self.base_url

    def start(self, timeout: float = 600.0) -> str:
        """Launch the server and wait until GET /health answers.

        Args:
            timeout: Startup timeout in seconds (model load, and CUDA graph capture on GPU).

        Returns:
            The engine's base URL.

        Raises:
            RuntimeError / TimeoutError: The server died or never became healthy; the message names the
                model path and carries the end of the server log.
        """
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"engine {self.rank} is already running at {self.base_url}")
        command, env = self._server_command()
        self.log_path = server_log_path(self.args, f"engine{self.rank}_{self.backend}_{self.port}")
        logger.info("starting %s engine %d at %s (log: %s)", self.backend, self.rank, self.base_url, self.log_path)
        self.process = launch_server_process(command, self.log_path, env=env)
        if self.node_rank != 0:
            return self.base_url  # the engine's HTTP server runs on node 0 only
        try:
            wait_until_healthy(f"{self.base_url}/health", timeout, process=self.process, log_path=self.log_path)
        except (RuntimeError, TimeoutError) as e:
            self.shutdown()
            raise type(e)(f"{self.backend} engine {self.rank} for model {self.model_path} failed to start: {e}") from e
        return self.base_url

    def _server_command(self) -> tuple[list[str], dict[str, str]]:
        env = dict(os.environ)
        env.pop(ENGINE_API_KEY_ENV, None)
        if api_key := engine_api_key(self.args):
            env[ENGINE_API_KEY_ENV] = api_key  # not on the command line, which every local user can read
        if self.backend == "cpu":
            server_args = build_cpu_engine_args(self.args, model_path=self.model_path, host=self.host, port=self.port)
            # Oversubscribed cores are ruinous for CPU decode; the engine gets exactly its thread budget.
            env |= {name: str(cpu_engine_num_threads(self.args)) for name in THREAD_ENV_VARS}
            return [sys.executable, "-m", "slime.backends.cpu_engine", *server_args], env
        server_args = build_sglang_server_args(
            self.args,
            model_path=self.model_path,
            host=self.host,
            port=self.port,
            tp_size=getattr(self.args, "rollout_num_gpus_per_engine", 1),
            base_gpu_id=self.base_gpu_id,
            nccl_port=find_free_port(self.host, exclude={self.port}),
            dist_init_addr=self.dist_init_addr,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
        )
        return [
            sys.executable,
            "-m",
            "slime.backends.sglang_utils.keyed_launch",
            "sglang.launch_server",
            *server_args,
        ], env

    def is_alive(self) -> bool:
        """True while the server process runs (it may still be loading; see `health()`)."""
        return self.process is not None and self.process.poll() is None

    def peak_memory_gb(self) -> float:
        """Peak resident memory of the server's processes, summed (host memory; 0 before it starts)."""
        return process_tree_peak_memory_gb(self.process.pid) if self.process is not None else 0.0

    def shutdown(self) -> None:
        """Stop the server and every process it started. Safe to call more than once."""
        if self.process is not None:
            stop_server_process(self.process)


def is_loopback_host(host: str) -> bool:
    """True for "localhost" and loopback addresses (all of 127.0.0.0/8 and ::1); any other name may be public."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # any other host name may resolve to a public interface
        return False
