"""The exceptions padfree raises.

Every error is a :class:`PadfreeError`, itself a :class:`ValueError`, so code that already catches
``ValueError`` keeps working. Messages name the offending argument, the value received and what would
have been accepted.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "DataLoadError",
    "InvalidArgumentError",
    "InvalidLayoutError",
    "InvalidLengthsError",
    "InvalidSampleError",
    "InvalidTokensError",
    "OutOfRangeError",
    "OverlongSequenceError",
    "PackingDisabledError",
    "PackingMismatchError",
    "PadfreeError",
    "RankMismatchError",
    "StateMismatchError",
    "TokenizerLoadError",
    "UnsupportedModelError",
]


class PadfreeError(ValueError):
    """Base class of every error raised by padfree."""


class InvalidArgumentError(PadfreeError):
    """A scalar option (capacity, strategy, seed, ...) has a value padfree cannot use."""


class InvalidLengthsError(PadfreeError):
    """The sequence lengths are not a 1-D array of positive integers."""


class InvalidTokensError(PadfreeError):
    """Token ids (or labels) are not sequences of integers matching the plan's lengths."""


class OverlongSequenceError(PadfreeError):
    """A sequence is longer than the bin capacity and the overlong policy is ``"error"``."""


class DataLoadError(PadfreeError):
    """A data file or directory is missing, unreadable, or lacks the column that was asked for."""


class TokenizerLoadError(PadfreeError):
    """A tokenizer could not be loaded (missing or unreadable directory, missing optional dependency)."""


class InvalidLayoutError(PadfreeError):
    """Sequence boundaries (lengths, cu_seqlens, position_ids, segment ids, seq_idx, a mask) that are not a packing."""


class BackendUnavailableError(PadfreeError, ImportError):
    """An optional backend (torch, flex attention, ...) that the call needs is not installed; also an ImportError."""


class InvalidSampleError(InvalidTokensError):
    """A sample of a dataset or stream is not token ids (or a dict with them), has no tokens, or its labels do not
    match its token ids."""


class StateMismatchError(PadfreeError):
    """A saved state (``load_state_dict``) comes from another configuration, or is resumed under another loader."""


class RankMismatchError(PadfreeError):
    """The data-parallel ranks computed different schedules (other data, seed or arguments on some rank): training
    on would lose some samples and repeat others, or hang; the message names the ranks that disagree."""


class UnsupportedModelError(PadfreeError):
    """A model (or one of its sequence-mixing modules) that padfree cannot make packing-exact; the message names
    the module class and what would be needed."""


class PackingDisabledError(PadfreeError):
    """A packed batch reached a configured model together with something that would let sequences see each other
    (an active cache, a 0/1 attention mask); the message says how to fix the call."""


class PackingMismatchError(PadfreeError):
    """:func:`padfree.verify` found a packed run that differs from the per-sequence runs beyond the tolerance."""


class OutOfRangeError(PadfreeError, IndexError):
    """An index (a row of a packing dataset, a bin of a plan) outside the range there is; also an IndexError, so
    that ``for row in dataset`` (Python's sequence protocol) still stops at the end."""


def describe(value: object, limit: int = 60) -> str:
    """A short ``repr`` of ``value`` for error messages, with its type when that helps."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{text} (type {type(value).__name__})"
