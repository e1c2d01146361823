"""What an LRU L1 of the same capacity would find, on a hash-sampled share of the keys asked for (SHARDS,
Waldspurger et al., FAST 2015): the ``adaptive`` order compares it with what L1 found of the same keys, and
leaves ARC's two lists for one LRU list where LRU would be finding more; and what one that admits a first-sight
store by chance, or under an age floor, would (:mod:`~mpcache.eviction.admission`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

from mpcache.eviction.frequency import MIX, WORD
from mpcache.eviction.refusal import RefusedKeys, draw

SHADOW_KEYS = 4096  # sampled keys held at most: the sampling rate halves when more would be held
AGE_EVICTIONS = 256  # the eviction age is a running mean over about this many evictions


def quiet_for(uses: Iterable[tuple[float, float]], room: float, since: float) -> bool:
    """Whether the objects that give up ``room`` bytes, least recently used first (``uses``: each one's last access
    and bytes), were all last used at or before access ``since``: a store needing that room passes the age floor."""
    for used, nbytes in uses:
        if room <= 0:
            break
        if used > since:
            return False
        room -= nbytes
    return True


class ShadowLru:
    """An LRU list of the sampled keys within ``capacity_bytes`` × the sampling rate.  Every key is sampled
    while that holds at most ``max_keys`` (:data:`SHADOW_KEYS`) keys; past it the rate halves (a key is sampled
    while the top bits of its mixed ``code`` are zero, one bit more per halving), which keeps a key's fate the
    same in every run, and a key sampled at a rate sampled at every higher one.  With ``admit`` below 1, an
    access's keys it does not hold are admitted only where they fit without an eviction, where the access's draw
    (:func:`~mpcache.eviction.refusal.draw` of its number) is below ``admit``, or where one of the access's keys
    was refused before (within the capacity's bytes of refused keys, as L1 remembers them).  ``aged``: it keeps each
    key's last access and ``age``, the accesses between a key's last use and its eviction (a running mean over about
    :data:`AGE_EVICTIONS` evictions), and refuses an access's keys it does not hold where their room would evict a key
    used within ``floor`` accesses (0, at first: none)."""

    def __init__(self, capacity_bytes: float, code: Callable[[Hashable], int] = hash,
                 max_keys: int = SHADOW_KEYS, admit: float = 1.0, aged: bool = False) -> None:
        self._capacity = float(capacity_bytes)
        self._aged = aged
        self._used: dict[Hashable, int] = {}  # (aged) each key's last access
        self.age = 0.0
        self.floor = 0.0
        self._code = code
        self._max_keys = max_keys
        self._admit = admit
        self._refused = RefusedKeys()
        self._keys: OrderedDict[Hashable, float] = OrderedDict()  # sampled key → bytes, least recently used first
        self._bytes = 0.0
        self._asked: list[tuple[Hashable, float]] = []  # the current access's sampled keys, in the order asked
        self._access = -1
        self.halvings = 0  # the sampling rate is 1 / 2 ** halvings

    def sees(self, key: Hashable, nbytes: float, access: int, sampled: bool = False) -> bool | None:
        """``key`` (of ``nbytes``) is asked for by ``access`` (a lookup and its store): whether the LRU holds it;
        None when the key is not sampled.  An access's keys become the newest once the next access begins (or
        ``max_keys`` of them wait), its last key first and its first key last, as L1's recency phase takes a
        request's chunks back when its store is committed before its read locks are released (a prefix loses its
        tail before its head).  ``sampled``: the caller knows the key is sampled at the current rate."""
        if access != self._access:
            self._settle()
            self._access = access
        if not sampled and self.halvings and not self._sampled(key, self.halvings):
            return None
        asked = self._asked
        asked.append((key, nbytes))
        held = key in self._keys
        if len(asked) >= self._max_keys:  # an access this long (stores with no lookup between): settled in parts
            self._settle()
        return held

    def seed(self, held: Iterable[tuple[Hashable, float]]) -> None:
        """Start from what an LRU holds now: ``held`` (key, bytes), least recently used first (the sampled ones;
        a key given again becomes the newest; the oldest leave while over capacity)."""
        for key, nbytes in held:
            if self.halvings and not self._sampled(key, self.halvings):
                continue
            self._bytes += nbytes - self._keys.pop(key, 0.0)
            self._keys[key] = nbytes
            self._trim()
            if len(self._keys) > self._max_keys:
                self._halve()

    def _settle(self) -> None:
        """The access before's keys become the newest, tail first; the oldest keys leave while over capacity."""
        asked, keys = self._asked, self._keys
        if not asked:
            return
        if self._admit < 1.0 or self.floor:
            new = [(key, nbytes) for key, nbytes in asked if key not in keys]
            if new and not self._admits(new, asked):
                if not self.floor:  # (second sight admits by chance; the floor is about what a store would evict)
                    self._refused.remember_pairs(new, self._capacity / (1 << self.halvings))
                asked[:] = [(key, nbytes) for key, nbytes in asked if key in keys]
        for key, nbytes in reversed(asked):
            held = keys.pop(key, None)
            keys[key] = nbytes
            self._bytes += nbytes - (held or 0.0)
        if self._aged:
            used, access = self._used, self._access
            for key, _ in asked:
                used[key] = access
        asked.clear()
        self._trim()
        while len(self._keys) > self._max_keys:
            self._halve()

    def _admits(self, new: list[tuple[Hashable, float]], asked: list[tuple[Hashable, float]]) -> bool:
        """Whether the access's ``new`` keys (those it does not hold) are admitted (``admit`` below 1, or a ``floor``):
        the cheapest tests first."""
        over = self._bytes + sum(nbytes for _, nbytes in new) - self._capacity / (1 << self.halvings)
        if over <= 0:
            return True
        if self.floor:  # the least recently used keys leave, but for those the access asks for, which it keeps
            mine, used = {key for key, _ in asked}, self._used
            return quiet_for(((used.get(key, -1), nbytes) for key, nbytes in self._keys.items() if key not in mine),
                             over, self._access - self.floor)
        refused = self._refused
        return any(key in refused for key, _ in asked) or draw(self._access) < self._admit

    def merge(self, key: Hashable, other: Hashable) -> None:
        """``other`` becomes part of ``key`` (a miniature's two tail segments merged): its bytes join ``key``'s where
        both are held, and leave with it where only it is."""
        nbytes = self._keys.pop(other, None)
        self._used.pop(other, None)
        if nbytes is None:
            return
        if key in self._keys:
            self._keys[key] += nbytes
        else:
            self._bytes -= nbytes

    def follow(self, halvings: int) -> None:
        """Sample at 1 / 2 ** ``halvings`` at the most (as another shadow that has halved so far does)."""
        while self.halvings < halvings:
            self._halve()

    def _halve(self) -> None:
        """Sample half as many keys: those no longer sampled leave (the others keep their order)."""
        self.halvings += 1
        self._keys = OrderedDict((key, nbytes) for key, nbytes in self._keys.items()
                                 if self._sampled(key, self.halvings))
        self._bytes = sum(self._keys.values())
        if self._aged:
            self._used = {key: self._used[key] for key in self._keys if key in self._used}
        self._trim()

    def _trim(self) -> None:
        """The least recently used keys leave while the rest hold more than the capacity at the sampling rate."""
        keys, capacity = self._keys, self._capacity / (1 << self.halvings)
        while self._bytes > capacity and keys:
            key, nbytes = keys.popitem(False)
            self._bytes -= nbytes
            if self._aged:
                age = self._access - self._used.pop(key, self._access)
                self.age = age if not self.age else self.age + (age - self.age) / AGE_EVICTIONS

    def _sampled(self, key: Hashable, halvings: int) -> bool:
        """Whether ``key`` is sampled at the rate 1 / 2 ** ``halvings``: the top bits of its mixed code are zero."""
        return not ((self._code(key) * MIX) & WORD) >> (64 - halvings)

    def __len__(self) -> int:
        return len(self._keys)
