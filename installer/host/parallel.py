"""Run one function per host (or any item) in threads, collecting each result or domain error."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

from installer.core.errors import InstallerError

T = TypeVar("T")
R = TypeVar("R")


def each(fn: Callable[[T], R], items: Iterable[T], width: int = 10) -> dict[T, R | InstallerError]:
    """``{item: fn(item)}`` in input order, with the InstallerError an item raised in place of
    its result (anything else propagates): the caller decides whether one failure stops all."""
    items = list(items)
    if not items:
        return {}
    out: dict[T, R | InstallerError] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(width, len(items)))) as pool:
        futures = {x: pool.submit(fn, x) for x in items}
        for x, fut in futures.items():
            try:
                out[x] = fut.result()
            except InstallerError as e:
                out[x] = e
    return out
