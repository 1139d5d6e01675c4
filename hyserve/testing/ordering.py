"""The order in which ``scripts/test.sh``'s two workers take the test files: longest first (``tests/conftest.py``,
``tests/file_costs.json``, ``scripts/file_costs.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def longest_files_first(items: Sequence[T], file_of: Callable[[T], str], costs: dict[str, float]) -> list[T]:
    """``items`` (tests, in their collection order) with their files ordered by ``costs`` (seconds), longest first:
    files ``costs`` does not list keep their order after those it lists, and each file's items keep theirs. A file's
    items stay together as long as they come together."""
    place = {id(item): i for i, item in enumerate(items)}
    return sorted(items, key=lambda item: (-costs.get(file_of(item), 0.0), place[id(item)]))
