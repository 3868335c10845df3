"""A name -> implementation table per algorithm kind, filled by `@register_*` decorators.

Built-in implementations register themselves when their module is imported; user code does the same in its
own module and names that module with `--custom-algorithm-module`, which `load_user_registrations` imports
(in the driver before the flags' choices are checked, and again in every process that looks a name up).
"""

from __future__ import annotations

import importlib
from argparse import Namespace
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Implementations of one algorithm kind, keyed by the name a flag selects them with.

    Args:
        kind: What the entries are, for messages (`"advantage estimator"`).
        flag: The command-line flag that picks an entry (`"--advantage-estimator"`).
    """

    def __init__(self, kind: str, flag: str):
        self.kind = kind
        self.flag = flag
        self._entries: dict[str, T] = {}
        self._origins: dict[str, str] = {}

    def add(self, name: str, entry: T, origin: str) -> None:
        """Register `entry` under `name`; `origin` (`module.qualname`) tells a re-import from a real clash."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty string name, got {name!r}")
        if name in self._entries and self._origins[name] != origin:
            raise ValueError(
                f"{self.kind} {name!r} is already registered by {self._origins[name]}; {origin} must use another name"
            )
        self._entries[name] = entry
        self._origins[name] = origin

    def get(self, name: str) -> T:
        """The entry registered as `name`; a ValueError listing the registered names otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r} for {self.flag}; registered: {', '.join(self.names())}. "
                "Register your own with its @register_* decorator in a module passed to --custom-algorithm-module."
            ) from None

    def names(self) -> list[str]:
        """Registered names, built-ins first, in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def origin_of(fn: Callable[..., Any]) -> str:
    """`module.qualname` of a function, the identity `Registry.add` compares."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def load_user_registrations(modules: Iterable[str] | str | None) -> None:
    """Import the user modules named by `--custom-algorithm-module`, so their `@register_*` decorators run.

    Idempotent and cheap after the first call (imported modules are cached by Python).

    Args:
        modules: Dotted module paths (`my_pkg.my_algos`), one path, or None for none.

    Raises:
        ValueError: a module that cannot be imported, naming it and the flag.
    """
    if not modules:
        return
    if isinstance(modules, str):
        modules = [modules]
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(
                f"--custom-algorithm-module {module}: cannot import it ({e}). Pass a dotted module path that is "
                "importable from the working directory or PYTHONPATH, e.g. my_pkg.my_algorithms."
            ) from e


def load_from_args(args: Namespace) -> None:
    """`load_user_registrations(args.custom_algorithm_module)`; a no-op for namespaces without the flag (the
    algorithms are also called with hand-built namespaces: tests, docs' snippets, user code)."""
    load_user_registrations(getattr(args, "custom_algorithm_module", None))


def import_object(path: str, flag: str) -> Any:
    """Import `pkg.module.attr` named by `flag` (a `--custom-*-function-path`) and return the attribute."""
    module_path, _, attr = path.rpartition(".")
    if not module_path:
        raise ValueError(f"{flag} {path!r} is not a dotted path like my_pkg.my_module.my_function")
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ValueError(f"{flag} {path}: cannot import module {module_path!r} ({e}); is it on PYTHONPATH?") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{flag} {path}: module {module_path!r} has no attribute {attr!r}") from None
