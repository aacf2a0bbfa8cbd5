"""Files that specdec derives and keeps under ``$SPECDEC_HOME``: one mechanism for all of them.

Every derived file (an assembled GGUF, a GGUF file's config and tokenizer, int8 weights,
calibration statistics) follows the same four rules:

* **Keyed by content.** A cache built from other files is named by :func:`fingerprint` of those
  files (name, size and modification time of each), so changing a model's weights changes the
  key and the old cache is never read for the new weights.
* **Written atomically.** Builders write into a per-process temporary sibling (:func:`temp_path`)
  and ``os.replace`` it into place: a reader sees the whole file or no file, never half of one.
* **One builder at a time.** :func:`build_lock` holds a file lock per cache entry; a second
  process that wants the same entry waits and then reuses what the first one built. Under the
  lock, temporaries left by a killed builder are removed (:func:`sweep`), so nothing is orphaned.
* **Healing.** :func:`cached` reads an entry and, when reading fails (truncated, empty, a
  directory in its place, garbage), says so on stderr, rebuilds it once and reads again.

All notices go to stderr (:func:`notice`): stdout carries only a command's result.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from filelock import FileLock

T = TypeVar("T")


class CacheError(RuntimeError):
    """A cache entry that could not be built, or is still unreadable after one rebuild."""


def home() -> Path:
    """Where every derived file lives: ``$SPECDEC_HOME``, default ``~/.cache/specdec``."""
    return Path(os.environ.get("SPECDEC_HOME", Path.home() / ".cache" / "specdec"))


def notice(message: str) -> None:
    """A one-line notice for the user, on stderr (stdout is reserved for results)."""
    print(f"specdec: {message}", file=sys.stderr, flush=True)


def fingerprint(files: Iterable[Path], *extra: str) -> str:
    """A 16-hex-digit key from each file's name, size and modification time (plus ``extra``).

    One ``stat`` per file: cheap enough for every load. Rewriting a file (new weights, a
    re-conversion) changes its size or mtime and so the key; a cache keyed by the path alone
    would silently keep answering with the old weights.
    """
    digest = hashlib.sha256()
    for f in sorted(Path(p) for p in files):
        st = f.stat()
        digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    for e in extra:
        digest.update(e.encode())
    return digest.hexdigest()[:16]


def temp_path(target: Path) -> Path:
    """A unique temporary sibling of ``target`` (same directory, so ``os.replace`` is atomic)."""
    return target.with_name(f"{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove(path: Path) -> None:
    """Remove a file, link or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def sweep(target: Path) -> None:
    """Remove temporaries of ``target`` left by builders that died (call under its lock)."""
    for stale in target.parent.glob(f"{target.name}.tmp-*"):
        remove(stale)


@contextmanager
def build_lock(target: Path):
    """Hold the lock of the cache entry ``target`` (waiting for another builder if needed), after
    sweeping temporaries that a killed builder left behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.with_name(target.name + ".lock")
    try:
        with FileLock(str(lock)):
            sweep(target)
            yield
    finally:
        if not target.exists():  # a build that failed leaves nothing behind, not even its lock file
            try:
                lock.unlink()
            except OSError:
                pass


def write_atomic(target: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a fresh temporary path, then move it onto ``target`` in one step.
    ``tmp`` may be made a file or a directory; an existing ``target`` is replaced."""
    tmp = temp_path(target)
    try:
        write(tmp)
        if target.is_dir() and not target.is_symlink():
            remove(target)  # os.replace cannot replace a directory
        os.replace(tmp, target)
    finally:
        remove(tmp)
    return target


def ensure(target: Path, valid: Callable[[], bool], build: Callable[[Path], None], what: str) -> Path:
    """Make sure the cache entry ``target`` is there and ``valid()``; build it (under its lock,
    atomically) when it is not. Another process's build is waited for and reused; an entry that
    exists but is not valid is rebuilt with a notice."""
    if valid():
        return target
    with build_lock(target):
        if valid():  # built by another process while we waited
            return target
        if target.exists():
            notice(f"{what} at {target} is incomplete, damaged or changed; building it again")
        write_atomic(target, build)
    return target


def cached(target: Path, build: Callable[[Path], None], read: Callable[[Path], T], what: str) -> T:
    """Read the cache entry ``target``; build it first when it is missing; when it cannot be read,
    rebuild it once (saying so) and read again.

    ``build(tmp)`` writes the entry at the temporary path it is given (it is then moved into
    place atomically); ``read(path)`` returns the value and raises on anything damaged.
    """
    for attempt in range(2):
        ensure(target, target.is_file, build, what)  # a directory in its place is replaced
        try:
            return read(target)
        except Exception as exc:  # any failure to read a derived file means it is damaged
            if attempt == 1:
                raise CacheError(f"{what} at {target} is unreadable even after rebuilding it: {brief(exc)}") from exc
            notice(f"{what} at {target} is damaged ({brief(exc)}); rebuilding it")
            with build_lock(target):
                remove(target)
    raise AssertionError("unreachable")


def brief(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line: the message's lines joined (a first line alone can stop
    mid-sentence), cut at ``limit`` characters."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 1].rstrip() + "…"
    return f"{type(exc).__name__}: {text}".rstrip(": ")
