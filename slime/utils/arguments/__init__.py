"""slime's command line: one parser for three kinds of flags.

1. Megatron flags (`--tensor-model-parallel-size`, `--lr`, `--num-layers`, ...).
   With `--train-backend megatron` and Megatron-LM's `megatron.training` importable, Megatron's
   own parser reads them and every Megatron flag passes through untouched; slime only changes a few
   defaults (see `MEGATRON_DEFAULT_OVERRIDES`). Otherwise slime registers the subset of Megatron
   flags it reads itself, under Megatron's names. Under `--train-backend fsdp` any other flag is an
   error (so typos are caught). Under `--train-backend megatron` without `megatron.training` (the
   pip wheel of megatron-core ships only `megatron.core`), unknown flags such as the model flags of
   `scripts/models/*.sh` are kept as typed values (`args.num_layers == 28`) and listed in
   `args.megatron_passthrough_args`, with a warning, because no Megatron parser exists to check them.
2. `--sglang-<flag>` goes to every SGLang engine and `--router-<flag>` to sglang-router. With the
   package installed, each field of its `ServerArgs` / `RouterArgs` is registered with its own type
   and default, and `args.sglang_server_args` / `args.router_args` hold every registered field.
   Without it (the CPU case for SGLang) any `--sglang-xxx [values]` is accepted: a bare flag is True,
   one value is typed (int, float, true/false, JSON list/object, else str), several values make a
   list; the dicts then hold only the flags given. Each value is also `args.sglang_<field>` /
   `args.router_<field>`. slime's own `--sglang-router-ip`, `--sglang-router-port`,
   `--sglang-router-request-timeout-secs`, `--sglang-server-concurrency` and `--sglang-config` are
   never forwarded.
3. slime's own flags, grouped as in `--help`.

Every registered flag has an effect: it is read after parsing, consumed by the parser itself
(`PARSE_TIME_FLAGS`), or refused at parse time with the reason and the alternative (`REFUSED_FLAGS`;
tests/unit/test_every_flag.py keeps it so).

Errors: a malformed command line (unknown flag, bad choice, bad JSON, odd `--eval-prompt-data`
count) exits through argparse with status 2. A well-formed but inconsistent one (checked by
`validate_args`) raises `ArgumentValidationError`, whose message names the flags and the fix.

On a machine without CUDA the defaults switch to `--train-backend fsdp --rollout-backend cpu`,
one trainer process (`--actor-num-gpus-per-node 1`), one "GPU" per node and one rollout engine.
There a "GPU" in the `*-num-gpus*` flags is one CPU slot: trainer processes for the actor, engine
slots for rollout, so the number of CPU engines is
`--rollout-num-gpus / --rollout-num-gpus-per-engine`.

Modules: `parsing` (`parse_args`), `parser` (`build_parser`, `add_slime_arguments`: the groups in --help order),
`cluster` (placement, engines, router, `--sglang-*` / `--router-*` forwarding), `training`, `rollout`,
`algorithm`, `checkpoint`, `reporting`, `debug`, `megatron` (the Megatron subset and the FSDP meanings of
Megatron flags), `config_file` (--custom-config-path), `refused` (`REFUSED_FLAGS`, `PARSE_TIME_FLAGS`),
`validation` (`validate_args`), `flag_values` and `errors`. Import from `slime.utils.arguments`.
"""

from slime.utils.arguments.algorithm import ADVANTAGE_ESTIMATORS, KL_LOSS_TYPES
from slime.utils.arguments.cluster import (
    _ROUTER_EXCLUDED,
    _SGLANG_EXCLUDED,
    ROUTER_MANAGED_FIELDS,
    SGLANG_MANAGED_FIELDS,
    _forwarded_actions,
    _router_source_parser,
    _sglang_source_parser,
)
from slime.utils.arguments.errors import ArgumentValidationError
from slime.utils.arguments.flag_tests import FLAG_TESTS
from slime.utils.arguments.flag_values import _extract_unknown_flags
from slime.utils.arguments.megatron import (
    FSDP_ATTENTION_BACKENDS,
    add_fsdp_megatron_arguments,
    add_megatron_subset_arguments,
)
from slime.utils.arguments.parser import add_slime_arguments, build_parser, default_args
from slime.utils.arguments.parsing import parse_args
from slime.utils.arguments.refused import PARSE_TIME_FLAGS, REFUSED_FLAGS
from slime.utils.arguments.validation import validate_args

# The names imported from this package elsewhere in slime, tools and tests.
__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "FLAG_TESTS",
    "FSDP_ATTENTION_BACKENDS",
    "KL_LOSS_TYPES",
    "PARSE_TIME_FLAGS",
    "REFUSED_FLAGS",
    "ROUTER_MANAGED_FIELDS",
    "SGLANG_MANAGED_FIELDS",
    "ArgumentValidationError",
    "add_fsdp_megatron_arguments",
    "add_megatron_subset_arguments",
    "add_slime_arguments",
    "build_parser",
    "default_args",
    "parse_args",
    "validate_args",
    # private helpers that slime.backends.megatron_utils.standalone and the parser tests reach for
    "_extract_unknown_flags",
    "_forwarded_actions",
    "_router_source_parser",
    "_sglang_source_parser",
    "_ROUTER_EXCLUDED",
    "_SGLANG_EXCLUDED",
]
