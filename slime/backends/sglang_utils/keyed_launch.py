"""`python -m slime.backends.sglang_utils.keyed_launch MODULE ARGS...`: run `python -m MODULE ARGS...` with
`--api-key` taken from `$SLIME_ENGINE_API_KEY`.

SGLang reads its key only from the command line, and a process's command line is readable by every local user
(/proc/<pid>/cmdline); its environment is not. The flag is added to `sys.argv` inside this process, which leaves
the command line the kernel shows unchanged.
"""

from __future__ import annotations

import os
import runpy
import sys

from slime.utils.engine_args import ENGINE_API_KEY_ENV


def with_key(argv: list[str], key: str | None) -> list[str]:
    """The arguments the server parses: `argv`, then `--api-key=key` when there is a key (one word: a key may
    start with "-", which argparse would take for an option after a separate `--api-key`)."""
    return [*argv, f"--api-key={key}"] if key else list(argv)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m slime.backends.sglang_utils.keyed_launch MODULE [ARGS...]")
    module = sys.argv[1]
    key = os.environ.pop(ENGINE_API_KEY_ENV, None)  # the server's own children need not see it
    sys.argv = [module, *with_key(sys.argv[2:], key)]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
