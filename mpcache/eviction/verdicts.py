"""Named stores' verdicts for the ``adaptive`` order (:mod:`~mpcache.eviction.order`): the parts of one named store
(a request's TP ranks, each storing its own objects of the same chunks; a hybrid model's KV cache groups) are
admitted or refused alike, as a rank's objects are of no use without the others'.  The first part judged or placing
an object gives the name its verdict; a part stored again (a retry: its first key hashes as a part's the name
already had) is judged afresh and gives the name its new verdict, which the retry's later parts take.  The newest
:data:`STORE_VERDICTS` names are kept, each as one tuple: the flag, then the numbers of its newest
:data:`STORE_PARTS` parts (the hashes of their first keys: an older part stored again takes the name's verdict, as a
new part does; the cyclic collector stops tracking a tuple of numbers from the first collection it survives, where a
set of keys kept for as long as the verdict is would be walked by every full collection).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

STORE_VERDICTS = 1024  # named stores whose verdict a later part keeps; a request's ranks store within an engine step
STORE_PARTS = 256  # parts kept per name, the newest: TP ranks times KV cache groups (TP 16 of a model of 16)


class StoreVerdicts:
    """Named stores, newest last → (admitted, then each of their parts' numbers) (``verdicts``)."""

    def __init__(self) -> None:
        self.verdicts: OrderedDict[Hashable, tuple[bool | int, ...]] = OrderedDict()

    def of(self, name: Hashable, storing: Sequence[Hashable]) -> bool | None:
        """The verdict a part storing ``storing`` takes from its ``name``; None: not judged yet, or a part stored
        again, which is judged afresh."""
        held = self.verdicts.get(name)
        return None if held is None or hash(storing[0]) in held[1:] else held[0] is True

    def record(self, name: Hashable, storing: Sequence[Hashable], admitted: bool) -> None:
        """A part storing ``storing`` was judged, or placed an object, and ``admitted`` (or not)."""
        verdicts, part = self.verdicts, hash(storing[0])
        held = verdicts.get(name)
        if held is None or part in held[1:]:  # new, or a part stored again (a retry): its verdict the name's
            verdicts[name] = (admitted, part)  # (a name already kept keeps its place)
            if len(verdicts) > STORE_VERDICTS:
                verdicts.popitem(False)
        elif len(held) <= STORE_PARTS:
            verdicts[name] = held + (part,)
        else:  # the oldest part forgotten: a client's one name with ever new parts keeps as many as any name
            verdicts[name] = held[:1] + held[2:] + (part,)
