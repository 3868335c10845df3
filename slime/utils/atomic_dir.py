"""Write a folder all at once, and never replace or delete one that slime did not write.

Every writer of a model folder or checkpoint uses the same recipe:

    staging = create_staging(final)      # .<name>.slime-tmp-<pid> beside `final`, holding slime's marker
    ...                                  # write everything into `staging`
    publish(staging, final)              # rename into place; an existing `final` only if it has the marker

Readers never see half a folder, and a folder already at `final` is replaced only when slime wrote it
(`.slime-folder` inside). Leftovers of killed writes keep their recognisable names and are removed by the
next write to the same `final`, only when they carry the marker.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = ".slime-folder"
DCP_INDEX = ".metadata"  # torch.distributed.checkpoint's index file in a checkpoint folder
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.slime-(?:tmp|old)-(?P<pid>\d+)$")


def is_slime_folder(path: str | Path) -> bool:
    """Whether `path` is a folder holding slime's marker file (so slime may replace it)."""
    path = Path(path)
    return path.is_dir() and not path.is_symlink() and (path / MARKER).is_file()


def metadata_files(folder: str | Path) -> dict[str, bytes]:
    """The bytes of every torch.distributed.checkpoint index (`.metadata`) under `folder`, by relative path."""
    folder = Path(folder)
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in sorted(folder.rglob(DCP_INDEX))
        if path.is_file()
    }


def metadata_digests(folder: str | Path) -> dict[str, str]:
    """SHA-256 of every `metadata_files(folder)` entry, by relative path."""
    return {name: hashlib.sha256(data).hexdigest() for name, data in metadata_files(folder).items()}


def write_marker(folder: str | Path, kind: str) -> None:
    """Mark `folder` as written by slime; `kind` says what it holds (e.g. "hf-export", "checkpoint").

    A "checkpoint" marker also records `metadata_digests(folder)`, which loading checks
    (`slime.utils.checkpoint_safety`), so write it once the checkpoint is complete.
    """
    marker = {"written_by": "slime", "kind": kind}
    if kind == "checkpoint":
        marker["metadata_sha256"] = metadata_digests(folder)
    (Path(folder) / MARKER).write_text(json.dumps(marker) + "\n")


def replace_problem(path: str | Path, flag: str | None = None) -> str | None:
    """Why slime may not write a folder at `path`, or None when it may (absent, empty, or written by slime).

    Args:
        path: The folder about to be written.
        flag: The flag or option that named it, for the message (e.g. "--save-hf").
    """
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    if is_slime_folder(path) or (path.is_dir() and not path.is_symlink() and not any(path.iterdir())):
        return None
    if path.is_dir() and not path.is_symlink():
        what = f"a folder slime did not write (no {MARKER} marker inside)"
    else:
        what = "a file or link, not a folder slime wrote"
    return (
        f"{flag + ' ' if flag else ''}{path} already exists and is {what}; slime will not replace or delete it. "
        f"Choose another {flag or 'output folder'}, or move {path} away yourself."
    )


def check_replaceable(path: str | Path, flag: str | None = None) -> None:
    """Raise FileExistsError (naming `path` and the fix) unless slime may write a folder at `path`."""
    problem = replace_problem(path, flag)
    if problem is not None:
        raise FileExistsError(problem)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(final: str | Path) -> None:
    """Remove staging/old folders of earlier, killed writes to `final` (marked ones of dead processes only)."""
    final = Path(final)
    if not final.parent.is_dir():
        return
    for entry in final.parent.iterdir():
        match = _LEFTOVER.match(entry.name)
        if match is None or match.group("name") != final.name:
            continue
        pid = int(match.group("pid"))
        if pid != os.getpid() and _pid_alive(pid):
            continue  # another live process may be writing it
        if is_slime_folder(entry):  # the marker inside, not the name alone: a user's file of that name stays
            shutil.rmtree(entry)
        else:
            logger.warning("leaving %s: named like an interrupted slime write but unmarked; remove it yourself", entry)


def staging_path(final: str | Path, pid: int | None = None) -> Path:
    """`.<name>.slime-tmp-<pid>` beside `final`."""
    final = Path(final)
    return final.parent / f".{final.name}.slime-tmp-{os.getpid() if pid is None else pid}"


def create_staging(final: str | Path, kind: str, flag: str | None = None, mark: bool = True) -> Path:
    """Make the empty staging folder for `final` (after checking `final` may be replaced).

    Args:
        final: The folder that `publish` will create.
        kind: Recorded in the marker.
        flag: Names `final` in error messages.
        mark: Write the marker now (False for writers that need an empty folder; `publish` marks it).

    Returns:
        The staging folder.
    """
    final = Path(final).absolute()
    check_replaceable(final, flag)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(final)
    staging = staging_path(final)
    staging.mkdir()
    if mark:
        write_marker(staging, kind)
    return staging


def publish(staging: str | Path, final: str | Path, kind: str, flag: str | None = None) -> Path:
    """Rename a finished `staging` folder to `final`, replacing an earlier folder slime wrote there.

    Returns:
        `final`.
    """
    staging, final = Path(staging), Path(final).absolute()
    check_replaceable(final, flag)
    write_marker(staging, kind)  # again: the one written at staging knew nothing of what was written since
    if not final.exists():
        os.replace(staging, final)
        return final
    old = final.parent / f".{final.name}.slime-old-{os.getpid()}"
    os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old)
    return final


def on_rank0(fn, *args):
    """`fn(*args)` run on rank 0 only (the filesystem step of a collective save); every rank gets its result.

    Its exception is raised on every rank, so the others do not hang in the next collective.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return fn(*args)
    outcome = [(None, None)]
    if dist.get_rank() == 0:
        try:
            outcome = [(fn(*args), None)]
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            outcome = [(None, e)]
    dist.broadcast_object_list(outcome, src=0)
    result, error = outcome[0]
    if error is not None:
        raise error
    return result


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace the file `path` with `text` in one rename, via a temporary file of a fresh random name beside it
    (created exclusively: it never overwrites anything; one left by a killed process is a few bytes, left alone)."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.slime-write-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # ours: created above
        raise
