"""Pure-Python reference of the C++ balancing core (csrc/balance_core.cpp), function by function.

It exists so that tests can check the fast core against code simple enough to read: same PRNG,
same shuffles, same phases under the same names, same packs for the same seed. It is slow (pure
Python loops): use it on small inputs only. Any change to the core must be mirrored here.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from dataclasses import dataclass, field

import numpy as np

MASK64 = (1 << 64) - 1
UNDER_FACTOR = 4  # light packs are repaired only this many tolerances off (heavy: one)


@dataclass
class IsfParams:
    """The C++ IsfParams struct."""

    vit_budget: int = 0
    token_budget: int = 1
    token_threshold: int = 0
    rounds: int = 1
    seed: int = 0


@dataclass
class SlotParams:
    """The C++ SlotParams struct."""

    vit_budget: int = 0
    token_budget: int = 1
    packs: int = 1
    grow: int = 0
    max_uncut: int = 0
    seed: int = 0
    repair_passes: int = 0
    tol_div: int = 400
    tol2_div: int = 400
    window: int = 8
    partners: int = 4
    ratio_lo: int = 0
    ratio_hi: int = 0


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


# ---------------------------------------------------------------- ISF (OmniBal, faithful)

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


def isf(vit: np.ndarray, tokens: np.ndarray, p: IsfParams) -> tuple[np.ndarray, np.ndarray]:
    """OmniBal ISF: returns (samples, pack_ptr) over positions of the input arrays."""
    if p.rounds < 1:
        raise ValueError("isf: rounds must be >= 1")
    v, t = [int(x) for x in vit], [int(x) for x in tokens]
    out: list[list[int]] = []
    ids = list(range(len(v)))
    for r in range(p.rounds):
        if not ids:
            break
        shuffle(ids, SplitMix64(p.seed + r))
        rest: list[int] = []
        for pack in _fill_in_order(ids, v, t, p.vit_budget, p.token_budget):
            sv, st = sum(v[i] for i in pack), sum(t[i] for i in pack)
            if r == p.rounds - 1 or sv == p.vit_budget or st >= p.token_threshold:
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


# ---------------------------------------------------------------- slot balancing (default)

@dataclass
class Data:
    """The samples, their totals and their shuffled order."""

    vit: list[int]
    w: list[int]
    w2: list[int]
    tok: list[int]
    n: int = 0
    sum_v: int = 0
    sum_w: int = 0
    sum_w2: int = 0
    sum_t: int = 0
    w_tiled: int = 0
    w_text: int = 0
    vmax: int = 0
    text_max: int = 0
    count: list[int] = field(default_factory=list)
    shuffled: list[int] = field(default_factory=list)


def describe(vit: np.ndarray, w: np.ndarray, w2: np.ndarray, tok: np.ndarray, p: SlotParams
             ) -> Data:
    d = Data([int(x) for x in vit], [int(x) for x in w], [int(x) for x in w2],
             [int(x) for x in tok])
    d.n = len(d.vit)
    d.count = [0] * (p.vit_budget + 1)
    for i in range(d.n):
        d.sum_v += d.vit[i]
        d.sum_w += d.w[i]
        d.sum_w2 += d.w2[i]
        d.sum_t += d.tok[i]
        if d.vit[i] > 0:
            d.w_tiled += d.w[i]
        else:
            d.w_text += d.w[i]
            d.text_max = max(d.text_max, d.w[i])
        d.count[d.vit[i]] += 1
        d.vmax = max(d.vmax, d.vit[i])
    d.shuffled = list(range(d.n))
    shuffle(d.shuffled, SplitMix64(p.seed))
    return d


def full_pack_tiles(d: Data, p: SlotParams, packs: int) -> int:
    if d.sum_v == 0:
        return 0
    by_tokens = p.token_budget * d.sum_v // max(d.sum_t, 1)
    return min(p.vit_budget, max(d.vmax, min(by_tokens, (d.sum_v + packs - 1) // packs)))


def excess_keys(d: Data, packs: int) -> list[int]:
    mulv = d.sum_v if d.sum_v > 0 else 1
    return [packs * (d.w[i] * mulv - d.vit[i] * d.sum_w) for i in range(d.n)]


def heavy_samples(d: Data, p: SlotParams, key: list[int], fill: int, packs: int
                  ) -> list[tuple[int, int, int]]:
    """Phase 0: (key, rank, sample) of the heavy samples, heaviest first, at most one per pack."""
    heavy = []
    for r, i in enumerate(d.shuffled):
        c = d.vit[i]
        if c == 0 or c > fill:
            continue
        excess = 1024 * (d.w[i] * d.sum_v - c * d.sum_w)
        offset = (fill - c) * (1024 * d.sum_w - p.ratio_lo * d.sum_v)
        if excess > offset:
            heavy.append((key[i], r, i))
    heavy.sort(key=lambda e: (-e[0], e[1]))
    return heavy[:packs]


def _tiles_for(room: int, per: int, ratio_lo: int) -> int:
    return room * 1024 // (per * ratio_lo) if room > 0 and ratio_lo > 0 else 0


def heavy_cuts(d: Data, p: SlotParams, heavy: list[tuple[int, int, int]], fill: int, packs: int
               ) -> tuple[list[int], list[int]]:
    """(cut, hard): tiles each heavy pack gives up to carry the mean weight / to stay within the
    token budget."""
    cut, hard = [0] * len(heavy), [0] * len(heavy)
    for k, (_, _, h) in enumerate(heavy):
        c = d.vit[h]
        more = _tiles_for(d.sum_w - packs * d.w[h], packs, p.ratio_lo)
        room = _tiles_for(p.token_budget - d.tok[h], 1, p.ratio_lo)
        cut[k] = fill - c - min(fill - c, more)
        hard[k] = min(cut[k], fill - c - min(fill - c, room))
    return cut, hard


def share_slack(cuts: tuple[list[int], list[int]], slack: int) -> list[int]:
    """Every hard cut, then the rest of the cuts, smallest first, as many whole as fit."""
    full, hard = cuts
    cut = list(hard)
    slack -= sum(hard)
    order = [k for k in range(len(cut)) if full[k] > hard[k]]
    order.sort(key=lambda k: full[k] - hard[k])  # stable, as std::stable_sort
    for k in order:
        extra = full[k] - hard[k]
        if extra <= slack:
            cut[k] = full[k]
            slack -= extra
    return cut


@dataclass
class Reservation:
    """Packs, their heavy samples and tile slots (phases 0 and 1)."""

    packs: int = 0
    fill: int = 0
    key: list[int] = field(default_factory=list)
    heavy: list[tuple[int, int, int]] = field(default_factory=list)
    tiles: list[int] = field(default_factory=list)
    cap: list[int] = field(default_factory=list)
    limit: list[int] = field(default_factory=list)
    pre: list[bool] = field(default_factory=list)
    free: list[list[list[int]]] = field(default_factory=list)
    short_tiles: int = 0


def tile_targets(d: Data, packs: int, fill: int, cap: list[int], cut: bool) -> list[int]:
    limit = [fill] * packs
    total = 0
    light = []
    for q in range(packs - 1, -1, -1):
        if cap[q] >= 0:
            limit[q] = cap[q]
        else:
            light.append(q)
        total += limit[q]
    excess, most = total - d.sum_v, fill // 2
    if not cut or excess <= 0 or most <= 0 or not light:
        return limit
    k = min(len(light), (excess + most - 1) // most)
    for j in range(k):
        cut = excess // k + (1 if j < excess % k else 0)
        limit[light[j]] -= min(cut, limit[light[j]])
    return limit


def add_slot(slots: list[list[int]], c: int) -> None:
    for e in slots:
        if e[0] == c:
            e[1] += 1
            return
    slots.append([c, 1])


def compose_pack(count: list[int], total: list[int], room: list[int], done: list[int],
                 rest: int) -> list[int]:
    """One pack's tile counts summing to `rest` (or as close below as the counts allow): the
    bounded knapsack of least squared lag behind each count's share of the packs that can hold
    it (see the C++ comment)."""
    cost, ok = [0] * (rest + 1), [False] * (rest + 1)
    ok[0] = True
    took: list[list[int]] = []
    kinds: list[int] = []
    for c in range(1, rest + 1):
        if count[c] == 0 or room[c] == 0:
            continue
        ahead = (total[c] - count[c]) * room[c] - (done[c] + rest) * total[c]
        nxt, nxt_ok = list(cost), list(ok)
        k_at = [0] * (rest + 1)
        most = min(count[c], rest // c)
        step_cost = [0] + [(k * (2 * ahead + k * room[c]) * 65536) // (total[c] * room[c])
                           for k in range(1, most + 1)]
        for s in range(rest):
            if not ok[s]:
                continue
            k = 1
            while k <= most and s + k * c <= rest:
                v = cost[s] + step_cost[k]
                t = s + k * c
                if not nxt_ok[t] or v < nxt[t]:
                    nxt[t], nxt_ok[t], k_at[t] = v, True, k
                k += 1
        cost, ok = nxt, nxt_ok
        took.append(k_at)
        kinds.append(c)
    s = rest
    while s > 0 and not ok[s]:
        s -= 1
    out = [0] * len(count)
    for j in range(len(kinds) - 1, -1, -1):
        k = took[j][s]
        out[kinds[j]] = k
        s -= k * kinds[j]
    return out


def rebuild_reach(count: list[int], reach: list[bool]) -> None:
    reach[0] = True
    for r in range(1, len(reach)):
        reach[r] = any(count[c] > 0 and reach[r - c] for c in range(1, r + 1))


def any_tiles_left(count: list[int]) -> bool:
    return any(count[c] > 0 for c in range(1, len(count)))


REFILL_SHARE = 8


def refill_end(count: list[int], limit: list[int], vit_budget: int, tiles: list[int],
               slots: list[list[list[int]]]) -> None:
    """Phase 1's end game: the packs with holes and the last `span` packs refilled largest tile
    count first, `span` doubling up to packs // REFILL_SHARE (see the C++ comment)."""
    packs = len(limit)
    if not any_tiles_left(count):
        return
    reach = [False] * (vit_budget + 1)
    span = 2 * (vit_budget + 1)
    while span // 2 < packs // REFILL_SHARE:
        left, filled = list(count), list(tiles)
        trial = [[list(e) for e in sl] for sl in slots]
        redo = []
        for q in range(packs):
            if limit[q] <= filled[q] and q < packs - span:
                continue
            redo.append(q)
            for c, k in trial[q]:
                left[c] += k
                filled[q] -= c * k
            trial[q] = []
        rebuild_reach(left, reach)
        for q in redo:
            rest = max(0, limit[q] - filled[q])
            while rest > 0:
                chosen = next((c for c in range(rest, 0, -1) if left[c] > 0 and reach[rest - c]),
                              0)
                if chosen == 0:
                    break
                add_slot(trial[q], chosen)
                filled[q] += chosen
                rest -= chosen
                left[chosen] -= 1
                if left[chosen] == 0:
                    rebuild_reach(left, reach)
        if not any_tiles_left(left):
            count[:] = left
            tiles[:] = filled
            slots[:] = trial
            return
        span *= 2


