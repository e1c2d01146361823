"""The ``adaptive`` order's frequency gate: the record of its decisions to refuse a store that was asked for less
often lately than what it would evict, each settled by what is asked for first (one of the objects it would evict:
the gate was right; the store's first new key: it was wrong), and the score those settle, which says whether the
gate refuses.  Where what is asked for often stays asked for (a popular document), it keeps that from what is asked
for once or twice; where recency rules (an agent's growing context), the store comes back first and the gate stays
off.  The state is bounded: the newest :data:`GATE_DECISIONS` decisions, with the keys that settle them (at most
:data:`GATE_PROTECTED_KEYS` they would evict and :data:`GATE_DECISIONS` stores' first keys, each naming at most
:data:`GATE_KEY_DECISIONS` decisions).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

GATE_DECISIONS = 256  # the newest frequency-gate decisions awaiting evidence
GATE_PROTECTED_KEYS = 64 * GATE_DECISIONS  # the newest keys those decisions would have evicted
GATE_LIMIT = 16  # the gate's score is held within ±this: it turns within that many settled decisions
GATE_KEY_DECISIONS = 2 * GATE_LIMIT  # open decisions one key settles at most: enough to move the score end to end


class FrequencyGate:
    """Decisions awaiting evidence (``open``: decision → None, oldest first), the keys each would evict
    (``protected``) and each store's first new key (``contested``), each → the decisions it settles; ``score``, on
    at 0 and above (it starts at -1)."""

    def __init__(self) -> None:
        self.open: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[Any, list[int]] = OrderedDict()
        self.contested: OrderedDict[Any, list[int]] = OrderedDict()
        self.decisions = 0
        self.score = -1

    def decide(self, fresh: Sequence[Any], victims: Iterable[Any]) -> bool:
        """A store whose new keys are ``fresh`` would evict ``victims`` (those its room needs): the decision is
        recorded, and the store refused while the score is 0 or more."""
        self.decisions += 1
        decision, protected, contested = self.decisions, self.protected, self.contested
        self.open[decision] = None
        for victim in victims:
            self._note(protected, victim, decision)
        self._note(contested, fresh[0], decision)
        for pending, bound in ((self.open, GATE_DECISIONS), (protected, GATE_PROTECTED_KEYS),
                               (contested, GATE_DECISIONS)):
            while len(pending) > bound:
                pending.popitem(False)
        return self.score >= 0

    def asked(self, key: Any) -> None:
        """``key`` was asked for: the open decisions it settles move the score (+1 where it would have been evicted,
        -1 where it is a refused store's)."""
        pending = self.open
        for evidence, step in ((self.protected, 1), (self.contested, -1)):
            for decision in evidence.pop(key, ()):
                if decision in pending:
                    del pending[decision]
                    self.score = max(-GATE_LIMIT, min(self.score + step, GATE_LIMIT))

    def _note(self, evidence: OrderedDict[Any, list[int]], key: Any, decision: int) -> None:
        """``key``'s being asked for settles ``decision`` too, and the newest others it names that are still open
        (at most :data:`GATE_KEY_DECISIONS` in all; the key noted most recently kept longest)."""
        pending = self.open
        decisions = [earlier for earlier in evidence.pop(key, ()) if earlier in pending][1 - GATE_KEY_DECISIONS:]
        decisions.append(decision)
        evidence[key] = decisions


def would_evict(lists: Sequence[OrderedDict[Any, Any]], sizes: Sequence[float], target: float, room: float,
                most: int) -> list[Any]:
    """The objects a store needing ``room`` bytes beyond the orphans would evict from ARC's ``lists`` (T1, T2 of
    ``sizes``, T1's ``target``), in the order's turn (T1's least recently used while T1 holds more than its target,
    then T2's, then the rest of T1's): at least one, at most ``most`` (one per new key)."""
    t1, t2 = lists[0], lists[1]
    over, first = sizes[0] - target, 0  # T1 gives its oldest first while it holds more than its target
    for entry in itertools.islice(t1.values(), most):
        if over <= 0:
            break
        over, first = over - entry.size, first + 1
    named: list[Any] = []
    for key, entry in itertools.chain(itertools.islice(t1.items(), first), t2.items(),
                                      itertools.islice(t1.items(), first, None)):
        if named and (room <= 0 or len(named) == most):
            break
        named.append(key)
        room -= entry.size
    return named
