"""What the commands show and write: numbers, aligned tables, progress on stderr, notes, PNG pictures and outputs
written atomically.

Shared by every command of :mod:`padfree.cli`; the library itself never prints.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from padfree.data._scratch import ScratchDir, ScratchFile, os_error_message, remove_stale, with_path
from padfree.errors import InvalidArgumentError

if TYPE_CHECKING:  # numpy is imported where it is used: a usage error costs no import
    import numpy as np


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with the library's names filled in only when help is shown.

    A help string names them as ``{strategies}``, ``{default_strategy}``, ``{overlong}``, ``{columns}``,
    ``{default_columns}`` or ``{ignore_index}``; they live in the packing engine, whose import (numba) a usage error
    or a missing file should not wait for.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        if text and "{" in text:
            for key, value in _help_names().items():
                text = text.replace("{" + key + "}", value)
        return text


def _help_names() -> dict[str, str]:
    from padfree.data.hf import COLUMNS, DEFAULT_COLUMNS
    from padfree.layout import IGNORE_INDEX
    from padfree.packing import DEFAULT_STRATEGY, STRATEGIES
    from padfree.packing.inputs import OVERLONG_POLICIES

    return {"strategies": ", ".join(STRATEGIES), "default_strategy": DEFAULT_STRATEGY,
            "overlong": " | ".join(OVERLONG_POLICIES), "columns": ",".join(COLUMNS),
            "default_columns": ",".join(DEFAULT_COLUMNS), "ignore_index": str(IGNORE_INDEX)}


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (a multi-line message would read as several errors)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def num(x: float) -> str:
    """A number with thousands separators; non-integers with one decimal.

    >>> num(1234567), num(2.25)
    ('1,234,567', '2.2')
    """
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def size(num_bytes: int) -> str:
    """A file size in B, kB, MB or GB (powers of 1000).

    >>> size(512), size(2_500_000)
    ('512 B', '2.5 MB')
    """
    import numpy as np
    if num_bytes < 1000:
        return f"{num_bytes} B"
    exponent = min(int(np.log10(num_bytes)) // 3, 3)
    return f"{num_bytes / 1000 ** exponent:,.1f} {('kB', 'MB', 'GB')[exponent - 1]}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str, indent: str = "  ") -> list[str]:
    """Aligned columns (``align``: one ``l`` or ``r`` per header); cells past the headers are free notes.

    >>> print("\\n".join(table(["name", "n"], [["a", "1"], ["bb", "22", "<- note"]], "lr")))
      name   n
      a      1
      bb    22  <- note
    """
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        cols = zip(cells[: len(headers)], widths, align, strict=True)
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in cols]
        return (indent + "  ".join([*parts, *cells[len(headers):]])).rstrip()

    return [line(headers)] + [line(r) for r in rows]


class Progress:
    """Progress lines on stderr (``padfree: <what is happening>``); ``datasets`` draws its bars beside them."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"padfree: {message}", file=sys.stderr, flush=True)


def note(message: str) -> None:
    """One line on stderr about something a run left out (shown even with ``-q``: it is not progress)."""
    print(f"padfree: note: {message}", file=sys.stderr, flush=True)


def bar(total: int, desc: str, unit: str, position: int | None = None) -> Any:
    """A tqdm progress bar on stderr (drawn only on a terminal); without tqdm, one that draws nothing. ``position``:
    its line among bars shown together (0 the top one)."""
    try:
        from tqdm.auto import tqdm
    except (ImportError, OSError):  # a broken install counts as missing: bars only decorate a run
        return _NoBar()

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=None, leave=False, file=sys.stderr,
                position=position)


