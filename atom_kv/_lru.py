"""Bounded, ordered collections: past ``capacity`` the oldest entry goes.

Used wherever the connector remembers ids it may be asked about again
(finished transfers, released leases, partial reports, cached sockets) but
must not grow without bound when a peer never completes them. "Oldest" is the
least recently inserted, or least recently :meth:`BoundedDict.touch`-ed.
Not thread-safe: the owner holds its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Hashable, Iterator, Optional, TypeVar, Union, overload

__all__ = ["BoundedDict", "BoundedSet"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")

_MISSING = object()


class BoundedDict(Generic[K, V]):
    """A mapping of at most ``capacity`` entries; inserting past it evicts the
    oldest and hands it to ``on_evict(key, value)`` (to close or log it)."""

    __slots__ = ("capacity", "_items", "_on_evict")

    def __init__(self, capacity: int, on_evict: Optional[Callable[[K, V], None]] = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()
        self._on_evict = on_evict

    def __setitem__(self, key: K, value: V) -> None:
        """Insert or replace ``key`` as the newest entry, then evict past capacity."""
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            old_key, old_value = self._items.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict(old_key, old_value)

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    @overload
    def get(self, key: K) -> Optional[V]: ...

    @overload
    def get(self, key: K, default: Union[V, D]) -> Union[V, D]: ...

    def get(self, key: K, default: object = None) -> object:
        return self._items.get(key, default)

    def touch(self, key: K) -> None:
        """Make ``key`` the newest entry (least-recently-used order)."""
        self._items.move_to_end(key)

    @overload
    def pop(self, key: K) -> V: ...

    @overload
    def pop(self, key: K, default: Union[V, D]) -> Union[V, D]: ...

    def pop(self, key: K, default: object = _MISSING) -> object:
        if default is _MISSING:
            return self._items.pop(key)
        return self._items.pop(key, default)

    def __delitem__(self, key: K) -> None:
        del self._items[key]

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def items(self):
        return self._items.items()

    def values(self):
        return self._items.values()

    def clear(self) -> None:
        """Forget everything (without calling ``on_evict``)."""
        self._items.clear()


class BoundedSet(BoundedDict[K, None]):
    """A set of at most ``capacity`` members; adding past it forgets the oldest."""

    __slots__ = ()

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)

    def add(self, key: K) -> None:
        """Add ``key`` (or refresh it) as the newest member."""
        self[key] = None

    def discard(self, key: K) -> bool:
        """Remove ``key``; True if it was a member."""
        if key not in self:
            return False
        del self[key]
        return True
