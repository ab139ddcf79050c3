"""Where padfree keeps what it derives once and reuses: the converted offline tokenizer, certification verdicts.

One directory for both: ``$PADFREE_CACHE_DIR``, else ``$XDG_CACHE_HOME/padfree``, else ``~/.cache/padfree``.
``$PADFREE_CACHE`` (the tokenizer cache's former variable) is still read when ``$PADFREE_CACHE_DIR`` is not set, with
a :class:`DeprecationWarning`.

>>> import os
>>> from unittest.mock import patch
>>> with patch.dict(os.environ, {"PADFREE_CACHE_DIR": "~/padfree-cache"}):
...     cache_dir() == Path.home() / "padfree-cache"
True
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

__all__ = ["cache_dir"]

#: the environment variable that names the cache directory
VARIABLE = "PADFREE_CACHE_DIR"
_DEPRECATED = "PADFREE_CACHE"


def cache_dir() -> Path:
    """The cache directory (``~`` expanded). Nothing is created here."""
    if os.environ.get(VARIABLE):
        return Path(os.environ[VARIABLE]).expanduser()
    if os.environ.get(_DEPRECATED):
        # a DeprecationWarning, not a log line: it reaches whoever sets the variable in their own code or tests,
        # and leaves the CLI's stderr (one error line, progress bars) as it is
        warnings.warn(f"${_DEPRECATED} is deprecated: set ${VARIABLE} (one cache directory for the tokenizer and "
                      "the certification verdicts)", DeprecationWarning, stacklevel=3)
        return Path(os.environ[_DEPRECATED]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "padfree"
    return Path.home() / ".cache" / "padfree"
