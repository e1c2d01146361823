"""L1 by bytes: the slab allocator on its own, and L1Manager's LRU across object sizes on top of it."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.null_cache import NullPublisher
from mpcache.cache.l1 import L1Manager
from mpcache.cache.slabs import ALIGN, SlabAllocator, default_slab_bytes
from mpcache.contract.events import EventType as E
from mpcache.contract.keys import ChunkKey

KIB, MIB = 2**10, 2**20


def test_default_slab_is_a_multiple_of_the_chunk_dividing_the_pool():
    """The slab is a multiple of the native chunk that divides the pool's chunk count, at most 64 MiB and
    a 16th of the pool (one chunk for tiny pools), so native-size objects fill the pool exactly."""
    assert 16 * MIB == default_slab_bytes(256 * MIB, 64 * KIB)
    assert 64 * MIB == default_slab_bytes(2 * 2**30, 64 * KIB)
    assert 4 * KIB == default_slab_bytes(8 * 4 * KIB, 4 * KIB)
    slab = default_slab_bytes(100 * 64 * KIB, 64 * KIB)  # 100 chunks: the largest divisor of 100 up to 6
    assert (5 * 64 * KIB, 0) == (slab, (100 * 64 * KIB) % slab)


def test_small_objects_share_a_slab_and_an_emptied_slab_goes_back():
    """Objects of one size pack into one slab at consecutive aligned offsets; when the last one is freed the
    slab is free again and can be carved by another size."""
    alloc = SlabAllocator(4 * MIB, MIB)
    offsets = [alloc.alloc(300 * KIB) for _ in range(3)]
    assert [0, 300 * KIB, 600 * KIB] == offsets
    assert (900 * KIB, MIB, 3 * MIB) == (alloc.used_bytes, alloc.carved_bytes, alloc.free_slabs * MIB)
    for offset in offsets:
        alloc.free(offset, 300 * KIB)
    assert (0, 0, 4) == (alloc.used_bytes, alloc.carved_bytes, alloc.free_slabs)
    assert [0, 2 * MIB] == [alloc.alloc(2 * MIB), alloc.alloc(2 * MIB)]  # the slab went back: runs from 0


def test_a_freed_spot_is_reused_before_a_new_slab_is_carved():
    """A free spot in a class's partly used slab is handed out again instead of carving another slab."""
    alloc = SlabAllocator(4 * MIB, MIB)
    first, second = alloc.alloc(512 * KIB), alloc.alloc(512 * KIB)
    third = alloc.alloc(512 * KIB)  # slab 0 is full: slab 1
    assert (0, 512 * KIB, MIB) == (first, second, third)
    alloc.free(second, 512 * KIB)
    assert ({512 * KIB, 3 * MIB // 2}, 2) == ({alloc.alloc(512 * KIB), alloc.alloc(512 * KIB)}, alloc.free_slabs)


def test_objects_larger_than_a_slab_take_contiguous_runs():
    """A 2.5-slab object takes 3 contiguous free slabs; with no such run it gets none even though enough
    slabs are free in total; freeing it gives the whole run back."""
    alloc = SlabAllocator(6 * MIB, MIB)
    small = [alloc.alloc(MIB) for _ in range(6)]
    for index in (0, 2, 4):  # free slabs 0, 2 and 4: three free, none adjacent
        alloc.free(small[index], MIB)
    assert None is alloc.alloc(5 * MIB // 2)
    alloc.free(small[3], MIB)
    alloc.free(small[5], MIB)  # slabs 2..5 free
    big = alloc.alloc(5 * MIB // 2)
    assert (2 * MIB, 3 * MIB - 5 * MIB // 2) == (big, alloc.fragmentation_bytes)
    alloc.free(big, 5 * MIB // 2)
    assert (5, 0) == (alloc.free_slabs, alloc.fragmentation_bytes)


def test_fragmentation_counts_free_spots_padding_and_slab_tails():
    """fragmentation_bytes = bytes carved into slabs minus bytes objects asked for: a 1000-byte object is
    padded to 1024 (ALIGN 64), and the spots left in its slab count too."""
    alloc = SlabAllocator(2 * MIB, MIB)
    assert 1024 % ALIGN == 0
    alloc.alloc(1000)
    assert (1000, MIB, MIB - 1000) == (alloc.used_bytes, alloc.carved_bytes, alloc.fragmentation_bytes)
    alloc.alloc(MIB // 3 * 2)  # one per slab: a third of the slab is tail
    assert MIB - 1000 + (MIB - MIB // 3 * 2) == alloc.fragmentation_bytes
    assert {1024: (1, 1), MIB // 3 * 2 // ALIGN * ALIGN + ALIGN: (1, 1)} == alloc.classes()


def test_a_size_class_is_forgotten_with_its_last_object():
    """A client that registers layout after layout asks for ever new object sizes: a class, and every size asked for
    that it serves, is kept only while it holds an object, so the allocator's memory follows what the pool holds,
    not how many sizes were ever asked for.  A forgotten size asked for again gets a class anew."""
    alloc = SlabAllocator(4 * MIB, MIB)
    kept = alloc.alloc(ALIGN)  # one class keeps an object throughout
    for size in range(ALIGN + 1, ALIGN + 2000):  # 1,999 sizes, each allocated and freed
        alloc.free(alloc.alloc(size), size)
    assert ({ALIGN: (1, 1)}, [ALIGN]) == (alloc.classes(), sorted(alloc._classes))
    assert [ALIGN] == list(alloc._by_size)
    twice = [alloc.alloc(3 * ALIGN), alloc.alloc(3 * ALIGN - 1)]  # two sizes of one class: one slab
    assert [MIB, MIB + 3 * ALIGN] == twice and {ALIGN: (1, 1), 3 * ALIGN: (1, 2)} == alloc.classes()
    alloc.free(twice[0], 3 * ALIGN)
    assert [ALIGN, 3 * ALIGN - 1, 3 * ALIGN] == sorted(alloc._by_size)  # the class still holds an object
    alloc.free(twice[1], 3 * ALIGN - 1)
    alloc.free(kept, ALIGN)
    assert ({}, {}, {}, 0, 0) == (alloc._classes, alloc._by_size, alloc.classes(), alloc.used_bytes,
                                  alloc.carved_bytes)
    assert 0 == alloc.alloc(5 * ALIGN)


def test_a_size_class_made_for_an_allocation_that_fails_goes_with_it():
    """A new size asked for while no slab is free: the allocation fails and leaves no class behind (a client could
    otherwise grow the tables with a new size per store while the pool is full of objects it cannot evict)."""
    alloc = SlabAllocator(2 * MIB, MIB)
    held = [alloc.alloc(MIB), alloc.alloc(MIB)]
    for size in range(ALIGN + 1, ALIGN + 500):
        assert alloc.alloc(size) is None
    assert ([MIB], [MIB]) == (sorted(alloc._classes), sorted(alloc._by_size))
    for offset in held:
        alloc.free(offset, MIB)
    assert ({}, {}) == (alloc._classes, alloc._by_size)


def test_an_object_takes_at_least_the_smallest_spot():
    """With a smallest spot, a 1-byte object takes that much of the pool: a pool of 64 KiB holds 32 objects of a
    2 KiB spot however small they are, and the padding counts as fragmentation; a smallest spot that is no multiple
    of the alignment, or larger than a slab, is refused."""
    alloc = SlabAllocator(64 * KIB, 16 * KIB, min_spot=2 * KIB)
    offsets = [alloc.alloc(1) for _ in range(33)]
    assert [2 * KIB * n for n in range(32)] == sorted(offsets[:32]) and offsets[32] is None
    assert (32, 64 * KIB, 64 * KIB - 32) == (len(set(offsets[:32])), alloc.carved_bytes, alloc.fragmentation_bytes)
    for bad in (0, ALIGN + 1, 32 * KIB):
        with pytest.raises(ValueError, match=f"min_spot {bad}: expected a positive multiple of {ALIGN} within a"):
            SlabAllocator(64 * KIB, 16 * KIB, min_spot=bad)


def test_an_object_larger_than_the_pool_never_fits():
    """fits() is False and alloc() None for more bytes than the whole pool, whatever is free."""
    alloc = SlabAllocator(4 * MIB, MIB)
    assert (False, None, True) == (alloc.fits(4 * MIB + 1), alloc.alloc(4 * MIB + 1), alloc.fits(4 * MIB))


# -- L1Manager over several object sizes ----------------------------------------------------------------


class _Recorder(NullPublisher):
    """Keeps the L1_KEYS_EVICTED counts (the unit tests of the events themselves use a real ring)."""

    def __init__(self) -> None:
        self.evicted: list[dict] = []

    def emit(self, etype, fields=(), **options):  # type: ignore[override]
        if etype is E.L1_KEYS_EVICTED:
            self.evicted.append(dict(options["salt_counts"]))
        return True


@pytest.fixture
def l1():
    """An 8 MiB L1 of 1 MiB slabs; the default (native) object is 64 KiB."""
    return L1Manager(np.zeros(8 * MIB, dtype=np.uint8), _Recorder(), 1.0, 64 * KIB, slab_bytes=MIB, policy="lru")


def _store(l1: L1Manager, model: str, hashes: list[int], size: int) -> list[int]:
    reservation = l1.reserve_write(model, "", hashes, nbytes=size)
    for position, offset in zip(reservation.positions, reservation.offsets):
        l1.pool[offset : offset + size] = hashes[position] % 251
    l1.commit_write(model, "", [hashes[p] for p in reservation.positions], size)
    return reservation.offsets


def test_objects_of_three_sizes_keep_their_offsets_and_bytes_while_they_live(l1):
    """Objects of 64 KiB, 700 KiB and 3 MiB stored side by side get disjoint ranges; each one's offset and
    bytes stay as written while other objects come and go around it."""
    sizes = {"small": 64 * KIB, "mid": 700 * KIB, "large": 3 * MIB}
    placed = {}
    for model, size in sizes.items():
        placed[model] = dict(zip([1, 2], _store(l1, model, [1, 2] if model != "large" else [1], size)))
    ranges = sorted((off, off + sizes[m]) for m in placed for off in placed[m].values())
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))
    _store(l1, "small", list(range(10, 40)), 64 * KIB)  # more objects around them
    for model, objects in placed.items():
        for chunk_hash, offset in objects.items():
            assert [(offset, sizes[model])] == l1.read(model, "", [chunk_hash])
            assert np.all(l1.pool[offset : offset + sizes[model]] == chunk_hash % 251)
    assert l1.used_bytes == sum(len(o) * sizes[m] for m, o in placed.items()) + 30 * 64 * KIB


def test_a_full_l1_evicts_in_lru_order_across_sizes_until_the_new_object_fits(l1):
    """With L1 full of 1 MiB objects, a 3 MiB object evicts the least recently used objects, oldest
    first and whatever their model, until a 3-slab run is free: exactly the 3 oldest here."""
    _store(l1, "a", list(range(8)), MIB)
    assert 1 == l1.lock_prefix("a", "", [0])
    l1.finish_read("a", "", [0])  # chunk 0 read: now the most recently used
    offset = _store(l1, "b", [100], 3 * MIB)
    assert [{("", "a"): 3}] == l1._pub.evicted
    assert [True, False, False, False, True] == [l1.contains(ChunkKey("a", "", h)) for h in (0, 1, 2, 3, 4)]
    assert [MIB] == offset  # slabs 1..3, freed by chunks 1..3
    assert (8 * MIB, 0) == (l1.used_bytes, l1.fragmentation_bytes)


def test_a_new_size_class_takes_slabs_from_the_lru_of_other_classes(l1):
    """A model whose size has no slab yet gets one by evicting other models' LRU objects until a slab
    empties; the objects evicted are the oldest ones, and no more than that slab held."""
    _store(l1, "a", list(range(128)), 64 * KIB)  # 16 per slab: all 8 slabs
    assert 128 * 64 * KIB == l1.used_bytes
    _store(l1, "b", [7], 100 * KIB)
    assert [{("", "a"): 16}] == l1._pub.evicted  # slab 0's sixteen, the oldest
    assert not any(l1.contains(ChunkKey("a", "", h)) for h in range(16))
    assert all(l1.contains(ChunkKey("a", "", h)) for h in range(16, 128))
    assert MIB - 100 * KIB == l1.fragmentation_bytes


def test_locked_objects_are_never_evicted_and_the_store_fails_when_nothing_else_can_go(l1):
    """Read-locked and still-being-written objects stay; a 2 MiB store that cannot get a 2-slab run
    after evicting everything evictable fails (L1_ALLOCATION_FAILED) and the locked objects keep their bytes."""
    _store(l1, "a", list(range(8)), MIB)
    assert 4 == l1.lock_prefix("a", "", [0, 2, 4, 6])  # every other slab locked: no two adjacent free
    reservation = l1.reserve_write("b", "", [1], nbytes=2 * MIB)
    assert ([], 1) == (reservation.positions, reservation.failed)
    assert all(l1.contains(ChunkKey("a", "", h)) for h in (0, 2, 4, 6))
    assert all(np.all(l1.pool[h * MIB : (h + 1) * MIB] == h % 251) for h in (0, 2, 4, 6))


def test_a_store_evicts_only_what_it_needs_and_the_tick_counts_bytes(l1):
    """usage is bytes held by objects over L1's bytes: at 7 of 8 MiB the tick evicts nothing (reporting 7/8);
    a 2 MiB object then evicts the least recently used 2 MiB object and nothing else."""
    _store(l1, "big", [1, 2, 3], 2 * MIB)
    _store(l1, "small", list(range(16)), 64 * KIB)
    assert (7 * MIB / (8 * MIB), False) == l1.evict_tick()
    _store(l1, "big", [4], 2 * MIB)
    assert [{("", "big"): 1}] == l1._pub.evicted
    assert [False, True, True, True] == [l1.contains(ChunkKey("big", "", h)) for h in (1, 2, 3, 4)]
    assert (7 * MIB, True) == (l1.used_bytes, l1.evict_tick()[1])


def test_a_new_size_gets_a_slab_by_compaction_not_eviction_when_its_space_is_stranded(l1):
    """Every slab of a class half used (its free spots worth four slabs): a new size used to evict the
    oldest objects in LRU order until one slab emptied (8 objects lost for one 100 KiB object).  Now the
    allocator compacts: the emptiest slab whose objects are all unlocked is vacated into the class's free
    spots, each moved object keeps its bytes and is read at its new offset; a read-locked object is never
    moved (its slab is passed over).  Nothing is evicted."""
    reservation = l1.reserve_write("a", "", list(range(128)), nbytes=64 * KIB)  # 16 per slab: all 8 slabs
    for chunk_hash, offset in zip(range(128), reservation.offsets):
        l1.pool[offset : offset + 64 * KIB] = chunk_hash % 251
    l1.commit_write("a", "", list(range(0, 128, 2)), 64 * KIB)
    l1.abort_write("a", "", list(range(1, 128, 2)))  # half of every slab free
    assert 1 == l1.lock_prefix("a", "", [0])  # slab 0 holds a reader
    locked_at = l1.read("a", "", [0])
    _store(l1, "b", [7], 100 * KIB)
    assert ([], locked_at) == (l1._pub.evicted, l1.read("a", "", [0]))
    placed = {h: l1.read("a", "", [h])[0][0] for h in range(0, 128, 2)}
    assert all(np.all(l1.pool[offset : offset + 64 * KIB] == h % 251) for h, offset in placed.items())
    assert 8 == sum(1 for h, offset in placed.items() if offset != h * 64 * KIB)  # slab 1's eight moved
    assert ((7, 64), 8 * 64 * KIB) == (l1.allocator.classes()[64 * KIB], l1.allocator.moved_bytes)


def test_lose_all_drops_every_readable_object_and_a_locked_one_when_its_reader_lets_go(l1):
    """After the pool's bytes were lost (a peer truncated it): unlocked objects are evicted at once, a
    read-locked one is unreadable at once and evicted when its reader lets go (so storing it again is not
    skipped as present), and space being written keeps its reservation for its writer's commit."""
    _store(l1, "a", [1, 2, 3], 64 * KIB)
    assert 1 == l1.lock_prefix("a", "", [3])
    writing = l1.reserve_write("a", "", [4], nbytes=64 * KIB)
    assert 3 == l1.lose_all()
    assert ([], 0) == (l1.read("a", "", [3]), l1.lock_prefix("a", "", [1, 2, 3]))
    l1.release_read("a", "", [3])
    l1.commit_write("a", "", [4], 64 * KIB)
    assert ([{("", "a"): 2}, {("", "a"): 1}], [False, False, False, True], 1) == (
        l1._pub.evicted, [l1.contains(ChunkKey("a", "", h)) for h in (1, 2, 3, 4)], len(writing.positions))
    assert [0] == l1.reserve_write("a", "", [3], nbytes=64 * KIB).positions  # stored again, not skipped
