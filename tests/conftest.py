"""Suite-wide fixtures and the tiers: each test is marked `unit`, `integration` or `e2e` by the folder it lives in,
and gets that tier's timeout unless it sets its own (`@pytest.mark.timeout(s)`)."""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # `support` (the shared helpers) and the dotted plugin paths tests pass

from support.tiny_model import build_tiny_model  # noqa: E402
from support.tiny_vlm import build_tiny_vlm  # noqa: E402

# What pytest-timeout cannot stop (a hung teardown after a failure, a wait inside ray.get): support/watchdog.py.
from support.watchdog import (  # noqa: E402, F401
    pytest_runtest_call,
    pytest_runtest_protocol,
    pytest_runtest_setup,
    pytest_runtest_teardown,
)

# Seconds a test may take, setup included, before it fails with its name instead of eating the CI budget.
TIER_TIMEOUTS = {"unit": 120, "integration": 400, "e2e": 900}

# The order files run in (scripts/test.sh keeps it with --no-loadscope-reorder: xdist hands each worker whole files).
# The chaos run (200-300 s) first, so that it overlaps the rest of the suite instead of running alone at the end while
# the other workers idle, as it could under xdist's own order; then, as xdist orders them, the files with the most
# tests first (many short unit tests early, the few-test e2e runs spread after them).
# test_driver_restarts next, as another worker's first file: `run_driver` ends the Ray cluster its process is
# connected to, as train.py's does, and a worker that had joined its session cluster before must start a new one
# after each of the file's three runs (~5 s and ~6 CPU-s each); on a worker not connected yet they start none.
RUN_FIRST = ("e2e/test_chaos.py", "integration/test_driver_restarts.py")

# The integration files whose tests use the `ray_cluster` fixture. scripts/test.sh runs them on one worker, one after
# another (support.xdist_units): each worker that runs one starts a Ray cluster of its own (~6 CPU-s, then ~2.4 CPU-s
# a minute for its daemons while the session lasts), and over three workers they cost the fast tier two more.
RAY_CLUSTER_FILES = (
    "integration/test_driver_restarts.py",
    "integration/test_flag_effects_with_actors.py",
    "integration/test_flags_behaviour.py",
    "integration/test_gpu_paths.py",
    "integration/test_progress.py",
    "integration/test_ray_cluster.py",
    "integration/test_rollout_manager.py",
    "integration/test_upstream_contract_manager.py",
    "integration/test_user_files.py",
    "integration/test_weight_sync_disk.py",
)


def order_files(items: list[pytest.Item]) -> None:
    """Sort `items` in place by file: RUN_FIRST files in their order, then by number of tests (most first); a file
    keeps its order."""
    per_file = Counter(str(item.path) for item in items)

    def rank(item: pytest.Item) -> tuple[int, int]:
        relative = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
        first = RUN_FIRST.index(relative) if relative in RUN_FIRST else len(RUN_FIRST)
        return first, -per_file[str(item.path)]

    items.sort(key=rank)  # stable: ties keep the collection order, as xdist's own sort does


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadfile`, whole files, with the RAY_CLUSTER_FILES as one unit (support.xdist_units)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from support.xdist_units import FilesWithOneRayWorker

    return FilesWithOneRayWorker(config, log, ray_files=[f"{TESTS.name}/{path}" for path in RAY_CLUSTER_FILES])


def pytest_collection_modifyitems(config, items):
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        relative = Path(str(item.path)).resolve().relative_to(TESTS)
        tier = relative.parts[0]
        if tier not in TIER_TIMEOUTS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in tests/unit, tests/integration or tests/e2e")
        if (
            tier == "integration"
            and "ray_cluster" in item.fixturenames
            and relative.as_posix() not in RAY_CLUSTER_FILES
        ):
            raise pytest.UsageError(
                f"{item.nodeid} uses the ray_cluster fixture: add {relative.as_posix()} to RAY_CLUSTER_FILES in "
                "tests/conftest.py, whose files run on one worker with one cluster"
            )
        item.add_marker(getattr(pytest.mark, tier))
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIER_TIMEOUTS[tier]))
        if skip_gpu and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
    order_files(items)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama with a byte-level BPE tokenizer and chat template, built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Qwen2.5-VL with tokenizer and image processor (support.tiny_vlm), built once per session.
    Tests only read it: one that changes the folder works on its own copy."""
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def destroy_process_group_after_module():
    """For files whose in-process trainers share one gloo default group: leave none behind for other test files.
    Requested with `pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")`."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (starting one costs seconds)."""
    import ray
    from support.ray_head import connect_session_cluster

    connect_session_cluster()
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3-MoE (2 layers, 8 experts, top 2; support.moe), built once per session."""
    return str(build_tiny_model(tmp_path_factory.mktemp("routing") / "moe", arch="qwen3_moe"))


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory) -> Path:
    """A tiny model with `tiny_model_dir`'s tokenizer and architecture but other random weights (seed 1)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_teacher"), arch="llama", seed=1)
