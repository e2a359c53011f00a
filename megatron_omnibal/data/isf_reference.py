"""Pure-Python reference of the C++ balancing core (csrc/isf_core.cpp), line for line.

It exists so that tests can check the fast core against code simple enough to read: same PRNG,
same shuffles, same packs for the same seed. It is slow (pure Python loops): use it on small
inputs only. Any change to the core must be mirrored here.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left

import numpy as np

MASK64 = (1 << 64) - 1
UNDER_FACTOR = 4  # light packs are repaired only this many tolerances off (heavy: one)


class SplitMix64:
    """splitmix64 (Steele, Lea, Flood 2014), the project's PRNG in both languages."""

    def __init__(self, seed: int) -> None:
        self.state = seed & MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """A value in [0, n): the high 64 bits of next() * n (Lemire's multiply)."""
        return (self.next() * n) >> 64


def shuffle(items: list, rng: SplitMix64) -> None:
    """Fisher-Yates from the back: for i = n..2, swap items[i-1] with items[below(i)]."""
    for i in range(len(items), 1, -1):
        j = rng.below(i)
        items[i - 1], items[j] = items[j], items[i - 1]


def random_u64(seed: int, count: int) -> np.ndarray:
    rng = SplitMix64(seed)
    return np.array([rng.next() for _ in range(count)], dtype=np.uint64)


def permutation(n: int, seed: int) -> np.ndarray:
    items = list(range(n))
    shuffle(items, SplitMix64(seed))
    return np.array(items, dtype=np.int64)


def _fill_in_order(ids: list[int], vit: list[int], tok: list[int], vit_budget: int,
                   token_budget: int) -> list[list[int]]:
    packs: list[list[int]] = []
    sv = st = 0
    for i in ids:
        if packs and (sv + vit[i] > vit_budget or st + tok[i] > token_budget):
            packs.append([])
            sv = st = 0
        if not packs:
            packs.append([])
        packs[-1].append(i)
        sv += vit[i]
        st += tok[i]
    return packs


