"""The `perf/` figures of every step: phase times, model FLOPs and MFU, peak memory.

Phase times (seconds) under `perf/<phase>_time`. The driver's phases `STEP_PHASES` follow each other, so
they add up to `perf/step_time`; finer figures nest inside one of them and are not part of that sum:
`reward` (inside `generate`: summed over concurrent reward calls), `ref_log_probs`, `log_probs` and
`actor_train` / `critic_train` (inside `train`).
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil

logger = logging.getLogger(__name__)

# The driver's phases of one step, in order; each step has some of them (`train_wait`: the async trainer
# waiting for its batch; `offload`: colocated trainer and engines swapping devices).
STEP_PHASES = ("generate", "train_wait", "offload", "train", "save", "update_weights", "eval")

# Dense (no sparsity) BF16 tensor-core peak TFLOPs per GPU, by a substring of torch's device name.
GPU_PEAK_TFLOPS = {
    "GB200": 2500.0,
    "B200": 2250.0,
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "A10": 125.0,
    "4090": 165.0,
}


class PhaseTimer:
    """Wall-clock seconds per phase of one step: `with timer.phase("train"): ...`, then `metrics()`."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def metrics(self) -> dict[str, float]:
        """`perf/<phase>_time` of every phase timed, and `perf/step_time` since the timer was made."""
        out = {f"perf/{name}_time": seconds for name, seconds in self.seconds.items()}
        out["perf/step_time"] = time.perf_counter() - self.started
        return out


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs of a decoder-only transformer depend on (read from its HF config)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    mlp_params_per_layer: int  # weights one token goes through in a layer's MLP (active experts only for MoE)

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        config = config.get_text_config()  # a vision-language model's language model (the config itself otherwise)
        hidden = config.hidden_size
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        matrices = 3  # gate, up and down projections: the gated MLP of every family slime converts
        experts_per_token = getattr(config, "num_experts_per_tok", None)
        if experts_per_token:
            expert_size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
            shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
            mlp = matrices * hidden * (experts_per_token * expert_size + shared)
            mlp += hidden * (getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", 0) or 0)
        else:
            mlp = matrices * hidden * config.intermediate_size
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            mlp_params_per_layer=mlp,
        )


def forward_flops(shape: ModelShape, seq_lens: list[int], head_tokens: int | None = None) -> float:
    """FLOPs of one forward pass over sequences of these lengths.

    Each weight a token passes through costs 2 FLOPs (multiply + add): the attention projections, the MLP
    and, for the `head_tokens` positions whose logits are computed (default: every token), the LM head.
    Attention scores and their weighted sum cost 2 * 2 * s * heads * head_dim per token and layer over the
    full s x s matrix, the usual convention for MFU (PaLM, Megatron). Embedding lookups cost nothing. A
    training step (forward + backward) is 3x this.
    """
    h, q = shape.hidden_size, shape.num_heads * shape.head_dim
    attention_params = h * q + 2 * h * shape.num_kv_heads * shape.head_dim + q * h
    tokens = sum(seq_lens)
    head_tokens = tokens if head_tokens is None else head_tokens
    score_flops = sum(4 * s * s * q for s in seq_lens) * shape.num_layers
    layer_flops = 2.0 * shape.num_layers * (attention_params + shape.mlp_params_per_layer) * tokens
    return layer_flops + 2.0 * shape.vocab_size * h * head_tokens + score_flops


def _proc_cpuinfo() -> str:
    """The text of /proc/cpuinfo; "" where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _first_field(cpuinfo: str, key: str) -> str | None:
    """The value of the first `key : value` line of `cpuinfo` (the first processor's), None when there is none."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return None


def cpu_peak_tflops(num_threads: int | None = None) -> float:
    """FP32 peak of `num_threads` cores (default: torch's thread count): cores x clock x FLOPs per cycle
    (`cpuinfo_peak_tflops` of /proc/cpuinfo; AVX2 at 2 GHz where it cannot be read)."""
    import torch  # torch is imported where it is used: engine actors use this module without it

    threads = num_threads or torch.get_num_threads()
    return cpuinfo_peak_tflops(_proc_cpuinfo() or "flags : avx2 fma\ncpu MHz : 2000", threads)


def cpuinfo_peak_tflops(cpuinfo: str, threads: int) -> float:
    """FP32 peak of `threads` cores of the first processor listed in `cpuinfo` (the text of /proc/cpuinfo).

    FLOPs per cycle per core from its vector units: 2 FMA units x 2 FLOPs x the FP32 lanes (16 with AVX-512, 8 with
    AVX2, 4 otherwise), at its `cpu MHz` (2000 when missing). Both fields are read whatever their order (Linux lists
    `cpu MHz` before `flags`). On a 2.6 GHz AVX-512 core this is 166 GFLOP/s, where torch's 2048 x 2048 float32
    matmul measured 155.
    """
    flags = set((_first_field(cpuinfo, "flags") or "").split())
    mhz = _first_field(cpuinfo, "cpu MHz")
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    return threads * (float(mhz or 0) or 2000.0) * 1e6 * 2 * 2 * lanes / 1e12


def cpu_has_bf16_matmul(cpuinfo: str | None = None) -> bool:
    """Whether the CPU multiplies bf16 in hardware: AMX or AVX512-BF16 among the first `flags` of `cpuinfo` (the
    text of /proc/cpuinfo, read when None; False where there is none). There a bf16 matmul runs about 3x float32's
    rate; without, torch emulates it far below float32 (0.3 GFLOP/s measured on an AVX2 core)."""
    flags = (_first_field(_proc_cpuinfo() if cpuinfo is None else cpuinfo, "flags") or "").split()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def device_peak_tflops(override: float | None = None) -> float | None:
    """`--peak-tflops` when given, else the known peak of this process's GPU (None for an unknown one), else
    `cpu_peak_tflops()`."""
    import torch

    from slime.utils.device import cuda_available

    if override:
        return override
    if not cuda_available():
        return cpu_peak_tflops()
    name = torch.cuda.get_device_name()
    for key, tflops in GPU_PEAK_TFLOPS.items():
        if key in name:
            return tflops
    logger.warning("no known peak TFLOPs for GPU %r: pass --peak-tflops to log MFU", name)
    return None


def peak_memory_gb() -> float:
    """This process's peak memory: GPU memory allocated by torch on a GPU, else the peak resident size."""
    import torch

    from slime.utils.device import cuda_available

    if cuda_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def process_tree_peak_memory_gb(pid: int) -> float:
    """Sum of the peak resident sizes (VmHWM, Linux) of process `pid` and its descendants (0 where unreadable)."""
    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return 0.0
    total_kib = 0
    for process in processes:
        try:
            with open(f"/proc/{process.pid}/status") as f:
                total_kib += next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)
        except (OSError, ValueError):
            continue
    return total_kib / 2**20
