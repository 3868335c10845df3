"""Small helpers used across slime."""

from __future__ import annotations

import ctypes
import functools
import importlib
import inspect
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Upstream slime's plugins are a top-level package; slime's are `slime.plugins`, so a user's own package of
# upstream's name is never shadowed (see slime/plugins/__init__.py).
UPSTREAM_PLUGINS, BUNDLED_PLUGINS = "slime_plugins", "slime.plugins"


def load_function(path: str) -> Callable[..., Any]:
    """Import `pkg.module.attr` and return the attribute (function or class).

    A path into upstream's `slime_plugins` package loads the user's module of that name when there is one, else
    slime's own (`slime_plugins.models.glm4` -> `slime.plugins.models.glm4`).

    Raises a ValueError that names the path and what went wrong, so a typo in a
    `--*-path` flag is obvious.
    """
    module_path, _, attr = path.rpartition(".")
    if not module_path:
        raise ValueError(f"'{path}' is not a dotted path like 'my_pkg.my_module.my_function'")
    try:
        module = _import_module(module_path)
    except ImportError as e:
        raise ValueError(f"cannot import module '{module_path}' for '{path}': {e}. Is it on PYTHONPATH?") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ValueError(f"module '{module_path}' has no attribute '{attr}' (from '{path}')") from e


def _import_module(module_path: str) -> Any:
    try:
        return importlib.import_module(module_path)
    except ModuleNotFoundError as missing:
        if module_path.split(".")[0] != UPSTREAM_PLUGINS or not _is_missing(missing, module_path):
            raise
        bundled = BUNDLED_PLUGINS + module_path.removeprefix(UPSTREAM_PLUGINS)
        try:
            return importlib.import_module(bundled)
        except ModuleNotFoundError as error:
            if _is_missing(error, bundled):
                raise missing from None  # neither the user's nor slime's: report the path as given
            raise


def _is_missing(error: ModuleNotFoundError, module_path: str) -> bool:
    """`error` says `module_path` (or a package on its way) does not exist, not that an import inside it failed."""
    return error.name is not None and (module_path == error.name or module_path.startswith(error.name + "."))


class SingletonMeta(type):
    """Metaclass whose classes have one instance per process: the first call constructs it, later calls
    (whatever their arguments) return it. `MyClass.forget_instance()` drops it, so the next call builds anew."""

    _instances: dict[type, Any] = {}
    _lock = threading.RLock()  # re-entrant: a singleton's __init__ may construct another singleton

    def __call__(cls, *args, **kwargs):
        with SingletonMeta._lock:
            if cls not in SingletonMeta._instances:
                SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
            return SingletonMeta._instances[cls]

    def forget_instance(cls) -> None:
        with SingletonMeta._lock:
            SingletonMeta._instances.pop(cls, None)


async def maybe_await(value: Any) -> Any:
    """Await `value` if it is awaitable, so user hooks may be sync or async."""
    if inspect.isawaitable(value):
        return await value
    return value


def should_run_periodic_action(
    rollout_id: int, interval: int | None, num_rollout_per_epoch: int | None = None, num_rollout: int | None = None
) -> bool:
    """True after every `interval` rollouts, at each epoch end and, when `num_rollout` is given, at the last rollout.

    Nothing runs when `interval` is None (the flag was not set).
    """
    if not interval:
        return False
    done = rollout_id + 1
    end_of_epoch = bool(num_rollout_per_epoch) and done % num_rollout_per_epoch == 0
    return done % interval == 0 or end_of_epoch or done == num_rollout


def release_free_host_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's `malloc_trim`); a no-op elsewhere.

    glibc keeps freed small and mid-sized blocks (a training step's activations, below its mmap threshold) for
    reuse, so a process's resident size only grows between steps unless asked. No garbage collection first: what
    is freed here goes by reference counts (a collection after FSDP train steps, with and without the reference
    model, and after an offload found no unreachable object), and a full collection costs 0.2 s in a process that
    has imported torch, transformers and megatron-core (a tiny model's whole train step, again).
    """
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def load_pretrained(loader: Any, path: str, trust_remote_code: bool = False, **kwargs: Any) -> Any:
    """`loader.from_pretrained(path, **kwargs)` (an `AutoTokenizer`, `AutoConfig`, `AutoModel...` class) that runs
    Python code shipped in the model folder only under `--trust-remote-code`.

    Without it, a folder whose `auto_map` names its own `.py` (and whose classes do not ship with transformers) is
    refused; its code never runs.

    Raises:
        ValueError: naming the folder and `--trust-remote-code`, when the folder needs its own code.
    """
    try:
        return loader.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except ValueError as error:
        if trust_remote_code or "trust_remote_code" not in str(error):
            raise
        raise ValueError(
            f"{path} needs Python code from its own folder (auto_map in its config or tokenizer_config.json); slime "
            "runs such code only with --trust-remote-code. Pass it if you trust that code, or use a model whose "
            "classes ship with transformers"
        ) from None


def load_tokenizer(path: str, trust_remote_code: bool = False, **kwargs: Any) -> Any:
    """The tokenizer of an HF folder, by `load_pretrained` (its own code runs only under `--trust-remote-code`).

    A tokenizer without a chat template takes the folder's processor's (`chat_template.jinja`, or the template in
    `chat_template.json`), where vision-language checkpoints often keep it.
    """
    from transformers import AutoTokenizer

    tokenizer = load_pretrained(AutoTokenizer, path, trust_remote_code, **kwargs)
    if getattr(tokenizer, "chat_template", None) is None:
        folder = Path(path)
        if (folder / "chat_template.jinja").is_file():
            tokenizer.chat_template = (folder / "chat_template.jinja").read_text()
        elif (folder / "chat_template.json").is_file():
            tokenizer.chat_template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return tokenizer
