"""slime's router launcher (`slime.backends.sglang_utils.launch_router`) reads sglang-router's flags exactly as
`python -m sglang_router.launch_router` does: the same `RouterArgs` for the same command line."""

from __future__ import annotations

import pytest
from sglang_router.launch_router import parse_router_args as upstream_parse_router_args

from slime.backends.sglang_utils.launch_router import parse_router_args

SLIME_DEFAULTS = [
    "--host", "127.0.0.1", "--port", "30001", "--prometheus-host", "127.0.0.1", "--prometheus-port", "30002",
    "--request-timeout-secs", "120", "--log-level", "warn", "--disable-circuit-breaker", "--disable-health-check",
]  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        [],
        SLIME_DEFAULTS,
        [*SLIME_DEFAULTS, "--policy", "cache_aware", "--cache-threshold", "0.3", "--max-payload-size", "1024"],
        ["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2", "--policy", "round_robin"],
        ["--mini-lb", "--pd-disaggregation", "--prefill", "http://127.0.0.1:3", "--decode", "http://127.0.0.1:4"],
    ],
)
def test_flags_parse_as_sglang_routers_own_launcher(argv):
    assert parse_router_args(argv) == upstream_parse_router_args(argv)


def test_an_unknown_flag_is_refused_as_upstream_refuses_it(capsys):
    with pytest.raises(SystemExit):
        parse_router_args(["--no-such-router-flag"])
    assert "--no-such-router-flag" in capsys.readouterr().err
