"""Byte allocation inside the L1 pool: size classes whose objects live in slabs carved on demand.

The pool is cut into ``n_slabs`` slabs of ``slab_bytes`` (a multiple of the native protocol's chunk size).
Every object size held (rounded up to :data:`ALIGN`, and to the allocator's smallest spot) is a size class.  A
class of objects no larger than a slab packs ``slab_bytes // size`` of them into each slab it owns; a larger object
takes a run of ``ceil(size / slab_bytes)`` contiguous slabs of its own.  A slab is carved from the free slabs when
its class has no free spot, and given back as soon as its last object is freed, so space moves between classes
(models) as their share of the recently used objects moves; a class goes with its last object (a client may ask
for size after size).  Offsets are byte offsets into the pool.

Compaction: free spots of one class are no use to another, and a slab only goes back when its last object
goes, so a mix of sizes strands space in partly used slabs (eviction in LRU order then empties whole slabs
by evicting far more than one object's bytes).  :meth:`SlabAllocator.compact` gives a slab back without
evicting: when a class's free spots add up to a slab's worth, the live objects of its emptiest slab fit in
its other slabs' free spots, and the caller moves them there (only objects it may move: ready and unlocked);
an object moves only then, so offsets are fixed otherwise.

Accounting: ``used_bytes`` is the sum of the sizes callers asked for (bytes held by objects);
``carved_bytes`` is what the classes own; ``fragmentation_bytes`` is the difference (free spots in partly
used slabs, alignment padding and slab tails).  Single-threaded, like the cache loop that owns it.
"""

from __future__ import annotations

from collections.abc import Callable

ALIGN = 64  # object offsets are multiples of this (cache lines; every dtype's alignment)
MAX_SLAB_BYTES = 64 * 2**20  # the most one slab holds
MIN_SLABS = 16  # the pool is cut into at least this many slabs when it holds that many chunks
# the cache process's smallest spot: an object holds hundreds of bytes of bookkeeping besides its bytes, so one of a
# client's tiny layouts takes this much of the pool, and the objects a pool holds, with their bookkeeping, stay few
MIN_SPOT_BYTES = 2048


