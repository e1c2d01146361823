"""The prefix-aware order's links from an object to the objects stored right after it (its children): an only child
is its key, more are a dict's keys in the stores' order (no dict allocated for a chain's every link)."""

from __future__ import annotations

from typing import Any


def add_child(parent: Any, key: Any) -> None:
    """``key`` is ``parent``'s child too."""
    children = parent.children
    if children is None:
        parent.children = key
    elif type(children) is dict:
        children[key] = None
    elif children != key:
        parent.children = {children: None, key: None}


def drop_child(parent: Any, key: Any) -> None:
    """``key`` is no longer ``parent``'s child."""
    children = parent.children
    if type(children) is dict:
        children.pop(key, None)
    elif children == key:
        parent.children = None
