"""An approximate radix tree of prompt characters, bounded in size with LRU leaf eviction.

One tree per engine remembers the prompts routed to it, as an estimate of
what that engine's prefix cache holds (no tokenizer needed: characters stand
in for tokens, as in the Rust routers' approximate trees). ``match`` tells
how many leading characters of a prompt the tree already has; ``insert``
records a prompt and, when the tree holds more than ``max_chars`` characters,
evicts least recently used leaves until it is back under 90% of that.
"""

from __future__ import annotations

import heapq

__all__ = ["PrefixTree"]


class _Node:
    __slots__ = ("label", "parent", "children", "last")

    def __init__(self, label: str, parent: "_Node | None", last: int) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.last = last


def _common_prefix(label: str, text: str, start: int) -> int:
    """Length of the common prefix of ``label`` and ``text[start:]`` (binary search on C-level startswith)."""
    lo, hi = 0, min(len(label), len(text) - start)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(label[:mid], start):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """Owns one engine's remembered prompt prefixes; ``size`` is the characters stored."""

    def __init__(self, max_chars: int) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars: must be >= 1, got {max_chars!r}")
        self.max_chars = max_chars
        self.size = 0
        self.nodes = 1
        self._clock = 0
        self._root = _Node("", None, 0)

    def match(self, text: str) -> int:
        """How many leading characters of ``text`` the tree holds (read-only)."""
        node, i, n = self._root, 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                break
            label = child.label
            if text.startswith(label, i):
                i += len(label)
                node = child
                continue
            return i + _common_prefix(label, text, i)
        return i

    def insert(self, text: str) -> None:
        """Remember ``text`` (refreshing the recency of its whole path); evict if over budget."""
        self._clock += 1
        now = self._clock
        node, i, n = self._root, 0, len(text)
        node.last = now
        while i < n:
            first = text[i]
            child = node.children.get(first)
            if child is None:
                node.children[first] = _Node(text[i:], node, now)
                self.size += n - i
                self.nodes += 1
                break
            label = child.label
            if text.startswith(label, i):
                child.last = now
                i += len(label)
                node = child
                continue
            k = _common_prefix(label, text, i)  # 0 < k < len(label)
            middle = _Node(label[:k], node, now)
            node.children[first] = middle
            child.label = label[k:]
            child.parent = middle
            middle.children[child.label[0]] = child
            self.nodes += 1
            if i + k < n:
                middle.children[text[i + k]] = _Node(text[i + k:], middle, now)
                self.size += n - i - k
                self.nodes += 1
            break
        if self.size > self.max_chars:
            self._evict(int(self.max_chars * 0.9))

    def _evict(self, target: int) -> None:
        heap: list[tuple[int, int, _Node]] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                heap.append((node.last, id(node), node))
        heapq.heapify(heap)
        while heap and self.size > target:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.label[0]]
            self.size -= len(leaf.label)
            self.nodes -= 1
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last, id(parent), parent))
