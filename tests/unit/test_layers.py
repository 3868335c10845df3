"""The package layout keeps its layers: the import-linter contracts in pyproject.toml hold (`lint-imports`).

Contracts: slime.ray above slime.rollout | slime.backends (independent) above slime.agent above slime.utils above
slime.algorithms (which imports nothing else of slime), the backends
independent of each other, slime.utils never importing slime.ray, the layers never importing slime.plugins, and no
import cycle between sibling modules at any depth.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the packages under `root`, with the contracts of `root/pyproject.toml`."""
    env = dict(os.environ, PYTHONPATH=str(root))  # the packages under `root`, not an installed copy
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache", "--no-logo"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


def test_import_contracts_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, f"an import contract is broken:\n{result.stdout}\n{result.stderr}"
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def copy_of_the_repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layout")
    shutil.copytree(REPO / "slime", root / "slime", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize(
    "importer, imported, broken",
    [
        (
            "slime/utils/job_reaper.py",  # imported by slime.ray only: no backend reaches slime.ray through it
            "slime.ray.rollout",
            ["Layers", "slime.utils never imports slime.ray", "No import cycle"],  # slime.ray imports utils
        ),
        ("slime/backends/cpu_engine/server.py", "slime.backends.fsdp_utils.model", ["backends never import"]),
        ("slime/backends/megatron_utils/unwrap.py", "slime.backends.megatron_utils.model", ["No import cycle"]),
        ("slime/rollout/data_source.py", "slime.plugins.models", ["The layers never import slime.plugins"]),
        ("slime/algorithms/gae.py", "slime.utils.types", ["Layers", "No import cycle"]),  # utils imports algorithms
        ("slime/rollout/data_source.py", "slime.backends.train_actor", ["Layers"]),
    ],
    ids=[
        "utils-imports-ray",
        "backend-imports-backend",
        "cycle",
        "imports-plugins",
        "algorithms-import-utils",
        "rollout-imports-backends",
    ],
)
@pytest.mark.reliability("a module that imports across the layers", "lint-imports names the broken contract")
def test_a_forbidden_import_breaks_its_contract(copy_of_the_repo, importer, imported, broken):
    path = copy_of_the_repo / importer
    original = path.read_text()
    try:
        path.write_text(original + f"\nimport {imported}  # added by test_layers\n")
        result = lint_imports(copy_of_the_repo)
    finally:
        path.write_text(original)
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert all(any(name in line for line in lines) for name in broken), result.stdout
    assert len(lines) == len(broken), result.stdout
    assert Path(importer).stem in result.stdout  # the report names the offending module
