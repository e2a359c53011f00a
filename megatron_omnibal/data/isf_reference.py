"""Pure-Python reference of the C++ balancing core (csrc/isf_core.cpp), line for line.

It exists so that tests can check the fast core against code simple enough to read: same PRNG,
same shuffles, same packs for the same seed. It is slow (pure Python loops): use it on small
inputs only. Any change to the core must be mirrored here.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque

import numpy as np

MASK64 = (1 << 64) - 1


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


class _Buckets:
    """Unused samples sorted by (vit, weight, index), one bucket per vit value, with union-find
    skip arrays for the nearest unused neighbour above / below a position."""

    def __init__(self, vit: list[int], w: list[int], vit_budget: int) -> None:
        n = len(vit)
        self.order = sorted(range(n), key=lambda i: (vit[i], w[i], i))
        self.weight = [w[i] for i in self.order]
        self.start = [0] * (vit_budget + 2)
        self.pos = [0] * n
        for k, i in enumerate(self.order):
            self.pos[i] = k
            self.start[vit[i] + 1] += 1
        for v in range(vit_budget + 1):
            self.start[v + 1] += self.start[v]
        self.up = list(range(n + 1))
        self.down = list(range(n + 1))

    @staticmethod
    def _find(parent: list[int], k: int) -> int:
        root = k
        while parent[root] != root:
            root = parent[root]
        while parent[k] != root:
            parent[k], k = root, parent[k]
        return root

    def next_unused(self, k: int) -> int:
        return self._find(self.up, k)

    def prev_unused(self, k: int) -> int:
        return self._find(self.down, k + 1) - 1

    def remove(self, i: int) -> None:
        k = self.pos[i]
        self.up[k] = k + 1
        self.down[k + 1] = k

    def closest(self, v: int, target: int, room: int, exclude: int, tok: list[int],
                limit: int = 1 << 62) -> int:
        if v < 0 or v + 1 >= len(self.start):
            return -1
        lo, hi = self.start[v], self.start[v + 1]
        if lo == hi:
            return -1
        k = bisect_left(self.weight, target, lo, hi)
        a = self.next_unused(k)
        if a < hi and self.order[a] == exclude:
            a = self.next_unused(a + 1)
        b = self.prev_unused(k - 1)
        if b >= lo and self.order[b] == exclude:
            b = self.prev_unused(b - 1)
        has_a = a < hi and tok[self.order[a]] <= room and self.weight[a] <= limit
        has_b = b >= lo and tok[self.order[b]] <= room and self.weight[b] <= limit
        if has_a and has_b:
            return self.order[a] if self.weight[a] - target < target - self.weight[b] \
                else self.order[b]
        if has_a:
            return self.order[a]
        if has_b:
            return self.order[b]
        return -1


def fill_complete(vit: np.ndarray, weight: np.ndarray, tokens: np.ndarray, vit_budget: int,
                  token_budget: int, weight_cap: int, packs: int, seed: int, scan_limit: int,
                  tol_div: int, ratio_lo: int, ratio_hi: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fill-and-complete packing into `packs` packs: returns (samples, pack_ptr, leftover)."""
    v, w, tok = ([int(x) for x in a] for a in (vit, weight, tokens))
    n = len(v)
    bk = _Buckets(v, w, vit_budget)
    used = [False] * n
    main = list(range(n))
    shuffle(main, SplitMix64(seed))
    vmax, rem_v, rem_w = max(v, default=0), sum(v), sum(w)
    mp = 0
    deferred: deque[int] = deque()
    samples: list[int] = []
    ptr = [0]
    cur = [0, 0, 0, 0]  # tiles, weight, tokens, count of the open pack

    def take(i: int) -> None:
        used[i] = True
        bk.remove(i)
        samples.append(i)
        cur[0] += v[i]
        cur[1] += w[i]
        cur[2] += tok[i]
        cur[3] += 1

    for p in range(packs):
        left = packs - p
        tv = min(vit_budget, (rem_v + left - 1) // left)
        tw = min(weight_cap, (2 * rem_w + left) // (2 * left))
        tol = tw // tol_div
        cur[:] = [0, 0, 0, 0]
        rejected_deferred: list[int] = []
        rejected_main: list[int] = []
        rejects = 0
        while True:
            need_v, need_w, room = tv - cur[0], tw - cur[1], token_budget - cur[2]
            if need_v == 0 and abs(need_w) <= tol:
                break
            if need_v >= 0:
                c = bk.closest(need_v, need_w, room, -1, tok)
                if c >= 0 and abs(w[c] - need_w) <= tol:
                    take(c)
                    break
            done = accepted = False
            while rejects < scan_limit:
                if deferred:
                    s, from_deferred = deferred.popleft(), True
                elif mp < n:
                    s, from_deferred = main[mp], False
                    mp += 1
                else:
                    break
                if used[s]:
                    continue
                ok = False
                if v[s] <= vit_budget - cur[0] and tok[s] <= room:
                    rv, rw = need_v - v[s], need_w - w[s]
                    if rv == 0 and abs(rw) <= tol:
                        take(s)
                        done = True
                    elif rv >= 0:
                        c = bk.closest(rv, rw, room - tok[s], s, tok)
                        if c >= 0 and abs(w[c] - rw) <= tol:
                            take(s)
                            take(c)
                            done = True
                    ok = done or cur[3] == 0 or (
                        rv > vmax and rw * 1024 >= rv * ratio_lo and rw * 1024 <= rv * ratio_hi)
                if done:
                    break
                if ok:
                    take(s)
                    accepted = True
                    break
                (rejected_deferred if from_deferred else rejected_main).append(s)
                rejects += 1
            if done:
                break
            if accepted:
                continue
            while True:
                nv, nw, rm = tv - cur[0], tw - cur[1], token_budget - cur[2]
                if nw <= tol:
                    break
                took = False
                for vb in range(min(nv, vit_budget - cur[0]), -1, -1):
                    share = nw * vb // nv if nv > 0 else nw
                    c = bk.closest(vb, share, rm, -1, tok, nw + tol)
                    if c >= 0:
                        take(c)
                        took = True
                        break
                if not took:
                    break
            break
        deferred.extendleft(reversed(rejected_deferred))
        deferred.extend(rejected_main)
        rem_v -= cur[0]
        rem_w -= cur[1]
        ptr.append(len(samples))
    leftover = [i for i in range(n) if not used[i]]
    return np.array(samples, np.int64), np.array(ptr, np.int64), np.array(leftover, np.int64)