def isf(vit: np.ndarray, tokens: np.ndarray, vit_budget: int, token_budget: int,
        token_threshold: int, rounds: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """OmniBal ISF: returns (samples, pack_ptr) over positions of the input arrays."""
    v, t = [int(x) for x in vit], [int(x) for x in tokens]
    out: list[list[int]] = []
    ids = list(range(len(v)))
    for r in range(rounds):
        if not ids:
            break
        shuffle(ids, SplitMix64(seed + r))
        rest: list[int] = []
        for pack in _fill_in_order(ids, v, t, vit_budget, token_budget):
            sv, st = sum(v[i] for i in pack), sum(t[i] for i in pack)
            if r == rounds - 1 or sv == vit_budget or st >= token_threshold:
                out.append(pack)
            else:
                rest.extend(pack)
        ids = rest
    return _flatten(out)


def _flatten(packs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(packs) + 1, np.int64)
    ptr[1:] = np.cumsum([len(p) for p in packs])
    flat = [i for p in packs for i in p]
    return np.array(flat, np.int64), ptr


def _rebuild_reach(count: list[int], reach: list[bool]) -> None:
    reach[0] = True
    for r in range(1, len(reach)):
        reach[r] = any(count[c] > 0 and reach[r - c] for c in range(1, r + 1))


def _add_slot(slots: list[list[int]], c: int) -> None:
    for e in slots:
        if e[0] == c:
            e[1] += 1
            return
    slots.append([c, 1])


def _tile_slots(count: list[int], fill: int, vit_budget: int, packs: int, w_tiled: int,
                w_text: int, tiles: list[int], cap: list[int]) -> list[list[list[int]]]:
    """Phase 1; `count` is left holding the samples per tile count that found no slot."""
    reach = [False] * (vit_budget + 1)
    _rebuild_reach(count, reach)
    slots: list[list[list[int]]] = [[] for _ in range(packs)]
    sum_v = sum(c * count[c] for c in range(1, vit_budget + 1)) + sum(tiles)
    total = list(count)
    placed = 0
    limit = [fill] * packs
    for p in range(packs):
        if cap[p] >= 0:
            limit[p] = cap[p]
        rest = max(0, limit[p] - tiles[p])
        while rest > 0:
            chosen, best = 0, 0
            for c in range(1, rest + 1):
                if count[c] == 0 or not reach[rest - c]:
                    continue
                lag = total[c] * placed - (total[c] - count[c]) * sum_v
                if chosen == 0 or lag > best:
                    chosen, best = c, lag
            if chosen == 0:
                break
            placed += chosen
            _add_slot(slots[p], chosen)
            tiles[p] += chosen
            rest -= chosen
            count[chosen] -= 1
            if count[chosen] == 0:
                _rebuild_reach(count, reach)
    room = [(-(limit[p] - tiles[p]), p) for p in range(packs)]  # max room, then min pack
    heapq.heapify(room)
    for c in range(vit_budget, 0, -1):
        while count[c] > 0 and -room[0][0] >= c:
            r, p = heapq.heappop(room)
            _add_slot(slots[p], c)
            tiles[p] += c
            count[c] -= 1
            heapq.heappush(room, (r + c, p))
    if count[0] > 0:
        n0 = count[0]
        low = [(tiles[p] * w_tiled * n0, p) for p in range(packs)]
        heapq.heapify(low)
        for _ in range(n0):
            need, p = heapq.heappop(low)
            _add_slot(slots[p], 0)
            heapq.heappush(low, (need + w_text * max(sum_v, 1), p))
    for s_ in slots:
        s_.sort()
    return slots


def slot_balance(vit: np.ndarray, weight: np.ndarray, tokens: np.ndarray, vit_budget: int,
                 token_budget: int, packs_in: int, grow: int, seed: int, repair_passes: int,
                 tol_div: int, window: int, partners: int, ratio_lo: int, ratio_hi: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slot balancing into `packs_in` packs (more, `grow` at a time, while tiles do not fit):
    returns (samples, pack_ptr, leftover)."""
    v, w, tok = ([int(x) for x in a] for a in (vit, weight, tokens))
    n = len(v)
    shuffled = list(range(n))
    shuffle(shuffled, SplitMix64(seed))
    sum_v, sum_w, sum_t = sum(v), sum(w), sum(tok)
    w_tiled = sum(w[i] for i in range(n) if v[i] > 0)
    w_text = sum_w - w_tiled
    count = [0] * (vit_budget + 1)
    for c in v:
        count[c] += 1
    mulv = sum_v if sum_v > 0 else 1
    packs = packs_in
    while True:
        by_tokens = token_budget * sum_v // max(sum_t, 1)
        fill = 0 if sum_v == 0 else min(vit_budget, max(max(v), min(by_tokens,
                                                                    (sum_v + packs - 1) // packs)))
        key = [packs * (w[i] * mulv - v[i] * sum_w) for i in range(n)]

        # Phase 0: heavy samples.
        heavy = []
        for r, i in enumerate(shuffled):
            c = v[i]
            if c == 0 or c > fill:
                continue
            excess = 1024 * (w[i] * sum_v - c * sum_w)
            offset = (fill - c) * (1024 * sum_w - ratio_lo * sum_v)
            if excess > offset:
                heavy.append((key[i], r, i))
        heavy.sort(key=lambda e: (-e[0], e[1]))
        heavy = heavy[:packs]
        tiles, cap = [0] * packs, [-1] * packs
        pre = [False] * n
        left = list(count)
        for k, (_, _, h) in enumerate(heavy):
            c = v[h]
            room_w = sum_w - packs * w[h]
            more = room_w * 1024 // (packs * ratio_lo) if room_w > 0 and ratio_lo > 0 else 0
            cap[k] = c + min(fill - c, more)
            tiles[k] = c
            left[c] -= 1
            pre[h] = True

        # Phase 1: tile slots.
        free = _tile_slots(left, fill, vit_budget, packs, w_tiled, w_text, tiles, cap)
        short_tiles = sum(c * left[c] for c in range(1, vit_budget + 1))
        if short_tiles == 0 or grow <= 0:
            break
        packs += grow * max(1, (short_tiles + fill * grow - 1) // (fill * grow))

    # Phase 2: samples into slots.
    unit = mulv * packs
    no_limit = (sum_w + 1) * unit
    text_max = max((w[i] for i in range(n) if v[i] == 0), default=0)
    text_slots = [sum(k for c, k in free[p] if c == 0) for p in range(packs)]
    reach_w = [no_limit if cap[p] >= 0 or sum_v == 0
               else tiles[p] * ratio_hi * unit // 1024 + text_slots[p] * text_max * unit
               for p in range(packs)]
    lo_w, hi_w = 0, sum_w
    while lo_w < hi_w:
        mid = (lo_w + hi_w) // 2
        if sum(min(mid * unit, r) for r in reach_w) >= sum_w * unit:
            hi_w = mid
        else:
            lo_w = mid + 1
    target = [min(lo_w * unit, r) for r in reach_w]
    need = [target[p] - packs * tiles[p] * sum_w for p in range(packs)]
    pack_tokens = [0] * packs
    members: list[list[int]] = [[] for _ in range(packs)]
    pack_tiles = [0] * packs
    for k, (kh, _, h) in enumerate(heavy):
        members[k].append(h)
        need[k] -= kh
        pack_tokens[k] += tok[h]
        pack_tiles[k] += v[h]

    def slot_of(p: int, c: int) -> list[int] | None:
        for e in free[p]:
            if e[0] == c:
                return e
        return None

    positive, negative = [], []
    for r, i in enumerate(shuffled):
        if not pre[i]:
            (positive if key[i] >= 0 else negative).append((key[i], r, i))
    positive.sort(key=lambda e: (-e[0], e[1]))
    negative.sort(key=lambda e: (e[0], e[1]))
    leftover: list[int] = []

    def place(items: list[tuple[int, int, int]], sign: int) -> None:
        # Heap entries (sign * need, pack): sign -1 puts the largest need on top.
        heaps: list[list[tuple[int, int]]] = [[] for _ in range(vit_budget + 1)]
        for p in range(packs):
            for c, k in free[p]:
                if k > 0:
                    heaps[c].append((sign * need[p], p))
        for hp in heaps:
            heapq.heapify(hp)
        for kv, _, i in items:
            c = v[i]
            heap = heaps[c]
            chosen = -1
            stash = []
            while heap:
                e = heapq.heappop(heap)
                p = e[1]
                slot = slot_of(p, c)
                if slot is None or slot[1] == 0:
                    continue
                if sign * e[0] != need[p]:
                    heapq.heappush(heap, (sign * need[p], p))
                    continue
                if pack_tokens[p] + tok[i] > token_budget:
                    stash.append(e)
                    continue
                chosen = p
                break
            for e in stash:
                heapq.heappush(heap, e)
            in_slot = chosen >= 0
            if not in_slot:
                for p in range(packs):
                    if pack_tiles[p] + c <= vit_budget and \
                            pack_tokens[p] + tok[i] <= token_budget and \
                            (chosen < 0 or need[p] > need[chosen]):
                        chosen = p
                if chosen < 0:
                    leftover.append(i)
                    continue
            members[chosen].append(i)
            pack_tokens[chosen] += tok[i]
            pack_tiles[chosen] += c
            need[chosen] -= kv
            if not in_slot:
                continue
            slot = slot_of(chosen, c)
            slot[1] -= 1
            if slot[1] > 0:
                heapq.heappush(heap, (sign * need[chosen], chosen))

    place(positive, -1)
    place(negative, 1)

    if repair_passes == 0:
        return _flatten(members) + (np.array(leftover, np.int64),)

    # Phase 3: repair.
    pack_of = [-1] * n
    dev = [0] * packs
    for p in range(packs):
        for i in members[p]:
            pack_of[i] = p
        dev[p] = sum(w[i] for i in members[p]) * unit - target[p]
    tol = [t // tol_div for t in target]
    by_w = sorted((i for i in range(n) if pack_of[i] >= 0), key=lambda i: (v[i], w[i], i))
    by_w_w = [w[i] for i in by_w]
    cls_start = [0] * (vit_budget + 2)
    for i in by_w:
        cls_start[v[i] + 1] += 1
    for c in range(vit_budget + 1):
        cls_start[c + 1] += cls_start[c]
    worse = lambda p: (-abs(dev[p]), p)  # noqa: E731
    def bad(p: int) -> bool:
        return dev[p] > tol[p] or dev[p] < -UNDER_FACTOR * tol[p]

    work = [p for p in range(packs) if bad(p)]
    queued = [False] * packs
    fails = [0] * packs
    for _ in range(repair_passes):
        if not work:
            break
        work.sort(key=worse)
        for p in work:
            queued[p] = False
        nxt: list[int] = []
        want_n = 2 * len(work) + partners
        over = sorted((p for p in range(packs) if dev[p] > 0), key=worse)[:want_n]
        under = sorted((p for p in range(packs) if dev[p] < 0), key=worse)[:want_n]
        at = {True: 0, False: 0}  # next partner in `under` (p over) / `over` (p under)
        for p in work:
            if not bad(p):
                continue
            best = [abs(dev[p]), -1, -1]

            def consider(x: int, y: int, p: int = p, best: list = best) -> None:
                q = pack_of[y]
                if q == p or v[x] != v[y]:
                    return
                if pack_tokens[p] - tok[x] + tok[y] > token_budget or \
                        pack_tokens[q] - tok[y] + tok[x] > token_budget:
                    return
                delta = (w[x] - w[y]) * unit
                cost = max(abs(dev[p] - delta), abs(dev[q] + delta))
                if cost < best[0]:
                    best[:] = [cost, x, y]

            for x in members[p]:
                c = v[x]
                lo, hi = cls_start[c], cls_start[c + 1]
                want = w[x] - _trunc_div(dev[p], 2 * unit)
                k = bisect_left(by_w_w, want, lo, hi)
                for step in (1, -1):
                    taken = seen = 0
                    j = k if step > 0 else k - 1
                    while lo <= j < hi and taken < window and seen < 4 * window:
                        q = pack_of[by_w[j]]
                        if not (dev[q] > tol[q] if dev[p] > 0 else dev[q] < -tol[q]):
                            consider(x, by_w[j])
                            taken += 1
                        j += step
                        seen += 1
            other = under if dev[p] > 0 else over
            side = dev[p] > 0
            t = 0
            while t < partners and at[side] < len(other):
                for x in members[p]:
                    for y in members[other[at[side]]]:
                        consider(x, y)
                t += 1
                at[side] += 1
            _, bx, by = best
            if bx < 0:
                fails[p] += 1
                if fails[p] < 8 and not queued[p]:
                    queued[p] = True
                    nxt.append(p)
                continue
            q = pack_of[by]
            delta = (w[bx] - w[by]) * unit
            dev[p] -= delta
            dev[q] += delta
            pack_tokens[p] += tok[by] - tok[bx]
            pack_tokens[q] += tok[bx] - tok[by]
            members[p][members[p].index(bx)] = by
            members[q][members[q].index(by)] = bx
            pack_of[bx], pack_of[by] = q, p
            for r in (p, q):
                if bad(r) and not queued[r]:
                    queued[r] = True
                    nxt.append(r)
        work = nxt
    return _flatten(members) + (np.array(leftover, np.int64),)


def _trunc_div(a: int, b: int) -> int:
    """Integer division rounding toward zero, as C++ does."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q
