"""Where the tests find real data: ``../shared/data`` beside the repository (see its README), in one place.

Tests take the ``shared_data`` / ``gsm8k`` fixtures of ``conftest.py``; module-level helpers and the worker processes
of the distributed tests, which cannot take fixtures, call :func:`gsm8k_records` directly.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

# <root>/main/tests/realdata.py -> <root>/shared/data
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
GSM8K = DATA / "gsm8k_train.json"


@functools.cache
def _load(path: Path) -> tuple[dict, ...]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the tests expect the shared/ data directory beside the "
                                f"repository (<root>/main and <root>/shared/data)")
    return tuple(json.loads(path.read_text(encoding="utf-8")))


def gsm8k_records(n: int | None = None) -> list[dict]:
    """The first ``n`` GSM8K training records (all 7,473 with None): dicts with instruction, input and output."""
    records = _load(GSM8K)
    return [dict(r) for r in (records if n is None else records[:n])]


def gsm8k_shortest_prompt_completions(count: int, among: int = 300) -> list[dict]:
    """The ``count`` shortest of the first ``among`` GSM8K records as TRL prompt-completion records
    (``prompt``: instruction and input, ``completion``: the answer), in their original order."""
    records = [{"prompt": f"{r['instruction']}\n{r['input']}".rstrip() + "\n", "completion": r["output"]}
               for r in gsm8k_records(among)]
    keep = sorted(sorted(range(len(records)), key=lambda i: len(records[i]["prompt"] + records[i]["completion"]))
                  [:count])
    return [records[i] for i in keep]
