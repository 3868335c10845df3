"""Objects whose unpickling runs code: what a crafted file or request body would hold."""

from __future__ import annotations

import os


class MakesAFolderWhenUnpickled:
    """Unpickling this object runs code: it creates the folder `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)
