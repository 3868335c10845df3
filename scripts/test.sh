#!/usr/bin/env bash
# Install slime with its test dependencies on a CPU machine and run the test suite.
#   bash scripts/test.sh            every tier: tests/unit, tests/integration, tests/e2e
#   bash scripts/test.sh --fast     unit + integration only (no train.py runs)
# Other arguments go to pytest (a path or -k narrows the run).
set -uo pipefail
cd "$(dirname "$0")/.."
# Set-up, skipped when this checkout is already installed in this interpreter from the same package definition (the
# stamp records both); a fresh clone always installs.
stamp=".slime-test-install"
want="$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1) $(python3 -c 'import sys; print(sys.prefix)')"
installed_here=$(cd / && python3 -c 'import pathlib, slime; print(pathlib.Path(slime.__file__).resolve().parents[1])' 2>/dev/null)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ "$installed_here" != "$(pwd -P)" ]; then
    python3 -m pip install -q torch==2.13.0 -e ".[dev,megatron]" || exit 1
    echo "$want" > "$stamp"
fi
# Bytecode for slime's own files, read by every process a test starts: where PYTHONDONTWRITEBYTECODE is set (as on
# these machines) each fresh interpreter would otherwise compile them again (0.3 s here, once).
python3 -m compileall -q slime tests/support examples tools > /dev/null
paths=()
if [ "${1:-}" = "--fast" ]; then
    shift
    paths=(tests/unit tests/integration)
fi
# One torch/OpenMP thread per test process, as slime gives its own trainer and engine processes by default: the
# workers and the processes they start share two cores, and a 2-thread process spin-waits on a core another process
# needs (the fast tier used 3-8% less CPU this way, 445 -> 430 and 453 -> 416 CPU-s, in two back-to-back pairs).
export OMP_NUM_THREADS=1
# Three workers on 2 cores, a test file each at a time: the tests wait on process start-up, engines and servers much
# of the time (two workers kept the cores 77% busy on the fast tier: 3:19 there, 2:50 with three at 92%; whole suite
# 10:29 with three). Files go out in the order tests/conftest.py sorts them (the chaos run first, then the files with
# the most tests), which xdist's own sort would undo.
python3 -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder "${paths[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: treating as a failure" >&2
    exit 1
fi
exit "$rc"