def smallest_spot(chunk_bytes: int) -> int:
    """The cache process's smallest spot: :data:`MIN_SPOT_BYTES`, or the configured chunk (aligned) where smaller."""
    return min(MIN_SPOT_BYTES, -(-chunk_bytes // ALIGN) * ALIGN)


def default_slab_bytes(pool_bytes: int, chunk_bytes: int) -> int:
    """A multiple of ``chunk_bytes`` that divides the pool's chunk count, at most 64 MiB and a 16th of the pool
    (one chunk when the pool holds fewer than 16): native-size objects then fill the pool exactly."""
    chunks = pool_bytes // chunk_bytes
    most = max(1, min(chunks // MIN_SLABS, MAX_SLAB_BYTES // chunk_bytes))
    return chunk_bytes * next(k for k in range(most, 0, -1) if chunks % k == 0)


class _Class:
    """One object size: its slabs with free spots (slab → free offsets) and live objects per slab."""

    __slots__ = ("spot", "per_slab", "run", "pattern", "partial", "live", "free_spots", "sizes")

    def __init__(self, spot: int, slab_bytes: int) -> None:
        self.spot = spot
        if spot <= slab_bytes:
            self.per_slab, self.run = slab_bytes // spot, 1
        else:
            self.per_slab, self.run = 1, -(-spot // slab_bytes)
        self.pattern = bytes(self.run)  # a run of free slabs, as the slab table spells it
        self.partial: dict[int, list[int]] = {}  # first slab → free spot offsets (only slabs with some)
        self.live: dict[int, int] = {}  # first slab → objects allocated in it
        self.free_spots = 0  # spots in ``partial`` together
        self.sizes: list[int] = []  # the sizes asked for that it serves


class SlabAllocator:
    """Byte ranges of a pool of ``n_slabs × slab_bytes`` bytes, per size class."""

    def __init__(self, pool_bytes: int, slab_bytes: int, min_spot: int = ALIGN) -> None:
        if slab_bytes <= 0 or slab_bytes % ALIGN or pool_bytes < slab_bytes:
            raise ValueError(f"slab_bytes {slab_bytes}: expected a positive multiple of {ALIGN} within the pool "
                             f"({pool_bytes} bytes)")
        if min_spot <= 0 or min_spot % ALIGN or min_spot > slab_bytes:
            raise ValueError(f"min_spot {min_spot}: expected a positive multiple of {ALIGN} within a slab "
                             f"({slab_bytes} bytes)")
        self.min_spot = min_spot  # the fewest bytes of the pool an object takes
        self.slab_bytes = slab_bytes
        self.n_slabs = pool_bytes // slab_bytes
        self.capacity_bytes = self.n_slabs * slab_bytes
        self._owner = bytearray(self.n_slabs)  # 0: free, 1: carved by a class
        self._classes: dict[int, _Class] = {}  # by spot size
        self._by_size: dict[int, _Class] = {}  # by the sizes asked for of the classes held (one per layout)
        self.used_bytes = 0
        self.carved_bytes = 0
        self.moved_bytes = 0  # bytes of objects compaction moved, in all

    @property
    def fragmentation_bytes(self) -> int:
        return self.carved_bytes - self.used_bytes

    @property
    def free_slabs(self) -> int:
        return self.n_slabs - sum(self._owner)

    def fits(self, size: int) -> bool:
        """Whether an object of ``size`` bytes could ever be allocated (the pool being otherwise empty)."""
        return 0 < size <= self.capacity_bytes

    def _class(self, size: int) -> _Class:
        cls = self._by_size.get(size)
        if cls is None:
            spot = max(-(-size // ALIGN) * ALIGN, self.min_spot)
            cls = self._classes.get(spot)
            if cls is None:
                cls = self._classes[spot] = _Class(spot, self.slab_bytes)
            self._by_size[size] = cls
            cls.sizes.append(size)
        return cls

    def _forget(self, cls: _Class) -> None:
        """A class that holds no object goes, with every size it served (a layout may never return)."""
        del self._classes[cls.spot]
        for size in cls.sizes:
            del self._by_size[size]

    def alloc(self, size: int) -> int | None:
        """The byte offset of ``size`` free bytes (None: the class has no free spot and no slab run is free)."""
        if not 0 < size <= self.capacity_bytes:
            return None
        cls = self._by_size.get(size) or self._class(size)
        partial = cls.partial
        if partial:
            first = next(iter(partial))
            spots = partial[first]
            offset = spots.pop()
            cls.free_spots -= 1
            if not spots:
                del partial[first]
        else:
            owner = self._owner
            first = owner.find(cls.pattern)
            if first < 0:
                if not cls.live:  # made for this call: it goes with its failure
                    self._forget(cls)
                return None
            run = cls.run
            owner[first : first + run] = b"\1" * run
            self.carved_bytes += run * self.slab_bytes
            base = first * self.slab_bytes
            spot = cls.spot
            offset = base
            if cls.per_slab > 1:  # the rest of the slab's spots, handed out from the lowest offset up
                partial[first] = [base + i * spot for i in range(cls.per_slab - 1, 0, -1)]
                cls.free_spots += cls.per_slab - 1
        cls.live[first] = cls.live.get(first, 0) + 1
        self.used_bytes += size
        return offset

    def free(self, offset: int, size: int) -> None:
        """Give back what :meth:`alloc` returned for ``size``; a slab left empty goes back to the free slabs."""
        cls = self._by_size[size]
        first = offset // self.slab_bytes
        self.used_bytes -= size
        live = cls.live[first] - 1
        if live:
            cls.live[first] = live
            cls.partial.setdefault(first, []).append(offset)
            cls.free_spots += 1
            return
        del cls.live[first]
        self._release(cls, first)
        if not cls.live:  # its last object
            self._forget(cls)

    def _release(self, cls: _Class, first: int) -> None:
        """An emptied slab (run) goes back to the free slabs."""
        cls.free_spots -= len(cls.partial.pop(first, ()))
        self._owner[first : first + cls.run] = bytes(cls.run)
        self.carved_bytes -= cls.run * self.slab_bytes

    def compact(self, movable: Callable[[int], bool], move: Callable[[int, int], None]) -> bool:
        """Give one slab back without evicting.  In a class whose free spots add up to a slab's worth (so the
        live objects of its emptiest slab fit in its other slabs' spots), the emptiest slab at most half full
        whose objects are all ``movable(offset)`` (ready and unlocked, say) is vacated: ``move(old, new)``
        moves each object to a free spot elsewhere in the class.  At most half a slab moves per slab given
        back, and the work is per class and per slab of that class, never per object of the pool.  True when
        a slab went back."""
        for cls in self._classes.values():
            if cls.free_spots < cls.per_slab or cls.per_slab == 1:
                continue
            live, partial = cls.live, cls.partial
            for first in sorted(partial, key=live.__getitem__):
                if live[first] * 2 > cls.per_slab:
                    break
                base, spot = first * self.slab_bytes, cls.spot
                vacant = set(partial[first])
                objects = [old for old in range(base, base + cls.per_slab * spot, spot) if old not in vacant]
                if all(map(movable, objects)):
                    self._vacate(cls, first, objects, move)
                    return True
        return False

    def _vacate(self, cls: _Class, first: int, objects: list[int], move: Callable[[int, int], None]) -> None:
        live, partial = cls.live, cls.partial
        for old in objects:
            target = next(slab for slab in partial if slab != first)
            spots = partial[target]
            move(old, spots.pop())
            if not spots:
                del partial[target]
            partial[first].append(old)
            live[target] += 1
        self.moved_bytes += len(objects) * cls.spot
        del live[first]
        self._release(cls, first)

    def classes(self) -> dict[int, tuple[int, int]]:
        """Per class (spot bytes): (slabs it owns, objects it holds); for tests and the benchmark."""
        return {spot: (len(cls.live) * cls.run, sum(cls.live.values())) for spot, cls in self._classes.items()
                if cls.live}
