"""Run megatron-core on a machine without CUDA (gloo, fp32): for the conversion tools and CPU tests.

megatron-core 0.16 assumes a GPU in a few places: `torch.cuda.current_device()` as a device,
`torch.cuda.synchronize()`, the CUDA RNG tracker, and `device="cuda"` literals. Instead of patching
torch for the whole process, `apply_cpu_patch()` swaps the `torch` global of every loaded
`megatron.core` module for a stand-in that sends those calls to the CPU and forwards everything else
to the real torch. Other libraries in the process keep the real torch.

Rules:
- It is a no-op when CUDA is available; never call it in the GPU training path.
- Call it before building models. It patches the megatron modules loaded at that time (it imports
  the usual ones itself); call it again after importing other megatron modules.
- Keep it out of processes that also run transformers models: the patch is scoped to megatron's
  modules, but two tensor methods change for the whole process: `Tensor.cuda()` returns the tensor
  itself, and `Tensor.type()` (no arguments) calls CPU tensors "torch.cuda.*Tensor", because
  megatron's optimizers accept parameters only under those names.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import torch

from slime.utils.device import cuda_available

# Factory functions that take `device=`; a CUDA device there becomes the CPU.
_FACTORIES = (
    "arange",
    "empty",
    "empty_like",
    "full",
    "full_like",
    "ones",
    "ones_like",
    "rand",
    "randn",
    "tensor",
    "zeros",
    "zeros_like",
)

# Imported up front so their `torch` global is swapped (megatron imports some of them lazily).
_MEGATRON_MODULES = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.pipeline_parallel.schedules",
)

_patched = False


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


def _on_cpu(factory):
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return wrapper


class _CudaOnCpu(types.ModuleType):
    """`torch.cuda` as megatron sees it: device, sync and RNG calls land on the CPU."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.current_device = lambda: torch.device("cpu")
        self.synchronize = lambda *args, **kwargs: None
        self.empty_cache = lambda: None
        self.manual_seed = torch.manual_seed
        self.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
        self.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
        self.random = types.SimpleNamespace(get_rng_state=self.get_rng_state, set_rng_state=self.set_rng_state)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """`torch` as megatron sees it: real torch, except `torch.cuda` and CUDA devices in factories."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_TORCH_ON_CPU = _TorchOnCpu()


def _tensor_cuda_on_cpu(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return self


_tensor_type = torch.Tensor.type


def _tensor_type_as_cuda(self: torch.Tensor, *args, **kwargs):
    """`t.type()` names CPU tensors like CUDA ones ("torch.cuda.FloatTensor"): megatron's optimizers
    accept parameters only by those names. `t.type(dtype)` conversions are unchanged."""
    name = _tensor_type(self, *args, **kwargs)
    if args or kwargs or not name.startswith("torch.") or name.startswith("torch.cuda."):
        return name
    return "torch.cuda." + name[len("torch.") :]


def apply_cpu_patch() -> bool:
    """Redirect megatron-core's CUDA calls to the CPU when CUDA is absent.

    Returns:
        True if the patch is (now or already) active, False when CUDA is available and nothing changed.
    """
    global _patched
    if cuda_available():
        return False
    for name in _MEGATRON_MODULES:
        importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = _TORCH_ON_CPU
    if _patched:
        return True

    # The CUDA RNG tracker reads and writes generator state through these two helpers.
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # Without TE, megatron-core 0.16's MoE router refers to an undefined `te_general_gemm`; None selects torch.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # `.cuda()` on a tensor cannot be caught per module; on a CPU-only torch it can only fail anyway.
    torch.Tensor.cuda = _tensor_cuda_on_cpu
    torch.Tensor.type = _tensor_type_as_cuda
    _patched = True
    return True
