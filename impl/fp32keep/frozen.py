"""An immutable, hashable mapping for the library's public records (plans, layouts).

``types.MappingProxyType`` is read-only but neither hashable nor a copy: whoever holds the dict
behind it can still change it, and a frozen dataclass holding one cannot be hashed. A
:class:`FrozenMapping` copies what it is given, offers no way to change it, and hashes by its
items, so two equal plans hash alike and can key a dict or sit in a set.
"""

from __future__ import annotations

from collections.abc import Hashable, ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import FrozenInstanceError
from typing import Any, Generic, NoReturn, TypeVar

from fp32keep.errors import hidden_in_tracebacks

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Hashable)


class FrozenMapping(Mapping[K, V], Generic[K, V]):
    """A read-only copy of a mapping; equal to any mapping with the same items; hashable.

    Keeps the order it was given (a ``dict``'s), so it prints as that ``dict`` prints.
    """

    __slots__ = ("_items",)
    _items: dict[K, V]

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        object.__setattr__(self, "_items", dict(items))

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    # The dict's own lookups and views (read-only), not Mapping's generic ones built on
    # __getitem__: plans are asked `name in plan` for every tensor of a model.
    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: K, default: Any = None) -> Any:
        return self._items.get(key, default)

    def keys(self) -> KeysView[K]:
        return self._items.keys()

    def values(self) -> ValuesView[V]:
        return self._items.values()

    def items(self) -> ItemsView[K, V]:
        return self._items.items()

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._items == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._items!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled (sent between ranks, deep-copied) through __init__, never attribute by attribute
        return (type(self), (self._items,))

    # What a frozen dataclass raises (an AttributeError, as Python's attribute protocol wants):
    # mutating a plan's ``matches`` reads like mutating the plan.
    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise FrozenInstanceError(f"{type(self).__name__} is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise FrozenInstanceError(f"{type(self).__name__} is immutable: cannot delete {name!r}")
