"""numba kernels of the packing engine: flat integer arrays in, flat integer arrays out.

Every placement kernel has the same contract, so that strategies differ only in the kernel they call:

- the item lengths in the order the items are offered (the strategy decides the order, e.g. decreasing), each in
  ``[1, capacity]`` (the caller has applied the overlong policy): ``ordered: (n,)``, or for best fit runs of equal
  lengths. Gathering the lengths once, in order, keeps the placement loop free of random reads.
- ``capacity`` — tokens per bin; ``max_items`` — items per bin (``n`` or more means unlimited).
- returns ``bin_of: (n,)`` with ``bin_of[k]`` the bin that received the k-th offered item, and the number of
  bins. Bins are numbered in the order they were opened.

No Python objects cross into a kernel, and nothing here is O(tokens): the engine only sees lengths.
Kernels are compiled lazily on first use and cached on disk (``cache=True``), so a second process loads
machine code instead of recompiling.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.cpython.unsafe.numbers import trailing_zeros

# --------------------------------------------------------------------------------------------------
# Orders
# --------------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def counting_sort_decreasing(lengths, capacity):  # pragma: no cover - compiled
    """Stable sort of ``lengths`` (values in [1, capacity]) in decreasing order, by counting: O(n + capacity).

    Returns ``perm: (n,) int32`` (item ids, longest first, ties in input order) and the sorted lengths as runs:
    ``values: (m,) int64`` (distinct lengths, decreasing) and ``runs: (m,) int64`` (how many items have each).
    Runs save writing and re-reading an n-long array of sorted lengths: equal lengths are interchangeable for
    every placement decision.
    """
    n = lengths.shape[0]
    start = np.zeros(capacity + 2, np.int64)
    for i in range(n):
        # bucket index capacity - L makes the ascending bucket walk a descending length walk
        start[capacity - lengths[i] + 1] += 1
    distinct = 0
    for v in range(1, capacity + 2):
        if start[v] > 0:
            distinct += 1
        start[v] += start[v - 1]
    values = np.empty(distinct, np.int64)
    runs = np.empty(distinct, np.int64)
    j = 0
    for slot in range(capacity):
        size = start[slot + 1] - start[slot]
        if size > 0:
            values[j] = capacity - slot
            runs[j] = size
            j += 1
    # int32 scratch (n < 2**31 items): half the memory traffic of int64 on the hot path
    perm = np.empty(n, np.int32)
    for i in range(n):
        slot = capacity - lengths[i]
        perm[start[slot]] = i
        start[slot] += 1
    return perm, values, runs


@njit(cache=True, nogil=True)
def group_by_bin(proc, bin_of, num_bins):  # pragma: no cover - compiled
    """CSR layout of an assignment: items bin after bin, each bin in placement order. O(n + num_bins).

    Returns ``order: (n,) int64`` (item ids) and ``offsets: (num_bins + 1,) int64``.
    """
    n = proc.shape[0]
    offsets = np.zeros(num_bins + 1, np.int64)
    for k in range(n):
        offsets[bin_of[k] + 1] += 1
    for b in range(num_bins):
        offsets[b + 1] += offsets[b]
    cursor = offsets[:-1].copy()
    order = np.empty(n, np.int64)
    for k in range(n):
        b = bin_of[k]
        order[cursor[b]] = proc[k]
        cursor[b] += 1
    return order, offsets


# --------------------------------------------------------------------------------------------------
# Next fit and harmonic-k: one open bin per class, O(n)
# --------------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def next_fit_by_class(ordered, capacity, max_items, num_classes):  # pragma: no cover - compiled
    """Next fit inside each size class; ``num_classes == 1`` is plain next fit.

    With ``num_classes = k`` an item of length L belongs to class ``min(capacity // L, k)``: classes
    ``j < k`` hold items in ``(C/(j+1), C/j]`` — exactly ``j`` of them fit in a bin — and class ``k``
    holds every item of at most ``C/k`` (harmonic-k, Lee & Lee 1985).
    """
    n = ordered.shape[0]
    bin_of = np.empty(n, np.int64)
    open_bin = np.full(num_classes + 1, -1, np.int64)
    room = np.zeros(num_classes + 1, np.int64)
    count = np.zeros(num_classes + 1, np.int64)
    num_bins = 0
    for k in range(n):
        length = ordered[k]
        cls = 1
        if num_classes > 1:
            cls = min(capacity // length, num_classes)
        if open_bin[cls] < 0 or room[cls] < length or count[cls] >= max_items:
            open_bin[cls] = num_bins
            num_bins += 1
            room[cls] = capacity
            count[cls] = 0
        bin_of[k] = open_bin[cls]
        room[cls] -= length
        count[cls] += 1
    return bin_of, num_bins


# --------------------------------------------------------------------------------------------------
# First fit and worst fit: a max segment tree over bins, O(n log n)
# --------------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def tree_fit(ordered, capacity, max_items, worst):  # pragma: no cover - compiled
    """First fit (``worst=False``) or worst fit (``worst=True``), ties to the lowest bin index.

    Leaves hold each bin's remaining space (-1 once a bin is closed by ``max_items``); inner nodes hold the
    maximum of their children. First fit descends to the leftmost leaf with room >= L. For first fit the
    unopened leaves hold ``capacity``, so the leftmost fitting leaf is either an open bin or the next bin to
    open; for worst fit they hold -1 and the root tells whether any open bin can take the item.
    """
    n = ordered.shape[0]
    bin_of = np.empty(n, np.int64)
    # any-fit algorithms never leave two bins at most half full, so bins <= 2 * ceil(total / C) + 1 unless
    # max_items closes bins early; a smaller tree keeps its hot top levels in cache
    bound = n
    if max_items > n:
        bound = min(n, 2 * ((ordered.sum() + capacity - 1) // capacity) + 1)
    size = 1
    while size < max(bound, 1):
        size *= 2
    tree = np.full(2 * size, -1 if worst else capacity, np.int64)
    count = np.zeros(size, np.int64)
    num_bins = 0
    for k in range(n):
        length = ordered[k]
        target = length
        if worst:
            # the leftmost bin with the most room, or -2: no open bin fits, open the next one
            target = tree[1] if tree[1] >= length else -2
        if target == -2:
            node = size + num_bins
            tree[node] = capacity
        else:
            node = 1
            while node < size:
                node *= 2
                if tree[node] < target:
                    node += 1
        b = node - size
        if b >= num_bins:
            num_bins = b + 1
        bin_of[k] = b
        count[b] += 1
        tree[node] -= length
        if count[b] >= max_items:
            tree[node] = -1
        node //= 2
        while node >= 1:
            left = tree[2 * node]
            right = tree[2 * node + 1]
            best = left if left >= right else right
            if tree[node] == best:
                break  # the maximum did not change here, so it changes nowhere above
            tree[node] = best
            node //= 2
    return bin_of, num_bins


# --------------------------------------------------------------------------------------------------
# Best fit: buckets of bins keyed by remaining space + a two-level bitmap over the buckets
# --------------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _next_set_bit(words, summary, x):  # pragma: no cover - compiled
    """Smallest set bit >= x in the bitmap ``words`` (with ``summary`` marking non-zero words), or -1."""
    w = x >> 6
    if w >= words.shape[0]:
        return -1
    masked = words[w] & (np.uint64(0xFFFFFFFFFFFFFFFF) << np.uint64(x & 63))
    if masked != 0:
        return (w << 6) + np.int64(trailing_zeros(masked))
    w += 1
    s = w >> 6
    if s >= summary.shape[0]:
        return -1
    masked = summary[s] & (np.uint64(0xFFFFFFFFFFFFFFFF) << np.uint64(w & 63))
    while masked == 0:
        s += 1
        if s >= summary.shape[0]:
            return -1
        masked = summary[s]
    w = (s << 6) + np.int64(trailing_zeros(masked))
    return (w << 6) + np.int64(trailing_zeros(words[w]))


@njit(cache=True, nogil=True, inline="always")
def _set_bit(words, summary, r):  # pragma: no cover - compiled
    w = r >> 6
    words[w] |= np.uint64(1) << np.uint64(r & 63)
    summary[w >> 6] |= np.uint64(1) << np.uint64(w & 63)


@njit(cache=True, nogil=True, inline="always")
def _clear_bit(words, summary, r):  # pragma: no cover - compiled
    w = r >> 6
    words[w] &= ~(np.uint64(1) << np.uint64(r & 63))
    if words[w] == 0:
        summary[w >> 6] &= ~(np.uint64(1) << np.uint64(w & 63))


@njit(cache=True, nogil=True, inline="always")
def _skew_merge(a, b, left, right):  # pragma: no cover - compiled
    """Top-down skew-heap merge of the heaps rooted at bins ``a`` and ``b`` (min-heap on bin index)."""
    if a < 0:
        return b
    if b < 0:
        return a
    if b < a:
        a, b = b, a
    root = a
    parent = a
    while True:
        # skew heaps merge into the right spine and then swap children: the merged result becomes the left child
        x = right[parent]
        right[parent] = left[parent]
        if x < 0:
            left[parent] = b
            return root
        if b < x:
            x, b = b, x
        left[parent] = x
        parent = x


@njit(cache=True, nogil=True)
def best_fit(values, runs, capacity, max_items, lowest_index):  # pragma: no cover - compiled
    """Best fit: each item goes to the open bin with the least remaining space that still holds it.

    Items are offered as runs: ``runs[j]`` items of length ``values[j]``, run after run; an empty ``runs`` means
    one item per value (the online order). Returns ``bin_of: (n,) int32`` and the number of bins.

    Open bins live in buckets indexed by their remaining space ``r`` in ``[1, capacity]``; a two-level bitmap
    over the buckets finds the smallest non-empty ``r >= L`` in O(log_64 capacity). Bins with the same ``r``
    are interchangeable for every later decision, so the tie-break inside a bucket cannot change the number of
    bins or their fills:

    - ``lowest_index=True``: each bucket is a skew heap on bin index, so ties go to the lowest-numbered bin,
      exactly as the textbook algorithm states it (O(log n) amortised per item).
    - ``lowest_index=False``: each bucket is a stack (O(1) per item); same bins count, same multiset of fills.
    """
    one_each = runs.shape[0] == 0
    n = values.shape[0] if one_each else runs.sum()
    bin_of = np.empty(n, np.int32)
    limited = max_items <= n
    # per-bin state is the hot random access: int32 halves its cache footprint, and a bin's room is never
    # stored — it is the index of the bucket the bin sits in
    head = np.full(capacity + 1, -1, np.int32)
    # a bin's links are written when it enters a bucket, before any read: np.empty leaves the pages of bins that
    # are never opened untouched
    link = np.empty(max(n, 1), np.int32)  # stack: next bin in the bucket; heap: left child
    right = np.empty(max(n, 1) if lowest_index else 1, np.int32)  # heap: right child
    count = np.zeros(max(n, 1) if limited else 1, np.int32)
    num_words = (capacity + 1 + 63) // 64
    words = np.zeros(num_words, np.uint64)
    summary = np.zeros((num_words + 63) // 64, np.uint64)
    num_bins = 0
    k = 0
    for j in range(values.shape[0]):
        length = values[j]
        for _ in range(1 if one_each else runs[j]):
            r = _next_set_bit(words, summary, length)
            if r < 0:
                b = num_bins
                num_bins += 1
                room = capacity - length
            else:
                b = head[r]
                if lowest_index:
                    head[r] = _skew_merge(link[b], right[b], link, right)
                else:
                    head[r] = link[b]
                if head[r] < 0:
                    _clear_bit(words, summary, r)
                room = r - length
            bin_of[k] = b
            k += 1
            if limited:
                count[b] += 1
                if count[b] >= max_items:
                    continue
            if room > 0:
                if lowest_index:
                    link[b] = -1
                    right[b] = -1
                    head[room] = _skew_merge(head[room], b, link, right)
                else:
                    link[b] = head[room]
                    head[room] = b
                _set_bit(words, summary, room)
    return bin_of, num_bins


# --------------------------------------------------------------------------------------------------
# Modified first fit decreasing: the large items' bins filled in four phases, O(n log n)
# --------------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _find(parent, i):  # pragma: no cover - compiled
    """Root of ``i`` in a union-find forest, halving the path on the way (amortised near O(1))."""
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


@njit(cache=True, nogil=True, inline="always")
def _first_at_most(ordered, lo, hi, limit):  # pragma: no cover - compiled
    """First position in ``[lo, hi)`` of the non-increasing ``ordered`` whose value is ``<= limit`` (``hi``: none)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if ordered[mid] <= limit:
            hi = mid
        else:
            lo = mid + 1
    return lo


@njit(cache=True, nogil=True)
def mffd_large_bins(ordered, capacity, max_items):  # pragma: no cover - compiled
    """Phases 1-4 of modified first fit decreasing (Johnson & Garey 1985) over ``ordered: (n,)``, non-increasing.

    Classes: large ``L > C/2``, medium ``C/3 < L <= C/2``, small ``C/6 < L <= C/3``, tiny the rest; each is a
    contiguous range of ``ordered``. (1) each large item opens a bin, largest first; (2) forward through those
    bins, each takes the largest remaining medium item that fits; (3) backward through the bins without a medium
    item, where the two smallest remaining small items fit together: the smallest, then the largest remaining
    small item that fits; (4) forward through the bins, each takes the largest remaining item that fits until
    none does. Phase 5 (first fit decreasing of the rest into new bins) is the caller's ``tree_fit``.

    Returns ``bin_of: (n,) int64`` (-1 for items left to phase 5) and the number of large bins. Removed items
    are skipped with two union-find arrays, so "the largest remaining item <= room" is a binary search plus a
    near-O(1) find, and "the smallest remaining" a find backwards.
    """
    n = ordered.shape[0]
    bin_of = np.full(n, -1, np.int64)
    a = _first_at_most(ordered, 0, n, capacity // 2)
    b = _first_at_most(ordered, a, n, capacity // 3)
    c = _first_at_most(ordered, b, n, capacity // 6)
    room = np.empty(a, np.int64)
    count = np.ones(a, np.int64)
    medium = np.zeros(a, np.bool_)
    for i in range(a):
        bin_of[i] = i
        room[i] = capacity - ordered[i]
    after = np.arange(n + 1)  # _find(after, p): first remaining position >= p (n: none)
    before = np.arange(n + 1)  # _find(before, p + 1) - 1: last remaining position <= p (-1: none)
    for i in range(a):  # phase 2
        if count[i] >= max_items:
            continue
        k = _find(after, _first_at_most(ordered, a, b, room[i]))
        if k < b:
            bin_of[k] = i
            room[i] -= ordered[k]
            count[i] += 1
            medium[i] = True
            after[k] = k + 1
            before[k + 1] = k
    for i in range(a - 1, -1, -1):  # phase 3
        if medium[i] or count[i] + 2 > max_items:
            continue
        s1 = _find(before, c) - 1
        if s1 < b:
            continue
        s2 = _find(before, s1) - 1
        if s2 < b or ordered[s1] + ordered[s2] > room[i]:
            continue
        for step in range(2):
            k = s1 if step == 0 else _find(after, _first_at_most(ordered, b, c, room[i]))
            bin_of[k] = i
            room[i] -= ordered[k]
            count[i] += 1
            after[k] = k + 1
            before[k + 1] = k
    for i in range(a):  # phase 4
        while count[i] < max_items:
            k = _find(after, _first_at_most(ordered, a, n, room[i]))
            if k >= n:
                break
            bin_of[k] = i
            room[i] -= ordered[k]
            count[i] += 1
            after[k] = k + 1
            before[k + 1] = k
    return bin_of, a


# --------------------------------------------------------------------------------------------------
# Parallel best fit decreasing: interleaved shards packed at once
# --------------------------------------------------------------------------------------------------


@njit(cache=True, parallel=True)
def sharded_best_fit(values, runs, capacity, max_items, shards, lowest_index):  # pragma: no cover - compiled
    """Best fit decreasing on ``shards`` interleaved shards at once (numba ``prange``, one shard per task), the
    bins numbered globally and the ones to repack picked out.

    The decreasing order is dealt round-robin: shard ``j`` takes the items at positions ``j, j + shards, ...``,
    so every shard sees the same length distribution and is itself in decreasing order (as runs, like
    :func:`best_fit`). A bin with room for the smallest item (``values[-1]``) is to be repacked. Returns
    ``bin_of: (n,) int64`` (each item's bin by position in the decreasing order, -1 for the items to repack) and
    the number of bins kept. The shards are independent, so the result does not depend on the number of threads.
    """
    m = values.shape[0]
    first = np.zeros(m + 1, np.int64)
    for r in range(m):
        first[r + 1] = first[r] + runs[r]
    n = first[m]
    smallest = values[m - 1]
    # shard j holds ceil((n - j) / shards) items: its slice of the shard-major scratch array
    start = np.zeros(shards + 1, np.int64)
    for j in range(shards):
        start[j + 1] = start[j] + (n - j + shards - 1) // shards
    local = np.empty(n, np.int64)  # shard-major: each item's bin among the kept bins of its shard, -1: repack
    kept = np.zeros(shards + 1, np.int64)
    bin_of = np.empty(n, np.int64)
    for j in prange(shards):
        mine = np.empty(m, np.int64)
        for r in range(m):
            # positions in [first[r], first[r + 1]) that are j modulo shards
            mine[r] = max(first[r + 1] - j + shards - 1, 0) // shards - max(first[r] - j + shards - 1, 0) // shards
        sub, count = best_fit(values, mine, capacity, max_items, lowest_index)
        fill = np.zeros(count, np.int64)
        t = 0
        for r in range(m):
            for _ in range(mine[r]):
                fill[sub[t]] += values[r]
                t += 1
        keep = 0
        for b in range(count):  # fill -> the bin's number among the shard's kept bins (-1: repack)
            if capacity - fill[b] >= smallest:
                fill[b] = -1
            else:
                fill[b] = keep
                keep += 1
        kept[j + 1] = keep
        for t in range(sub.shape[0]):
            local[start[j] + t] = fill[sub[t]]
    for j in range(shards):
        kept[j + 1] += kept[j]
    for j in prange(shards):
        for t in range(start[j + 1] - start[j]):
            b = local[start[j] + t]
            bin_of[j + t * shards] = -1 if b < 0 else b + kept[j]
    return bin_of, kept[shards]
