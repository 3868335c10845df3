#!/usr/bin/env bash
# GPU smoke test for a CUDA machine without network access: install slime from a folder of wheels, run every
# GPU-marked test (files under tests/ with `pytest.mark.gpu`), print a per-test pass/fail table. The whole run,
# install included, is bounded by SMOKE_TIMEOUT seconds (default 480).
#
# Prepare the wheel folder on a machine with network and the same Python version, OS and CPU architecture, from
# a checkout of slime; keep it out of git:
#
#     pip download -d wheels ".[dev,megatron]" pytest setuptools wheel    # megatron-core==0.16.1 via the extra
#
# That fetches a torch wheel too (with its nvidia-* wheels, several GB). A CUDA torch already on the CUDA machine
# is kept (it satisfies torch>=2.4), so those may be deleted from the folder; for a machine without torch keep
# the build that matches its CUDA driver instead (e.g. `pip download -d wheels torch==2.11.0`). sglang is not
# needed: the tests that need it skip without it. Preparing on another platform: add
# `--platform manylinux_2_28_x86_64 --python-version 3.11 --only-binary=:all:` to `pip download`.
#
# Usage: scripts/gpu-smoke.sh WHEEL_DIR [--venv DIR] [-- PYTEST_ARGS...]
#        scripts/gpu-smoke.sh --dry-run [-- PYTEST_ARGS...]
#   WHEEL_DIR   the folder made by `pip download` above
#   --venv DIR  install into a new virtual environment DIR (with the system's packages, so its torch is used)
#               instead of the current python3 (or $PYTHON)
#   --dry-run   install nothing; run the same tests with the current python (on a machine without CUDA every
#               row reads "skip": a check of this script)
# Results: junit XML and the pytest log in $SMOKE_OUT (default: a new temporary folder). Exit status: pytest's
# (0 when nothing failed), 124 when the time ran out.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '/^# Usage:/,/^# Results:/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

wheel_dir="" venv="" dry_run=0 pytest_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) [ $# -ge 2 ] || usage; venv="$2"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        --) shift; pytest_args=("$@"); break ;;
        -h|--help) usage ;;
        -*) echo "unknown option $1" >&2; usage ;;
        *) [ -z "$wheel_dir" ] || usage; wheel_dir="$1"; shift ;;
    esac
done
if [ "$dry_run" -eq 0 ] && [ ! -d "$wheel_dir" ]; then
    echo "gpu-smoke: WHEEL_DIR '${wheel_dir}' is not a folder; make it with 'pip download' (see the header of $0)" >&2
    exit 2
fi

budget=${SMOKE_TIMEOUT:-480}
deadline=$((SECONDS + budget))
out=${SMOKE_OUT:-$(mktemp -d -t slime-gpu-smoke.XXXXXX)}
mkdir -p "$out"
python=${PYTHON:-python3}
# No network: never let transformers or huggingface_hub try to reach the Hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [ -n "$venv" ] && [ "$dry_run" -eq 0 ]; then
    "$python" -m venv --system-site-packages "$venv" || exit 1
    python="$venv/bin/python"
fi
if [ "$dry_run" -eq 0 ]; then
    echo "gpu-smoke: installing slime from $wheel_dir (no index)"
    timeout $((deadline - SECONDS)) "$python" -m pip install -q --no-index --find-links "$wheel_dir" \
        -e ".[dev,megatron]" pytest
    rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "gpu-smoke: install failed (exit $rc): a wheel is missing from $wheel_dir, or the time ran out" >&2
        exit "$rc"
    fi
fi

"$python" - <<'EOF' || exit 1
import torch

count = torch.cuda.device_count() if torch.cuda.is_available() else 0
names = ", ".join(torch.cuda.get_device_name(i) for i in range(count)) or "none"
print(f"gpu-smoke: torch {torch.__version__}, CUDA {torch.version.cuda}, {count} GPU(s): {names}")
if count == 0:
    print("gpu-smoke: no CUDA device: every GPU test will be skipped")
EOF

mapfile -t files < <(grep -l -E "pytest\.mark\.gpu" tests/*/test_*.py)
if [ "${#files[@]}" -eq 0 ]; then
    echo "gpu-smoke: no test file under tests/ uses pytest.mark.gpu" >&2
    exit 1
fi
echo "gpu-smoke: pytest -m gpu over ${files[*]}"
remaining=$((deadline - SECONDS))
if [ "$remaining" -le 10 ]; then
    echo "gpu-smoke: no time left for the tests after the install (SMOKE_TIMEOUT=$budget)" >&2
    exit 124
fi
# SIGINT at the deadline: pytest stops like on Ctrl-C and still writes the junit XML of the finished tests.
timeout -s INT -k 30 "$remaining" "$python" -m pytest -m gpu -v -p no:cacheprovider \
    --junitxml "$out/junit.xml" "${files[@]}" "${pytest_args[@]}" 2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 5 ] && echo "gpu-smoke: pytest collected no GPU test" >&2

"$python" - "$out/junit.xml" "$out/pytest.log" "$rc" <<'EOF'
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

junit, log, rc = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
OUTCOME = re.compile(r" (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
rows = []
if junit.exists():
    for case in ET.parse(junit).iter("testcase"):
        outcome, reason = "pass", ""
        for child in case:
            kind = {"failure": "fail", "error": "error", "skipped": "skip"}.get(child.tag)
            if kind is None:
                continue
            if kind == "skip" and child.get("type") == "pytest.xfail":
                kind = "xfail"
            if outcome in ("pass", "skip", "xfail"):
                outcome, reason = kind, child.get("message") or ""
        if case.get("name"):  # pytest leaves an empty testcase for the one a Ctrl-C interrupted
            rows.append((f"{case.get('classname')}::{case.get('name')}", outcome, float(case.get("time")), reason))
if rc == 124:
    # The test running at the deadline is not in the XML; the verbose log has its name without an outcome.
    started = [line for line in log.read_text(errors="replace").splitlines() if re.match(r"tests/\S+::", line)]
    running = started[-1].split(" ")[0] if started and not OUTCOME.search(started[-1]) else "(between tests)"
    rows.append((running, "timeout", 0.0, "SMOKE_TIMEOUT reached"))

width = max([len(name) for name, *_ in rows] + [4])
print(f"\n{'test':<{width}}  result  seconds  reason")
for name, outcome, seconds, reason in rows:
    reason = re.sub(r"\s+", " ", reason)[:90]
    print(f"{name:<{width}}  {outcome:<7} {seconds:7.1f}  {reason}")
counts = {kind: sum(row[1] == kind for row in rows) for kind in ("pass", "fail", "error", "skip", "xfail", "timeout")}
print("gpu-smoke: " + ", ".join(f"{n} {kind}" for kind, n in counts.items() if n) if rows else "gpu-smoke: no results")
EOF
echo "gpu-smoke: junit XML and log in $out"
exit "$rc"
