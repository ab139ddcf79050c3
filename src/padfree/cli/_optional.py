"""The optional packages the commands need, and the one line that says which extra installs a missing one.

``padfree --help`` and every ``padfree COMMAND --help`` need only numpy and numba. A command checks the packages its
work needs (:func:`require`) after its cheap argument checks and before it reads, tokenizes or trains anything.
"""

from __future__ import annotations

import importlib
import logging

from padfree.cli._output import one_line
from padfree.errors import BackendUnavailableError

logger = logging.getLogger("padfree")

#: top-level module -> (the name pip knows it by, the extra of pyproject.toml that installs it). Every package the
#: commands import beyond numpy and numba is in the ``cli`` extra, except torch and trl.
OPTIONAL = {
    "torch": ("torch", "torch"),
    "transformers": ("transformers", "cli"),
    "datasets": ("datasets", "cli"),
    "pyarrow": ("pyarrow", "cli"),
    "tqdm": ("tqdm", "cli"),
    "matplotlib": ("matplotlib", "cli"),
    "mistral_common": ("mistral-common", "cli"),
    "sentencepiece": ("sentencepiece", "cli"),
    "google": ("protobuf", "cli"),
    "trl": ("trl", "trl"),
}

#: torch is in no extra but its own, and the wheel pip picks by default is the CUDA one on Linux
_CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def install_hint(module: str) -> str:
    """What to run to install ``module`` (a dotted name is fine): the padfree extra that brings it.

    >>> install_hint("pyarrow.parquet")
    "pip install 'padfree[cli]' (it brings pyarrow)"
    """
    top = module.partition(".")[0]
    package, extra = OPTIONAL.get(top, (top, "all"))
    if top == "torch":
        return f"pip install 'padfree[torch]' (without an NVIDIA GPU, install the CPU wheel instead: {_CPU_TORCH})"
    return f"pip install 'padfree[{extra}]' (it brings {package})"


def require(needed_for: str, *modules: str) -> None:
    """Import ``modules`` now, or stop with one line naming the first that cannot be imported and its extra.

    Called before a command does any work, so that a missing package costs milliseconds, not a tokenized corpus.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except (ImportError, OSError) as exc:  # OSError: an installed package whose shared libraries do not load
            package = OPTIONAL.get(module.partition(".")[0], (module,))[0]
            # the hint names what is missing, which may be a package the wanted one needs (transformers: tqdm)
            name = getattr(exc, "name", None)
            missing = name if name and name.partition(".")[0] in OPTIONAL else module
            raise BackendUnavailableError(f"{needed_for} needs {package}, which could not be imported "
                                          f"({one_line(exc)}); install it with: {install_hint(missing)}") from exc


def importable(module: str) -> bool:
    """Whether ``module`` imports (a broken install counts as missing: it would fail later, mid-run)."""
    return import_error(module) is None


def import_error(*modules: str) -> BaseException | None:
    """Why the first of ``modules`` that cannot be imported fails, or None when they all import."""
    for module in modules:
        try:
            importlib.import_module(module)
        except (ImportError, OSError) as exc:
            logger.debug("%s cannot be imported (%s)", module, exc)
            return exc
    return None
