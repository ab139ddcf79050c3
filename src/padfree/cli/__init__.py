"""The ``padfree`` command line: ``padfree analyze [DATA]``, ``padfree pack [DATA] -o OUT``, ``padfree verify``,
``padfree demo`` and ``padfree bench``.

One module per command — :mod:`~padfree.cli.analyze`, :mod:`~padfree.cli.pack`, :mod:`~padfree.cli.verify`,
:mod:`~padfree.cli.demo`, :mod:`~padfree.cli.bench` — each with ``add_parser(subparsers)``, which declares its
arguments and sets ``run``, and ``run(args) -> int``, which does the work. :data:`COMMANDS` lists them, so a new
command slots in beside the others without touching :func:`main`. What several commands share lives in private
modules: reading DATA (``_inputs``), tokenizing (``_tokens``), the optional packages (``_optional``), what is shown
and written (``_output``), and the training runs of ``demo`` and ``bench`` (``_training``).

This package is the only place in padfree that prints. Library code raises :class:`~padfree.errors.PadfreeError`
for bad input; :func:`main` turns it into one line, ``padfree: error: ...``, on stderr and exit status 2 (the
status argparse uses for usage errors), and ``pack`` writes no output file: it builds its output beside
``--output`` and renames it into place only when complete. A file the system cannot read or write (a full disk, a
file-size limit, no permission) is one line too, naming the path and the errno (``... : No space left on device
(ENOSPC, errno 28)``), exit status 1.

Signals: SIGINT (Ctrl-C) and SIGTERM (what job schedulers send before they kill) both unwind the command — the
work directory and every temporary file are removed, ``--output`` is left as it was — and end it with
``padfree: interrupted`` / ``padfree: terminated`` and exit status ``128 + the signal's number`` (130, 143), as a
shell reports a process the signal killed. A process killed outright (SIGKILL) cannot clean up; the temporary
files it leaves are removed by the next run that writes into the same directory.

Optional packages: ``padfree --help`` and every ``padfree COMMAND --help`` need only numpy and numba. A command
checks the packages its work needs after its cheap argument checks and before it reads, tokenizes or trains
anything, and stops with one line naming the package and the extra that installs it. What only decorates a run is
skipped instead: without tqdm there are no progress bars; without matplotlib ``padfree demo`` does all its work and
says in one line that the picture was not drawn (``analyze --plot`` asks for the picture itself, so it stops up
front). An ``ImportError`` that still escapes becomes one line too (:func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from padfree import __version__
from padfree.cli import analyze, bench, demo, pack, verify
from padfree.cli._optional import install_hint
from padfree.cli._output import HelpFormatter, one_line
from padfree.cli.demo import DEMO_PNG as DEMO_PNG
from padfree.data._scratch import os_error_message
from padfree.errors import PadfreeError

__all__ = ["main"]

logger = logging.getLogger("padfree")

#: subcommand name -> function adding its parser; each parser sets ``run`` to the function doing the work
COMMANDS: dict[str, Callable[[Any], None]] = {
    "analyze": analyze.add_parser, "pack": pack.add_parser, "verify": verify.add_parser, "demo": demo.add_parser,
    "bench": bench.add_parser,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``padfree`` command line with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    0: success; 1: a file the system could not read or write (one line naming it and the errno); 2: a usage error
    (argparse prints the usage) or a :class:`PadfreeError` (one line on stderr); 130 / 143: SIGINT / SIGTERM (the
    command cleaned up before it stopped).

    >>> main(["analyze", "--capacity", "0"])  # stderr: padfree: error: --capacity must be an integer >= 1, got 0
    2
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors: argparse has already printed
        return exc.code if isinstance(exc.code, int) else 0
    _configure_logging(args.verbose)
    try:
        with _terminate_as_interrupt():
            return args.run(args)
    except PadfreeError as exc:
        print(f"padfree: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # the system, not the input: a full disk, a size limit, a permission
        print(f"padfree: error: {os_error_message(exc)}", file=sys.stderr)
        return 1
    except ImportError as exc:  # an optional package a path needs that no require() named up front
        missing = exc.name or "a package"
        fix = ("this padfree installation is incomplete: reinstall padfree" if missing.partition(".")[0] == "padfree"
               else f"install it with: {install_hint(missing)}")
        print(f"padfree: error: padfree {args.command} could not import {missing} ({one_line(exc)}); {fix}",
              file=sys.stderr)
        return 2
    except Terminated:
        print("padfree: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("padfree: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt, so that every cleanup that runs on an
    interrupt (ours, pyarrow's, datasets') runs on it too."""


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` while the command runs (the default would end the process on the spot,
    leaving its temporary files); a second SIGTERM during the cleanup is ignored. The old handler comes back after."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand in :data:`COMMANDS`."""
    parser = _Parser(
        prog="padfree",
        description="Exact padding-free (packed-sequence) training: analyze, pack, verify, demo and bench.",
    )
    parser.add_argument("--version", action="version", version=f"padfree {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details (debug level) on stderr")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS.values():
        add(subparsers)
    return parser


class _Parser(argparse.ArgumentParser):
    """The parser of ``padfree`` and of every subcommand (argparse makes the subcommands' parsers of the same class):
    :class:`~padfree.cli._output.HelpFormatter` by default."""

    def __init__(self, *args: Any, formatter_class: Any = HelpFormatter, **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def _configure_logging(verbose: bool) -> None:
    # the library logs, the CLI shows: one stderr handler on the "padfree" logger, added once per process
    if not any(getattr(h, "_padfree_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("padfree: %(levelname)s: %(message)s"))
        handler._padfree_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING)
