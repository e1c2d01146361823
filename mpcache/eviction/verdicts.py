"""Named stores' verdicts for the ``adaptive`` order (:mod:`~mpcache.eviction.order`): the parts of one named store
(a request's TP ranks, each storing its own objects of the same chunks; a hybrid model's KV cache groups) are
admitted or refused alike, as a rank's objects are of no use without the others'.  The first part judged or placing
an object gives the name its verdict; a part stored again (a retry: its first key hashes as a part's the name
already had) is judged afresh and gives the name its new verdict, which the retry's later parts take.  The newest
:data:`STORE_VERDICTS` names are kept, each as a flag and a dict of its parts' numbers (the hashes of their first
keys: the cyclic collector does not track a dict of numbers, where a set of keys kept for as long as the verdict is
would be walked by every full collection).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

STORE_VERDICTS = 1024  # named stores whose verdict a later part keeps; a request's ranks store within an engine step


class StoreVerdicts:
    """Named stores → admitted (``verdicts``, newest last) and each one's parts (``parts``)."""

    def __init__(self) -> None:
        self.verdicts: OrderedDict[Hashable, bool] = OrderedDict()
        self.parts: dict[Hashable, dict[int, None]] = {}

    def of(self, name: Hashable, storing: Sequence[Hashable]) -> bool | None:
        """The verdict a part storing ``storing`` takes from its ``name``; None: not judged yet, or a part stored
        again, which is judged afresh."""
        parts = self.parts.get(name)
        return None if parts is None or hash(storing[0]) in parts else self.verdicts[name]

    def record(self, name: Hashable, storing: Sequence[Hashable], admitted: bool) -> None:
        """A part storing ``storing`` was judged, or placed an object, and ``admitted`` (or not)."""
        verdicts, part = self.verdicts, hash(storing[0])
        parts = self.parts.get(name)
        if parts is None:
            verdicts[name] = admitted
            self.parts[name] = {part: None}
            if len(verdicts) > STORE_VERDICTS:
                del self.parts[verdicts.popitem(False)[0]]
            return
        if part in parts:  # a part stored again (a retry): the name takes its verdict, its later parts too
            verdicts[name] = admitted
            parts = self.parts[name] = {}
        parts[part] = None
