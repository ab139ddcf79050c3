"""Temporary files and directories that a killed process leaves where the next run finds and removes them.

A run that writes an output atomically builds it under a temporary name beside the output, then renames it into
place. When the process is killed (``kill -9``, a scheduler's SIGTERM, an out-of-memory kill) nothing runs its
cleanup, and the temporary data (hundreds of megabytes) stays behind under a hidden name. So every temporary entry
made here is named ``.<name>.padfree-<pid>-<random>`` (plus ``.tmp`` for a file) and holds an exclusive ``flock``
for its owner's lifetime: on the file itself, or on the directory's ``.lock`` file. The kernel drops that lock when
the owner dies however it dies, and child processes that inherited it (``datasets.map(num_proc=...)``) keep it
until they end too.

:func:`remove_stale` — called by every writer before it makes its own entry — removes an entry of that pattern in
the directory only when its lock is free and its owner is gone: the process named in it is not alive, or the entry
is older than :data:`GRACE_SECONDS` (the pid was reused by an unrelated process; a live owner always holds the
lock, except for the instant between creating the entry and locking it). It never follows a symbolic link: a link
of that name is skipped, a lock file is opened with ``O_NOFOLLOW``, and ``shutil.rmtree`` does not follow the links
inside a directory. Without ``fcntl`` (Windows) nothing is locked and nothing is removed.

New entries are created with the user's umask, as any other file (``tempfile.mkstemp`` would make them 0600).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import stat
import time
import uuid
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["ScratchDir", "ScratchFile", "os_error_message", "remove_stale", "umask", "with_path"]

logger = logging.getLogger("padfree")

#: An entry whose lock is free but whose pid is alive is removed only once it is this old (the pid was reused).
GRACE_SECONDS = 60.0
#: The lock file inside a scratch directory.
LOCK_NAME = ".lock"
_PATTERN = re.compile(r"^\.(?P<name>.+)\.padfree-(?P<pid>\d+)-(?P<token>[0-9a-f]{12})(?P<tmp>\.tmp)?$")
_FLAGS = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def umask() -> int:
    """The process's umask (read without changing it where ``/proc`` says it; else set and restored at once)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def alive(pid: int) -> bool:
    """Whether a process with id ``pid`` exists (on this machine)."""
    if pid == os.getpid():
        return True
    if pid <= 0 or os.name != "posix":  # pragma: no cover - os.kill(pid, 0) would kill the process on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, and belongs to someone else
        return True
    return True


def _entry_name(name: str, suffix: str) -> str:
    return f".{name}.padfree-{os.getpid()}-{uuid.uuid4().hex[:12]}{suffix}"


def _lock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)


class ScratchFile:
    """A temporary file ``.<name>.padfree-<pid>-<random>.tmp`` in ``directory``, locked while the object lives.

    ``path`` is the file (created empty, mode ``0666`` less the umask). :meth:`close` releases the lock; call it
    after renaming the file into place, or :meth:`discard` to delete it.
    """

    def __init__(self, directory: str | os.PathLike[str], name: str) -> None:
        while True:
            path = os.path.join(os.fspath(directory), _entry_name(name, ".tmp"))
            try:
                self.fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FLAGS, 0o666)
                break
            except FileExistsError:  # pragma: no cover - 48 random bits
                continue
        self.path = path
        _lock(self.fd)

    def discard(self) -> None:
        """Delete the file (if it is still there) and release the lock."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ScratchDir:
    """A temporary directory ``.<name>.padfree-<pid>-<random>`` in ``directory``, locked while the object lives.

    ``path`` is the directory (mode ``0777`` less the umask), which holds only :data:`LOCK_NAME` at first.
    :meth:`remove` deletes it with everything in it and releases the lock.
    """

    def __init__(self, directory: str | os.PathLike[str], name: str) -> None:
        while True:
            path = Path(directory) / _entry_name(name, "")
            try:
                path.mkdir()
                break
            except FileExistsError:  # pragma: no cover
                continue
        self.path = path
        try:
            self.fd: int | None = os.open(path / LOCK_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FLAGS, 0o666)
            _lock(self.fd)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def remove_stale(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the scratch entries in ``directory`` whose owners are gone (see the module docstring); return them.

    Never raises for an entry it cannot inspect or remove (it is left alone); an unreadable directory is skipped.
    """
    if fcntl is None:  # pragma: no cover - nothing is locked, so nothing can be told stale
        return []
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = _PATTERN.match(entry.name)
        if match is None:
            continue
        with contextlib.suppress(OSError):
            if _remove_if_stale(Path(entry.path), int(match["pid"]), is_file=match["tmp"] is not None):
                removed.append(Path(entry.path))
    if removed:
        logger.info("removed %d temporary entries left by processes that ended: %s", len(removed),
                    ", ".join(str(p) for p in removed))
    return removed


def _remove_if_stale(path: Path, pid: int, *, is_file: bool) -> bool:
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or (stat.S_ISREG(info.st_mode) != is_file) or (
            not is_file and not stat.S_ISDIR(info.st_mode)):
        return False  # not what this module makes: a link, or a file where a directory belongs
    if pid == os.getpid():
        return False
    try:
        fd = os.open(path if is_file else path / LOCK_NAME, os.O_RDONLY | _FLAGS)
    except FileNotFoundError:
        if is_file:
            return False  # removed meanwhile
        fd = None  # a directory whose owner died before it made its lock file, or is making it now
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the lock file is a link: not ours
            return False
        raise
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # its owner (or a child of it) is alive
        if alive(pid) and time.time() - info.st_mtime < GRACE_SECONDS:
            return False  # just created, not locked yet
        if is_file:
            os.unlink(path)
        else:
            shutil.rmtree(path)
        return True
    finally:
        if fd is not None:
            os.close(fd)


def with_path(exc: OSError, path: str | os.PathLike[str]) -> OSError:
    """``exc`` with its path filled in (pyarrow's and datasets' write errors carry an errno but no file name)."""
    if exc.filename is not None:
        return exc
    code = exc.errno if exc.errno is not None else _errno_in(str(exc))
    if code is None:
        return OSError(None, " ".join(str(exc).split()) or type(exc).__name__, os.fspath(path))
    return OSError(code, os.strerror(code), os.fspath(path))


def os_error_message(exc: OSError) -> str:
    """One line for ``exc``: the path, what the system said, and the errno by name and number.

    >>> os_error_message(OSError(28, "No space left on device", "/data/out.arrow"))
    '/data/out.arrow: No space left on device (ENOSPC, errno 28)'
    """
    code = exc.errno if exc.errno is not None else _errno_in(str(exc))
    where = exc.filename if exc.filename is not None else "(a path the system did not name)"
    if exc.filename2 is not None:
        where = f"{where} -> {exc.filename2}"
    if code is None:
        return f"{where}: {' '.join((exc.strerror or str(exc)).split()) or type(exc).__name__}"
    return f"{where}: {os.strerror(code)} ({errno.errorcode.get(code, '?')}, errno {code})"


def _errno_in(text: str) -> int | None:
    found = re.search(r"\[errno (\d+)\]", text, re.IGNORECASE)
    return int(found.group(1)) if found else None
