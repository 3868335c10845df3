"""The error `validate_args` and the parse-time checks raise for a well-formed but unusable command line."""

from __future__ import annotations


class ArgumentValidationError(ValueError):
    """A combination of flags that cannot work; the message names the flags and the fix."""


# Shown in tracebacks and used by pickle: keep the path users import it from.
ArgumentValidationError.__module__ = "slime.utils.arguments"


def _fail(message: str) -> None:
    raise ArgumentValidationError(message)