def tile_slots(count: list[int], limit: list[int], vit_budget: int, w_tiled: int, w_text: int,
               tiles: list[int]) -> list[list[list[int]]]:
    """Phase 1; `count` is left holding the samples per tile count that found no slot."""
    packs = len(limit)
    slots: list[list[list[int]]] = [[] for _ in range(packs)]
    slot_tiles = sum(c * count[c] for c in range(1, vit_budget + 1))
    sum_v = slot_tiles + sum(tiles)
    total = list(count)
    room, done = [0] * (vit_budget + 1), [0] * (vit_budget + 1)
    for q in range(packs):
        hole = min(max(0, limit[q] - tiles[q]), vit_budget)
        for c in range(1, hole + 1):
            room[c] += hole
    placed = 0
    for q in range(packs):
        if placed >= slot_tiles:
            break
        hole = min(max(0, limit[q] - tiles[q]), vit_budget)
        rest = min(hole, slot_tiles - placed)
        if rest == 0:
            continue
        take = compose_pack(count, total, room, done, rest)
        for c in range(1, hole + 1):
            done[c] += rest
        for c in range(1, rest + 1):
            if take[c] == 0:
                continue
            slots[q].append([c, take[c]])
            tiles[q] += c * take[c]
            placed += c * take[c]
            count[c] -= take[c]
    refill_end(count, limit, vit_budget, tiles, slots)
    room = [(-(limit[q] - tiles[q]), q) for q in range(packs)]  # max room, then min pack
    heapq.heapify(room)
    for c in range(vit_budget, 0, -1):
        while count[c] > 0 and -room[0][0] >= c:
            r, q = heapq.heappop(room)
            add_slot(slots[q], c)
            tiles[q] += c
            count[c] -= 1
            heapq.heappush(room, (r + c, q))
    if count[0] > 0:
        n0 = count[0]
        low = [(tiles[q] * w_tiled * n0, q) for q in range(packs)]
        heapq.heapify(low)
        for _ in range(n0):
            need, q = heapq.heappop(low)
            add_slot(slots[q], 0)
            heapq.heappush(low, (need + w_text * max(sum_v, 1), q))
        count[0] = 0
    for s_ in slots:
        s_.sort()
    return slots


