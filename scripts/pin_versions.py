"""Print ``name==version`` for every package that ``padfree[EXTRAS]`` resolves to in this interpreter.

The body of ``constraints/ci.txt`` (and of the resolved half of ``constraints/floor.txt``): run it with a venv's
python, after a green suite, to pin exactly what that suite passed on. padfree itself and torch are left out (torch
is chosen by ``scripts/bootstrap.sh``); pip, uv and setuptools are added (bootstrap's installers and the editable
build's backend).

    .venv/bin/python scripts/pin_versions.py            # padfree[all,dev]
    .venv/bin/python scripts/pin_versions.py all,dev
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(root: str, extras: set[str]) -> dict[str, md.Distribution]:
    """Every installed distribution ``root[extras]`` requires, transitively, with the extras each was asked for."""
    asked: dict[str, set[str]] = {}
    found: dict[str, md.Distribution] = {}
    todo = [(root, set(extras))]
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if key in asked and wanted <= asked[key]:
            continue
        asked[key] = asked.get(key, set()) | wanted
        try:
            dist = found[key] = md.distribution(name)
        except md.PackageNotFoundError:
            sys.exit(f"{name} is required but not installed in {sys.prefix}")
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in asked[key] | {""}):
                todo.append((req.name, set(req.extras)))
    return found


def main() -> None:
    extras = set((sys.argv[1] if len(sys.argv) > 1 else "all,dev").split(","))
    pins = {canonicalize_name(d.metadata["Name"]): d.version for d in closure("padfree", extras).values()}
    for tool in ("pip", "uv", "setuptools"):
        with contextlib.suppress(md.PackageNotFoundError):  # a venv set up by pip alone (PADFREE_NO_UV=1): no uv
            pins[tool] = md.version(tool)
    for name in sorted(pins):
        if name not in ("padfree", "torch"):
            print(f"{name}=={pins[name]}")


if __name__ == "__main__":
    main()