class _NoBar:
    """What :func:`bar` returns without tqdm: the calls the commands make, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def log_bins(lengths: np.ndarray) -> np.ndarray:
    """Histogram edges for ``lengths`` on a log axis: about 25 per decade, 15 to 60 in all, on whole numbers."""
    import numpy as np
    lo, hi = max(1, int(lengths.min())), max(2, int(lengths.max()))
    # narrower log bins over integer lengths hold uneven numbers of integers, which shows up as a comb pattern
    count = int(np.clip(25 * np.log10((hi + 1) / lo), 15, 60))
    return np.unique(np.geomspace(lo, hi + 1, num=count + 1).astype(np.int64))


def new_figure(width: float, height: float, dpi: int) -> Any:
    """A matplotlib ``Figure`` on its own Agg canvas: no pyplot state, no display, no global backend switch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Any, path: Path, what: str) -> None:
    """Write ``fig`` to ``path`` as a PNG; ``what`` (the argument that chose ``path``) starts the error otherwise.

    The picture is written next to the target, then renamed: a failed or interrupted write never leaves a broken
    PNG behind (a killed one leaves a temporary file that the next write into that directory removes). The file
    gets the mode any new file gets (``0666`` less the umask).
    """
    remove_stale(path.parent)
    try:
        tmp = ScratchFile(path.parent, path.name)
    except OSError as exc:
        raise InvalidArgumentError(f"{what} could not be written ({os_error_message(with_path(exc, path))})") from exc
    try:
        fig.savefig(tmp.path, format="png")
        os.replace(tmp.path, path)
    except OSError as exc:
        tmp.discard()
        raise InvalidArgumentError(f"{what} could not be written ({os_error_message(with_path(exc, path))})") from exc
    except BaseException:
        tmp.discard()
        raise
    finally:
        tmp.close()


@contextlib.contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    """``datasets``' progress bars (tqdm) on or off for the block, then as they were."""
    from datasets.utils import logging as ds_logging

    was = ds_logging.is_progress_bar_enabled()
    (ds_logging.enable_progress_bar if enabled else ds_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (ds_logging.enable_progress_bar if was else ds_logging.disable_progress_bar)()


def disk_size(path: Path) -> int:
    """Bytes on disk of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class AtomicOutput:
    """Build an output in a hidden work directory beside it; rename it into place only once it is complete.

    ``staged`` is where the output is written, ``cache`` where intermediate files go (tokenized rows, the packed
    Arrow file). :meth:`commit` renames ``staged`` to the output path — one ``rename`` on the same filesystem, so
    the path holds either nothing, the old output, or the complete new one. Leaving the block deletes the work
    directory, whatever happened (SIGINT and SIGTERM included, see :func:`padfree.cli.main`). A killed process
    (``kill -9``) leaves it behind as ``.<name>.padfree-<pid>-<random>``, never at the output path itself; the next
    run that writes into the same directory removes it (:func:`padfree.data._scratch.remove_stale`: its owner is
    gone and its lock is free) and says so.
    """

    def __init__(self, path: Path, *, replace: bool) -> None:
        self.path = path
        self.replace = replace

    def __enter__(self) -> AtomicOutput:
        stale = remove_stale(self.path.parent)
        if stale:
            note(f"removed {len(stale)} temporary {'entry' if len(stale) == 1 else 'entries'} left in "
                 f"{str(self.path.parent)!r} by runs that were killed: {', '.join(p.name for p in stale)}")
        try:
            self._scratch = ScratchDir(self.path.parent, self.path.name)
        except OSError as exc:
            raise with_path(exc, self.path.parent) from exc
        self.work = self._scratch.path
        self.cache = self.work / "cache"
        self.cache.mkdir()
        self.staged = self.work / "output"
        return self

    def commit(self) -> None:
        if self.path.exists() or self.path.is_symlink():
            if not self.replace:  # it appeared while we were packing
                raise InvalidArgumentError(f"--output {str(self.path)!r} already exists; pass --overwrite to "
                                           "replace it")
            # move the old output into the work directory (deleted on exit) with one rename, then the new one in
            old = self.work / "replaced"
            os.replace(self.path, old)
            try:
                os.replace(self.staged, self.path)
            except OSError:
                os.replace(old, self.path)
                raise
        else:
            os.replace(self.staged, self.path)

    def __exit__(self, *exc: object) -> None:
        self._scratch.remove()