UNCUT_GROWTH = 64


def reserve(d: Data, p: SlotParams) -> Reservation:
    r = Reservation(packs=p.packs)
    while True:
        r.fill = full_pack_tiles(d, p, r.packs)
        r.key = excess_keys(d, r.packs)
        r.heavy = heavy_samples(d, p, r.key, r.fill, r.packs)
        r.tiles, r.cap = [0] * r.packs, [-1] * r.packs
        r.pre = [False] * d.n
        left = list(d.count)
        raw = heavy_cuts(d, p, r.heavy, r.fill, r.packs)
        cut = share_slack(raw, r.packs * r.fill - d.sum_v)
        if p.grow > 0:
            denied = sorted(raw[0][k] - cut[k] for k in range(len(cut)) if cut[k] < raw[0][k])
            if len(denied) > p.max_uncut:
                need = sum(denied[:len(denied) - p.max_uncut])
                more = p.grow * max(1, (need + r.fill * p.grow - 1) // (r.fill * p.grow))
                if r.packs + more <= p.packs + max(p.grow, p.packs // UNCUT_GROWTH):
                    r.packs += more
                    continue
        for k, (_, _, h) in enumerate(r.heavy):
            c = d.vit[h]
            r.cap[k] = r.fill - cut[k]
            r.tiles[k] = c
            left[c] -= 1
            r.pre[h] = True
        seated, count = list(r.tiles), list(left)
        for attempt in range(4):
            cut = attempt % 2 == 0
            if attempt == 2:
                r.cap = [-1] * r.packs
            r.tiles, left = list(seated), list(count)
            r.limit = tile_targets(d, r.packs, r.fill, r.cap, cut)
            r.free = tile_slots(left, r.limit, p.vit_budget, d.w_tiled, d.w_text, r.tiles)
            r.short_tiles = sum(c * left[c] for c in range(1, p.vit_budget + 1))
            if r.short_tiles == 0:
                break
        if r.short_tiles == 0 or p.grow <= 0:
            return r
        r.packs += p.grow * max(1, (r.short_tiles + r.fill * p.grow - 1) // (r.fill * p.grow))


@dataclass
class Targets:
    unit: int = 0
    target: list[int] = field(default_factory=list)
    need: list[int] = field(default_factory=list)
    target2: list[int] = field(default_factory=list)


def weight_targets(d: Data, p: SlotParams, r: Reservation) -> Targets:
    packs = r.packs
    mulv = d.sum_v if d.sum_v > 0 else 1
    unit = mulv * packs
    no_limit = (d.sum_w + 1) * unit
    text_slots = [sum(k for c, k in r.free[q] if c == 0) for q in range(packs)]
    reach_w = [no_limit if r.cap[q] >= 0 or d.sum_v == 0
               else r.tiles[q] * p.ratio_hi * unit // 1024 + text_slots[q] * d.text_max * unit
               for q in range(packs)]
    lo_w, hi_w = 0, d.sum_w
    while lo_w < hi_w:
        mid = (lo_w + hi_w) // 2
        if sum(min(mid * unit, x) for x in reach_w) >= d.sum_w * unit:
            hi_w = mid
        else:
            lo_w = mid + 1
    target = [min(lo_w * unit, x) for x in reach_w]
    need = [target[q] - packs * r.tiles[q] * d.sum_w for q in range(packs)]
    target2 = [target[q] * d.sum_w2 // d.sum_w if d.sum_w > 0 else d.sum_w2 * unit // packs
               for q in range(packs)]
    return Targets(unit, target, need, target2)


@dataclass
class Packing:
    members: list[list[int]]
    pack_tokens: list[int]
    committed: list[int]
    leftover: list[int] = field(default_factory=list)


def place_samples(d: Data, p: SlotParams, r: Reservation, t: Targets) -> Packing:
    packs = r.packs
    out = Packing([[] for _ in range(packs)], [0] * packs, list(r.tiles))
    for k, (kh, _, h) in enumerate(r.heavy):
        out.members[k].append(h)
        t.need[k] -= kh
        out.pack_tokens[k] += d.tok[h]
    positive, negative = [], []
    for q, i in enumerate(d.shuffled):
        if not r.pre[i]:
            (positive if r.key[i] >= 0 else negative).append((r.key[i], q, i))
    positive.sort(key=lambda e: (-e[0], e[1]))
    negative.sort(key=lambda e: (e[0], e[1]))

    def slot_of(q: int, c: int) -> list[int] | None:
        for e in r.free[q]:
            if e[0] == c:
                return e
        return None

    def place(items: list[tuple[int, int, int]], sign: int) -> None:
        # Heap entries (sign * need, pack): sign -1 puts the largest need on top.
        heaps: list[list[tuple[int, int]]] = [[] for _ in range(p.vit_budget + 1)]
        for q in range(packs):
            for c, k in r.free[q]:
                if k > 0:
                    heaps[c].append((sign * t.need[q], q))
        for hp in heaps:
            heapq.heapify(hp)
        for kv, _, i in items:
            c = d.vit[i]
            heap = heaps[c]
            chosen = -1
            stash = []
            while heap:
                e = heapq.heappop(heap)
                q = e[1]
                slot = slot_of(q, c)
                if slot is None or slot[1] == 0:
                    continue
                if sign * e[0] != t.need[q]:
                    heapq.heappush(heap, (sign * t.need[q], q))
                    continue
                if out.pack_tokens[q] + d.tok[i] > p.token_budget:
                    stash.append(e)
                    continue
                chosen = q
                break
            for e in stash:
                heapq.heappush(heap, e)
            in_slot = chosen >= 0
            if not in_slot:
                for q in range(packs):
                    if out.committed[q] + c <= p.vit_budget and \
                            out.pack_tokens[q] + d.tok[i] <= p.token_budget and \
                            (chosen < 0 or t.need[q] > t.need[chosen]):
                        chosen = q
                if chosen < 0:
                    out.leftover.append(i)
                    continue
                out.committed[chosen] += c
            out.members[chosen].append(i)
            out.pack_tokens[chosen] += d.tok[i]
            t.need[chosen] -= kv
            if not in_slot:
                continue
            slot = slot_of(chosen, c)
            slot[1] -= 1
            if slot[1] > 0:
                heapq.heappush(heap, (sign * t.need[chosen], chosen))

    place(positive, -1)
    place(negative, 1)
    return out


class Scorer:
    """How far off a pack is: max(pen(dev) * a, pen(dev2) * b), light deviations 1/UNDER_FACTOR."""

    def __init__(self, d: Data, p: SlotParams) -> None:
        self.a, self.b = (p.tol_div * d.sum_w2, p.tol2_div * d.sum_w) if d.sum_w2 > 0 else (1, 0)

    @staticmethod
    def pen(x: int) -> int:
        return x * UNDER_FACTOR if x > 0 else -x

    def __call__(self, d1: int, d2: int) -> int:
        return max(self.pen(d1) * self.a, self.pen(d2) * self.b)

    def sign(self, d1: int, d2: int) -> int:
        x = d2 if self.pen(d2) * self.b > self.pen(d1) * self.a else d1
        return 1 if x > 0 else -1 if x < 0 else 0


def sorted_by(vit: list[int], w: list[int], pack_of: list[int], vit_budget: int
              ) -> tuple[list[int], list[int], list[int]]:
    """Samples in packs by (tiles, weight, id): (ids, weights, where each tile count starts)."""
    ids = sorted((i for i in range(len(pack_of)) if pack_of[i] >= 0),
                 key=lambda i: (vit[i], w[i], i))
    cls = [0] * (vit_budget + 2)
    for i in ids:
        cls[vit[i] + 1] += 1
    for c in range(vit_budget + 1):
        cls[c + 1] += cls[c]
    return ids, [w[i] for i in ids], cls


def repair(d: Data, p: SlotParams, r: Reservation, t: Targets, pk: Packing) -> None:
    """Swap samples of equal tile count between packs until every pack's weights are within
    tolerance of its targets, or `p.repair_passes` passes are spent."""
    rep = _Repair(d, p, r, t, pk)
    work = [q for q in range(rep.packs) if rep.bad(q)]
    for _ in range(p.repair_passes):
        if not work:
            break
        work = rep.one_pass(work)


class _Repair:
    """repair's state: each sample's pack, each pack's deviations from its targets and their
    tolerances, the samples sorted for the partner scans, the packs queued for the next pass."""

    def __init__(self, d: Data, p: SlotParams, r: Reservation, t: Targets, pk: Packing) -> None:
        self.d, self.p, self.pk, self.unit = d, p, pk, t.unit
        self.packs, n, w, w2 = r.packs, d.n, d.w, d.w2
        self.second = d.sum_w2 > 0
        self.score = Scorer(d, p)
        self.pack_of = [-1] * n
        self.dev, self.dev2 = [0] * self.packs, [0] * self.packs
        for q in range(self.packs):
            for i in pk.members[q]:
                self.pack_of[i] = q
            self.dev[q] = sum(w[i] for i in pk.members[q]) * self.unit - t.target[q]
            self.dev2[q] = sum(w2[i] for i in pk.members[q]) * self.unit - t.target2[q]
        self.tol = [x // p.tol_div for x in t.target]
        self.tol2 = [x // p.tol2_div for x in t.target2]
        self.sorts = [sorted_by(d.vit, w, self.pack_of, p.vit_budget)]
        if self.second:
            self.sorts.append(sorted_by(d.vit, w2, self.pack_of, p.vit_budget))
        self.queued = [False] * self.packs
        self.fails = [0] * self.packs

    @staticmethod
    def off(dv: int, tl: int, sign: int) -> bool:
        return dv > tl if sign > 0 else dv < -UNDER_FACTOR * tl

    @staticmethod
    def beyond(dv: int, tl: int, sign: int) -> bool:
        return dv > tl if sign > 0 else dv < -tl

    def bad(self, q: int) -> bool:
        off, dev, dev2, tol, tol2 = self.off, self.dev, self.dev2, self.tol, self.tol2
        return off(dev[q], tol[q], 1) or off(dev[q], tol[q], -1) or \
            (self.second and (off(dev2[q], tol2[q], 1) or off(dev2[q], tol2[q], -1)))

    def worse(self, q: int) -> tuple[int, int]:
        return -self.score(self.dev[q], self.dev2[q]), q

    def extremes(self, sign: int, want: int) -> list[int]:
        return sorted((q for q in range(self.packs)
                       if self.score.sign(self.dev[q], self.dev2[q]) == sign),
                      key=self.worse)[:want]

    def one_pass(self, work: list[int]) -> list[int]:
        """One pass over the packs in `work`, worst first: the best swap of each, if any.
        Returns the packs for the next pass."""
        work.sort(key=self.worse)
        for q in work:
            self.queued[q] = False
        nxt: list[int] = []
        want_n = 2 * len(work) + self.p.partners
        over, under = self.extremes(1, want_n), self.extremes(-1, want_n)
        at = {True: 0, False: 0}  # next partner in `under` (sign > 0) / `over`
        for q0 in work:
            if not self.bad(q0):
                continue
            sign = self.score.sign(self.dev[q0], self.dev2[q0])
            best = [self.score(self.dev[q0], self.dev2[q0]), -1, -1]
            self._scan_sorted(q0, sign, best)
            self._scan_partners(q0, under if sign > 0 else over, at, sign > 0, best)
            _, bx, by = best
            if bx < 0:
                self.fails[q0] += 1
                if self.fails[q0] < 8 and not self.queued[q0]:
                    self.queued[q0] = True
                    nxt.append(q0)
                continue
            q = self.pack_of[by]
            self._swap(q0, bx, by)
            for s_ in (q0, q):
                if self.bad(s_) and not self.queued[s_]:
                    self.queued[s_] = True
                    nxt.append(s_)
        return nxt

    def _consider(self, q0: int, x: int, y: int, best: list) -> None:
        """Keep swapping x (of pack q0) with y in `best` if it lowers both packs' worst score."""
        d, p, pk, unit = self.d, self.p, self.pk, self.unit
        v, w, w2, tok, dev, dev2 = d.vit, d.w, d.w2, d.tok, self.dev, self.dev2
        q = self.pack_of[y]
        if q == q0 or v[x] != v[y]:
            return
        if pk.pack_tokens[q0] - tok[x] + tok[y] > p.token_budget or \
                pk.pack_tokens[q] - tok[y] + tok[x] > p.token_budget:
            return
        d1, d2 = (w[x] - w[y]) * unit, (w2[x] - w2[y]) * unit
        cost = max(self.score(dev[q0] - d1, dev2[q0] - d2),
                   self.score(dev[q] + d1, dev2[q] + d2))
        if cost < best[0]:
            best[:] = [cost, x, y]

    def _scan(self, q0: int, ids: list[int], ws: list[int], cls: list[int], x: int, want: int,
              sign: int, best: list) -> None:
        """Samples of x's tile count whose weight is nearest `want`, in packs not already
        beyond tolerance on the side x's pack wants to move to."""
        c = self.d.vit[x]
        lo, hi = cls[c], cls[c + 1]
        k = bisect_left(ws, want, lo, hi)
        window = self.p.window
        for step in (1, -1):
            taken = seen = 0
            j = k if step > 0 else k - 1
            while lo <= j < hi and taken < window and seen < 4 * window:
                q = self.pack_of[ids[j]]
                if not (self.beyond(self.dev[q], self.tol[q], sign) or
                        (self.second and self.beyond(self.dev2[q], self.tol2[q], sign))):
                    self._consider(q0, x, ids[j], best)
                    taken += 1
                j += step
                seen += 1

    def _scan_sorted(self, q0: int, sign: int, best: list) -> None:
        w, w2, unit = self.d.w, self.d.w2, self.unit
        for x in self.pk.members[q0]:
            self._scan(q0, *self.sorts[0], x, w[x] - _trunc_div(self.dev[q0], 2 * unit), sign,
                       best)
            if self.second:
                self._scan(q0, *self.sorts[1], x, w2[x] - _trunc_div(self.dev2[q0], 2 * unit),
                           sign, best)

    def _scan_partners(self, q0: int, other: list[int], at: dict, side: bool,
                       best: list) -> None:
        """Every pair with the next `p.partners` packs deviating the other way."""
        members = self.pk.members
        s = 0
        while s < self.p.partners and at[side] < len(other):
            for x in members[q0]:
                for y in members[other[at[side]]]:
                    self._consider(q0, x, y, best)
            s += 1
            at[side] += 1

    def _swap(self, q0: int, bx: int, by: int) -> None:
        """Swap sample bx of pack q0 with sample by of its pack."""
        d, pk, unit = self.d, self.pk, self.unit
        w, w2, tok = d.w, d.w2, d.tok
        q = self.pack_of[by]
        d1, d2 = (w[bx] - w[by]) * unit, (w2[bx] - w2[by]) * unit
        self.dev[q0] -= d1
        self.dev[q] += d1
        self.dev2[q0] -= d2
        self.dev2[q] += d2
        pk.pack_tokens[q0] += tok[by] - tok[bx]
        pk.pack_tokens[q] += tok[bx] - tok[by]
        pk.members[q0][pk.members[q0].index(bx)] = by
        pk.members[q][pk.members[q].index(by)] = bx
        self.pack_of[bx], self.pack_of[by] = q, q0


def _trunc_div(a: int, b: int) -> int:
    """Integer division rounding toward zero, as C++ does."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def slot_balance(vit: np.ndarray, weight: np.ndarray, weight2: np.ndarray, tokens: np.ndarray,
                 p: SlotParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slot balancing into p.packs packs (more, p.grow at a time, while tiles do not fit, or
    while more than p.max_uncut heavy packs would stay over their target): returns (samples,
    pack_ptr, leftover)."""
    if len(vit) != len(tokens) or len(weight) != len(tokens) or len(weight2) != len(tokens):
        raise ValueError("slot_balance: arrays must be 1-D and of equal length")
    if any(int(c) < 0 or int(c) > p.vit_budget for c in vit):
        raise ValueError("slot_balance: vit values must lie in [0, vit_budget]")
    if any(int(x) < 0 for x in weight2):
        raise ValueError("slot_balance: weight2 values must be >= 0")
    d = describe(vit, weight, weight2, tokens, p)
    r = reserve(d, p)
    t = weight_targets(d, p, r)
    pk = place_samples(d, p, r, t)
    if p.repair_passes > 0:
        repair(d, p, r, t, pk)
    return _flatten(pk.members) + (np.array(pk.leftover, np.int64),)


# ---------------------------------------------------------------- token balancing (LPT)

def lpt_balance(vit: np.ndarray, tokens: np.ndarray, p: SlotParams
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Samples, most tokens first (ties in a seeded random order), each to the pack with the
    fewest tokens (then lowest index) that has room for its tiles and tokens, into p.packs
    packs: returns (samples, pack_ptr, leftover)."""
    if len(vit) != len(tokens):
        raise ValueError("lpt_balance: arrays must be 1-D and of equal length")
    if p.packs < 1:
        raise ValueError("lpt_balance: packs must be >= 1")
    v, t = [int(x) for x in vit], [int(x) for x in tokens]
    n = len(v)
    rank = [0] * n
    for r, i in enumerate(permutation(n, p.seed)):
        rank[int(i)] = r
    order = sorted(range(n), key=lambda i: (-t[i], rank[i]))
    tiles, load = [0] * p.packs, [0] * p.packs
    members: list[list[int]] = [[] for _ in range(p.packs)]
    light = [(0, q) for q in range(p.packs)]
    heapq.heapify(light)
    leftover = []
    for i in order:
        chosen, stash = -1, []
        while light:
            e = light[0]
            if e[0] + t[i] > p.token_budget:
                break
            heapq.heappop(light)
            if tiles[e[1]] + v[i] <= p.vit_budget:
                chosen = e[1]
                break
            stash.append(e)
        for e in stash:
            heapq.heappush(light, e)
        if chosen < 0:
            leftover.append(i)
            continue
        members[chosen].append(i)
        tiles[chosen] += v[i]
        load[chosen] += t[i]
        heapq.heappush(light, (load[chosen], chosen))
    return _flatten(members) + (np.array(leftover, np.int64),)
