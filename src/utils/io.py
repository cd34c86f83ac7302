"""Atomic writes: a crash or a kill mid-write never leaves a half-written file or directory in place."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator

log = logging.getLogger(__name__)

_TEMP_FILE = re.compile(r"^\..+\.tmp(?P<pid>\d+)$")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", encoding: str | None = None) -> Iterator[IO]:
    """Open ``.<name>.tmp<pid>`` beside ``path`` (its parent created) for writing; on a clean exit flush, fsync and
    rename it onto ``path``. On an error the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (``atomic_file``)."""
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_json_atomic(path: str | os.PathLike, obj: Any, **dump_kwargs: Any) -> None:
    """``json.dump(obj, **dump_kwargs)`` to ``path`` atomically (``atomic_file``)."""
    with atomic_file(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, **dump_kwargs)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield a new temporary directory next to ``path``; on a clean exit rename it to ``path``.

    ``replace=False``: the rename fails with ``OSError`` when another writer created a non-empty ``path`` first.
    ``replace=True``: an existing ``path`` is replaced (restored if the rename fails). On an error ``path`` is
    untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp"))
    try:
        yield tmp
        if replace and path.exists():
            old = path.with_name(f".{path.name}.old{os.getpid()}")
            os.replace(path, old)
            try:
                os.rename(tmp, path)
            except BaseException:
                os.replace(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (another user's live process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def tagged_process(tags: dict[str, str]) -> int | None:
    """The pid a tracker run's tags (``host``, ``pid``) name when that process was started on this host, else None
    (another host's, or untagged: this machine cannot tell whether it runs)."""
    import socket

    pid = tags.get("pid", "")
    return int(pid) if tags.get("host") == socket.gethostname() and pid.isdigit() else None


def remove_stale_temp_files(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files of atomic writes whose writer was killed (e.g. during a checkpoint save): a
    ``.<name>.tmp<pid>`` whose process no longer runs on this machine, so a live run's write is left alone. A
    missing directory is fine. Returns the deleted paths.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for path in directory.iterdir():
        match = _TEMP_FILE.match(path.name)
        if match and path.is_file() and not pid_alive(int(match["pid"])):
            size = path.stat().st_size
            path.unlink(missing_ok=True)
            removed.append(path)
            log.warning("Removed %s (%.1f MB), left by a write that did not finish", path, size / 1e6)
    return removed


def json_digest(obj: Any, n: int = 12) -> str:
    """The first ``n`` hex digits of the SHA-256 of ``obj`` as JSON (keys sorted, non-JSON values by ``str``)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]
