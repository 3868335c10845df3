"""How scripts/test.sh hands tests to its xdist workers: whole files (`--dist loadfile`), except that the files using
the session Ray cluster (tests/conftest.py `RAY_CLUSTER_FILES`) go to one worker, together, as one unit of work."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling


class FilesWithOneRayWorker(LoadFileScheduling):
    """`--dist loadfile`, with the files `ray_files` (paths as node ids begin) as one unit: each worker that runs a
    test of the `ray_cluster` fixture starts a Ray cluster of its own, so the fewer workers run them the better."""

    RAY_UNIT = "files using the session Ray cluster"

    def __init__(self, config: pytest.Config, log: Producer | None = None, ray_files: Iterable[str] = ()):
        super().__init__(config, log)
        self.ray_files = set(ray_files)

    def _split_scope(self, nodeid: str) -> str:
        path = super()._split_scope(nodeid)
        return self.RAY_UNIT if path in self.ray_files else path
