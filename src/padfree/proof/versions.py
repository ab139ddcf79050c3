"""The transformers versions padfree's test suite has passed on, and the warning outside them.

``padfree/tested_versions.json`` records the floor (``make test-floor``) and the newest version (the pins of
``make test``). On a transformers outside that range :func:`padfree.configure_packing` logs one warning and proves
each model on the spot (:mod:`padfree.proof.certify`) instead of trusting the support table.

>>> floor, newest = version_span()
>>> floor is None or floor <= newest
True
"""

from __future__ import annotations

import functools
import json
import logging
from importlib import resources

__all__ = ["warn_if_untested"]

log = logging.getLogger("padfree")


def _key(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@functools.cache
def version_span(package: str = "transformers") -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """``(floor, newest)`` of ``package`` as version tuples (None when the file does not say)."""
    try:
        data = json.loads(resources.files("padfree").joinpath("tested_versions.json").read_text())
    except FileNotFoundError:
        return None, None
    entry = data.get(package, {})
    floor, newest = entry.get("floor"), entry.get("newest")
    return (_key(floor) if floor else None), (_key(newest) if newest else None)


def within_span(version: str, package: str = "transformers") -> bool:
    """Whether ``version`` lies within the tested range (unknown range: True)."""
    floor, newest = version_span(package)
    key = _key(version)
    return (floor is None or key >= floor) and (newest is None or key[:2] <= newest[:2])


@functools.cache
def warn_if_untested() -> bool:
    """Log (once) a warning when the installed transformers lies outside the tested range; True if it does."""
    import transformers

    version = str(transformers.__version__)
    if within_span(version):
        return False
    floor, newest = version_span()
    span = f"{'.'.join(map(str, floor))} to {'.'.join(map(str, newest))}" if floor and newest else "unknown"
    log.warning("padfree: transformers %s is outside the range padfree's test suite passed on (%s); every model is "
                "certified on the spot (a tiny twin of its class, packed against per-sequence) instead of trusted "
                "from the support table", version, span)
    return True
