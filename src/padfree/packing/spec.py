"""How sequences are planned into rows, as one object: :class:`PackingSpec`.

Every route that packs (:func:`~padfree.pack_sequences`, :class:`~padfree.Packer`, :func:`~padfree.pack_dataset`,
the packing datasets, the collators, the trainers' packing, ``padfree pack``) takes the same five planning settings.
A :class:`PackingSpec` holds them once, validated once, and is passed as ``spec=`` in place of the keywords:

>>> spec = PackingSpec(capacity=8, strategy="FirstFitDecreasing", overlong="split")
>>> spec
PackingSpec(capacity=8, strategy='ffd', seed=None, overlong='split', max_sequences_per_bin=None)
>>> from padfree import pack_sequences
>>> pack_sequences([5, 3, 12], spec=spec).bins == pack_sequences([5, 3, 12], 8, "ffd", overlong="split").bins
True

A setting given both ways is refused, naming both (a keyword left at its default defers to the spec):

>>> pack_sequences([5, 3], spec=spec, overlong="drop")
Traceback (most recent call last):
...
padfree.errors.InvalidArgumentError: overlong='drop' is given both as a keyword and in spec (spec.overlong='split'); ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from padfree.errors import InvalidArgumentError, describe
from padfree.packing.inputs import OVERLONG_POLICIES, as_capacity, as_choice, as_positive_int, as_seed
from padfree.packing.strategies import DEFAULT_STRATEGY, STRATEGIES, as_strategy

__all__ = ["PackingSpec", "resolve_spec"]

_Spec = TypeVar("_Spec")


@dataclass(frozen=True)
class PackingSpec:
    """The planning settings of a pack, validated on construction with the errors the keywords give.

    Args:
        capacity: tokens per row (``max_length`` on the routes that call it so), an int in ``[1, 2**26]``.
        strategy: a strategy of :data:`~padfree.packing.STRATEGIES`, any of its names; kept as its short name.
        seed: seeds randomized strategies (``ffs``); None draws fresh entropy.
        overlong: sequences longer than ``capacity``: ``"error"``, ``"truncate"``, ``"split"`` or ``"drop"``. A
            strategy that cuts sequences at the rows' edges (``wrapped``) loses nothing, so only ``"error"`` and
            ``"split"`` go with it.
        max_sequences_per_bin: at most this many pieces per row (None: no limit); not with ``wrapped``.

    >>> PackingSpec(4096, "obfd", max_sequences_per_bin=0)
    Traceback (most recent call last):
    ...
    padfree.errors.InvalidArgumentError: max_sequences_per_bin must be an integer >= 1 or None, got 0
    """

    capacity: int
    strategy: str = DEFAULT_STRATEGY
    seed: int | None = None
    overlong: str = "error"
    max_sequences_per_bin: int | None = None

    def __post_init__(self) -> None:
        for name, value in _checked_packing(dataclasses.asdict(self), {}).items():
            object.__setattr__(self, name, value)

    @property
    def cuts_at_row_edges(self) -> bool:
        """Whether the strategy cuts sequences where rows end (every piece then its own sequence)."""
        return STRATEGIES[self.strategy].cuts_at_row_edges

    @property
    def refuses_overlong(self) -> bool:
        """Whether a sequence longer than ``capacity`` is an error (``overlong="error"``, a strategy that does not
        cut at the rows' edges)."""
        return self.overlong == "error" and not self.cuts_at_row_edges

    @classmethod
    def resolve(cls, spec: Any, keywords: Mapping[str, Any], *, names: Mapping[str, str] | None = None,
                defaults: Mapping[str, Any] | None = None) -> PackingSpec:
        """The spec a route runs with: ``spec``, or one built from the route's ``keywords`` (see
        :func:`resolve_spec`)."""
        return resolve_spec(cls, spec, "spec", keywords, _checked_packing, names=names, defaults=defaults)


def _checked_packing(values: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """``values`` (the fields of a :class:`PackingSpec`) validated, one error naming the route's argument."""
    name = {f: names.get(f, f) for f in ("capacity", "strategy", "seed", "overlong", "max_sequences_per_bin")}
    out = {
        "capacity": as_capacity(values["capacity"], name["capacity"]),
        "strategy": as_strategy(values["strategy"], name["strategy"]),
        "seed": as_seed(values["seed"], name["seed"]),
        "overlong": as_choice(values["overlong"], name["overlong"], OVERLONG_POLICIES),
        "max_sequences_per_bin": as_positive_int(values["max_sequences_per_bin"], name["max_sequences_per_bin"],
                                                 allow_none=True),
    }
    if STRATEGIES[out["strategy"]].cuts_at_row_edges:
        if out["overlong"] not in ("error", "split"):
            raise InvalidArgumentError(
                f"{name['overlong']}={out['overlong']!r} does not apply to {name['strategy']}={out['strategy']!r}, "
                f"which cuts every sequence at the rows' edges (nothing is truncated or dropped); pass 'error' or "
                f"'split'")
        if out["max_sequences_per_bin"] is not None:
            raise InvalidArgumentError(
                f"{name['max_sequences_per_bin']} does not apply to {name['strategy']}={out['strategy']!r} (rows "
                f"are cut from the stream of sequences, whatever it holds); pass None")
    return out


def _unchanged(value: Any, default: Any) -> bool:
    """Whether a keyword was left at its default (so that it defers to a spec)."""
    if value is default:
        return True
    try:
        return type(value) is type(default) and bool(value == default)
    except (TypeError, ValueError):  # arrays and other values without a single truth value
        return False


def resolve_spec(cls: type[_Spec], spec: Any, argument: str, keywords: Mapping[str, Any], check: Any, *,
                 names: Mapping[str, str] | None = None, defaults: Mapping[str, Any] | None = None) -> _Spec:
    """The one resolution every route shares: ``spec`` (an instance of ``cls``, passed as ``argument=``) when
    given, else ``cls`` built from ``keywords`` (``{field: value}``) after ``check(keywords, names)`` validated them
    under the route's own argument names (``names``: ``{field: name}``, e.g. ``{"capacity": "max_length"}``).

    With a spec, every keyword must be left at the route's default (``defaults``: ``{field: default}`` where it is not
    the field's own, None for a field without one): a setting given both ways is an
    :class:`~padfree.errors.InvalidArgumentError` naming both.
    """
    names = names or {}
    if spec is None:
        return cls(**check(keywords, names))
    if not isinstance(spec, cls):
        raise InvalidArgumentError(f"{argument} must be a {cls.__name__} or None, got {describe(spec)}")
    own = {f.name: None if f.default is dataclasses.MISSING else f.default for f in dataclasses.fields(cls)}
    own.update(defaults or {})
    for field, value in keywords.items():
        if not _unchanged(value, own[field]):
            keyword = names.get(field, field)
            raise InvalidArgumentError(
                f"{keyword}={repr(value) if isinstance(value, (str, int, float, type(None))) else describe(value)} "
                f"is given both as "
                f"a keyword and in {argument} ({argument}.{field}={getattr(spec, field)!r}); pass it one way: in "
                f"{argument}, or as {keyword}= without {argument}")
    return spec
