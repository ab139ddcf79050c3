"""``padfree/cli/_training.py``: the options the demo and bench commands share, read from the parsed arguments."""

import pytest

from padfree.cli import build_parser
from padfree.cli._training import training_options


def test_demo_sizes():
    """The default run is the small one (the whole corpus and the larger model behind --full); --quick is smaller
    still; the built-in model trains on one thread unless --threads says otherwise. (Formerly in test_cli_demo.py:
    the options of ``padfree demo`` are read by cli/_training.py, the private module this file is named after.)"""
    def options(*argv):
        return training_options(build_parser().parse_args(["demo", *argv]), "demo")

    default, quick, full = options(), options("--quick"), options("--full")
    assert (default.size, quick.size, full.size) == ("default", "quick", "full")
    assert (default.capacity, default.rows, default.tokens, default.repetitions) == (512, 4, 8192, 2)
    assert (full.capacity, full.rows, full.tokens, full.repetitions) == (1024, 8, 16384, 3)
    assert quick.tokens < default.tokens < full.tokens
    assert default.threads == 1 and options("--threads", "2").threads == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--quick", "--full"])
