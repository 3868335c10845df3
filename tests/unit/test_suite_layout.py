"""The suite keeps its shape: every test module sits in a tier folder, no test module imports another (shared
helpers live in tests/support/), and unit tests start no Ray, engine, router or driver run."""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "e2e")
# What a unit test must not reach for: a Ray cluster, engine/router processes, driver runs, spawned Megatron ranks.
NOT_IN_UNIT = ("ray", "support.engines", "support.runs", "support.megatron_cpu", "support.megatron_actor")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


TEST_MODULES = sorted(TESTS.rglob("test_*.py"))


def test_every_test_module_sits_in_a_tier():
    misplaced = [p.relative_to(TESTS).as_posix() for p in TEST_MODULES if p.relative_to(TESTS).parts[0] not in TIERS]
    assert not misplaced, f"move these into tests/unit, tests/integration or tests/e2e: {misplaced}"
    assert all(list((TESTS / tier).glob("test_*.py")) for tier in TIERS)


@pytest.mark.parametrize("path", TEST_MODULES, ids=lambda p: p.name)
def test_no_test_module_imports_another(path):
    others = sorted(m for m in imported_modules(path) if m.split(".")[0].startswith("test_"))
    assert not others, f"{path.name} imports test modules {others}: move what they share into tests/support/"


@pytest.mark.parametrize("path", sorted((TESTS / "unit").glob("test_*.py")), ids=lambda p: p.name)
def test_unit_tests_start_no_process_tier(path):
    heavy = sorted(m for m in imported_modules(path) if any(m == h or m.startswith(h + ".") for h in NOT_IN_UNIT))
    assert not heavy, f"{path.name} imports {heavy}: it belongs in tests/integration or tests/e2e"
