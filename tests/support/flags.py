"""slime's flags at their parsed defaults, for tests that hand a component (an engine command line, an engine actor)
the args it reads without a whole command line."""

from __future__ import annotations

import functools
from argparse import Namespace


@functools.cache
def _defaults() -> dict:
    from slime.utils.arguments import default_args

    return vars(default_args())


def slime_flags(**changed) -> Namespace:
    """A namespace with every slime flag at the default `parse_args` gives it (no `--sglang-*` / `--router-*` flags
    given), and `changed` on top (`slime.utils.arguments.default_args`, built once per process)."""
    return Namespace(**(_defaults() | changed))
