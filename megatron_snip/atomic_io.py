"""Atomic file writes (a reader sees the old file or the new one, never half of either), and the
one whole-file sha256 every checksum here uses (checkpoint shards, corpus cache keys, .bin sidecars)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of the whole file at ``path``, read in ``chunk``-byte blocks (~1 GB/s per core)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder + fsync + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind, not a stray temp file
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def fsync_dir(path: str | Path) -> None:
    """Flush a directory entry (a rename inside it) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def ensure_writable_dir(path: str | Path, field: str, *, what: str | None = None, fix: str | None = None) -> Path:
    """Create directory ``path`` (config field ``field``) if needed and check it is writable;
    ValueError naming the field, the path and the fix otherwise. ``what`` replaces the opening
    ``config FIELD='PATH'`` for a directory the config implies (``<run_dir>/tensorboard``), ``fix``
    the advice."""
    path = Path(path)
    what = what or f"config {field}={str(path)!r}"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} is a file, not a directory; {fix or 'choose a directory path'}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{what} is not a writable directory ({type(e).__name__}: "
                         f"{e.strerror or e}); {fix or 'choose a directory you can write to'}") from None
    return path


def check_writable_file(path: str | Path, what: str) -> Path:
    """Refuse, before any work is done, an output file ``path`` (named ``what`` in the message, e.g.
    ``--out``) that could not be written: a directory there, a parent that is a file, no write
    access. Missing parent folders are fine (``atomic_write_bytes`` creates them)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {str(path)!r} is a directory, not a file; give a file path (e.g. {path / 'eval.json'})")
    parent = next(p for p in path.parents if p.exists()) if not path.parent.exists() else path.parent
    if not parent.is_dir():
        raise ValueError(f"{what} {str(path)!r}: {parent} is a file, not a directory; choose another {what}")
    try:  # a real write, not os.access: root passes access() where the filesystem still refuses (/proc, read-only)
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{what} {str(path)!r}: {parent} is not writable ({type(e).__name__}: {e.strerror or e}); "
                         f"choose another {what}") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{what} {str(path)!r}: {path} is not writable; choose another {what}")
    return path
