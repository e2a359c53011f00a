// C++ balancing core (pybind11): the project's PRNG, OmniBal's ISF and our slot-balancing
// packer. megatron_omnibal/data/isf_reference.py is a line-by-line Python mirror of this file;
// tests compare the two on random inputs (same seed, same packs), so any change here must be
// made there too. Every function works on positions 0..n-1 of the arrays it gets.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <queue>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace py = pybind11;
using i64 = int64_t;
using Vec = std::vector<i64>;

namespace {

// splitmix64 (Steele, Lea, Flood 2014): tiny, fast, identical in any language with uint64.
struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed) {}
  uint64_t next() {
    state += 0x9E3779B97F4A7C15ULL;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // A value in [0, n): the high 64 bits of next() * n (Lemire's multiply, no rejection; the
  // bias is below n / 2^64).
  uint64_t below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next()) * n) >> 64);
  }
};

// Fisher-Yates from the back: for i = n..2, swap a[i-1] with a[below(i)].
void shuffle(Vec& a, Rng& rng) {
  for (size_t i = a.size(); i > 1; --i) {
    size_t j = rng.below(i);
    std::swap(a[i - 1], a[j]);
  }
}

using Packs = std::pair<Vec, Vec>;  // (samples pack after pack, pack_ptr)

// ---------------------------------------------------------------- ISF (OmniBal, faithful)
// Each round fills packs in shuffled order, a pack closing when the next sample would exceed a
// budget; full packs (tiles == budget or tokens >= threshold) are kept, the others' samples go
// to the next round; the last round keeps everything, and the last open pack is always closed.
Packs isf(const i64* vit, const i64* tok, i64 n, i64 vit_budget, i64 token_budget,
          i64 token_threshold, i64 rounds, uint64_t seed) {
  struct VT {
    i64 v, t;
  };
  std::vector<VT> vt(n);  // one cache line per sample in the random-order pass
  for (i64 i = 0; i < n; ++i) vt[i] = {vit[i], tok[i]};
  Vec out_samples, out_ptr{0};
  out_samples.reserve(n);
  Vec ids(n), rest;
  for (i64 i = 0; i < n; ++i) ids[i] = i;
  for (i64 r = 0; r < rounds && !ids.empty(); ++r) {
    Rng rng(seed + static_cast<uint64_t>(r));
    shuffle(ids, rng);
    const bool last = r == rounds - 1;
    rest.clear();
    auto close = [&](size_t begin, size_t end, i64 sv, i64 st) {
      Vec& to = last || sv == vit_budget || st >= token_threshold ? out_samples : rest;
      to.insert(to.end(), ids.begin() + static_cast<std::ptrdiff_t>(begin),
                ids.begin() + static_cast<std::ptrdiff_t>(end));
      if (&to == &out_samples) out_ptr.push_back(static_cast<i64>(out_samples.size()));
    };
    size_t begin = 0;
    i64 sv = 0, st = 0;
    for (size_t k = 0; k < ids.size(); ++k) {
      const VT& x = vt[ids[k]];
      if (k > begin && (sv + x.v > vit_budget || st + x.t > token_budget)) {
        close(begin, k, sv, st);
        begin = k;
        sv = st = 0;
      }
      sv += x.v;
      st += x.t;
    }
    close(begin, ids.size(), sv, st);
    ids.swap(rest);
  }
  return {out_samples, out_ptr};
}

// ---------------------------------------------------------------- slot balancing (default)
// Weights are balanced in units of "excess": a sample's weight beyond what the data's weight per
// tile predicts for its tiles (key = packs * (w * sum_v - vit * sum_w), exact in 128 bits).
// 0. Heavy samples (more excess than a full pack's other tiles could offset even at a low weight
//    per tile) each start a pack of their own, heaviest first, whose tile target is cut to what
//    their weight leaves room for: such a pack ends light in tiles instead of heavy in weight.
// 1. Tile slots: each pack's multiset of tile counts is drawn one at a time, with probability
//    proportional to what is left of each tile count, among those that still let the pack hit
//    its tile target (the budget) exactly. Only a whole step of packs' tile max matters for
//    balance, so packs are filled to the budget and the last ones take what is left.
// 2. Samples into slots of their tile count (tiles stay exact): samples of positive excess,
//    largest first, each to the pack that most lacks weight; then those of negative excess,
//    most negative first, each to the pack with the most (longest-processing-time-first).
// 3. Repair: a pack off its weight target by more than the tolerance swaps one sample for one of
//    equal tiles in any other pack, the swap that best lowers the larger of the two deviations;
//    candidates are the `window` samples on either side of the weight that would halve it.
using i128 = __int128;
using Slots = std::vector<std::vector<std::pair<i64, i64>>>;  // per pack: (tile count, slots)

i128 abs128(i128 x) { return x < 0 ? -x : x; }

struct HeapItem {
  i128 need;
  i64 pack;
};
struct MaxFirst {  // top: largest need, then smallest pack
  bool operator()(const HeapItem& a, const HeapItem& b) const {
    return a.need != b.need ? a.need < b.need : a.pack > b.pack;
  }
};
struct MinFirst {  // top: smallest need, then smallest pack
  bool operator()(const HeapItem& a, const HeapItem& b) const {
    return a.need != b.need ? a.need > b.need : a.pack > b.pack;
  }
};

// reach[r]: r tiles can be made from the tile counts still present (presence only).
void rebuild_reach(const Vec& count, std::vector<char>& reach) {
  const i64 top = static_cast<i64>(reach.size()) - 1;
  reach[0] = 1;
  for (i64 r = 1; r <= top; ++r) {
    reach[r] = 0;
    for (i64 c = 1; c <= r; ++c)
      if (count[c] > 0 && reach[r - c]) {
        reach[r] = 1;
        break;
      }
  }
}

void add_slot(std::vector<std::pair<i64, i64>>& slots, i64 c) {
  for (auto& e : slots)
    if (e.first == c) {
      e.second += 1;
      return;
    }
  slots.emplace_back(c, 1);
}

// Phase 1. `count`: samples per tile count not yet placed (on return: those that found no
// slot); `tiles`: tiles already placed per
// pack; `cap`: a pack's tile target if not the budget. w_tiled / w_text: weight of
// the samples with / without tiles (text-only slots go where expected weight is lowest).
Slots tile_slots(Vec& count, i64 fill, i64 vit_budget, i64 packs, i64 w_tiled, i64 w_text,
                 Vec& tiles, const Vec& cap) {
  std::vector<char> reach(vit_budget + 1);
  rebuild_reach(count, reach);
  Slots slots(packs);
  i64 sum_v = 0;
  for (i64 c = 1; c <= vit_budget; ++c) sum_v += c * count[c];
  for (i64 p = 0; p < packs; ++p) sum_v += tiles[p];
  const Vec total(count);
  i64 placed = 0;
  Vec limit(packs, fill);
  for (i64 p = 0; p < packs; ++p) {
    if (cap[p] >= 0) limit[p] = cap[p];
    i64 rest = std::max<i64>(0, limit[p] - tiles[p]);
    while (rest > 0) {
      // The feasible tile count most behind its proportional share of the tiles placed so far,
      // so that what is left keeps the data's mix and the last packs can still be filled.
      i64 chosen = 0;
      i128 best = 0;
      for (i64 c = 1; c <= rest; ++c) {
        if (count[c] == 0 || !reach[rest - c]) continue;
        const i128 lag = static_cast<i128>(total[c]) * placed -
                         static_cast<i128>(total[c] - count[c]) * sum_v;
        if (chosen == 0 || lag > best) {
          chosen = c;
          best = lag;
        }
      }
      if (chosen == 0) break;
      placed += chosen;
      add_slot(slots[p], chosen);
      tiles[p] += chosen;
      rest -= chosen;
      count[chosen] -= 1;
      if (count[chosen] == 0) rebuild_reach(count, reach);
    }
  }
  // What did not fit exactly goes, largest first, to the pack with the most room.
  std::priority_queue<std::pair<i64, i64>> room;  // (room, -pack)
  for (i64 p = 0; p < packs; ++p) room.push({limit[p] - tiles[p], -p});
  for (i64 c = vit_budget; c >= 1; --c)
    while (count[c] > 0 && room.top().first >= c) {
      const auto [r, np] = room.top();
      room.pop();
      add_slot(slots[-np], c);
      tiles[-np] += c;
      count[c] -= 1;
      room.push({r - c, np});
    }
  if (count[0] > 0) {
    const i128 n0 = count[0];
    std::priority_queue<HeapItem, std::vector<HeapItem>, MinFirst> low;
    for (i64 p = 0; p < packs; ++p) low.push({static_cast<i128>(tiles[p]) * w_tiled * n0, p});
    for (i64 k = 0; k < n0; ++k) {
      HeapItem e = low.top();
      low.pop();
      add_slot(slots[e.pack], 0);
      e.need += static_cast<i128>(w_text) * std::max<i64>(sum_v, 1);
      low.push(e);
    }
  }
  for (auto& s : slots) std::sort(s.begin(), s.end());
  return slots;
}

struct SlotResult {
  Vec samples, ptr, leftover;
};

struct Keyed {
  i128 key;
  i64 rank, id;
};

SlotResult slot_balance(const i64* vit, const i64* w, const i64* tok, i64 n, i64 vit_budget,
                        i64 token_budget, i64 packs_in, i64 grow, uint64_t seed,
                        i64 repair_passes, i64 tol_div, i64 window, i64 partners, i64 ratio_lo,
                        i64 ratio_hi) {
  Vec shuffled(n);
  for (i64 i = 0; i < n; ++i) shuffled[i] = i;
  Rng rng(seed);
  shuffle(shuffled, rng);
  i64 sum_v = 0, sum_w = 0, sum_t = 0, w_tiled = 0, w_text = 0, vmax = 0;
  Vec count(vit_budget + 1, 0);
  for (i64 i = 0; i < n; ++i) {
    sum_v += vit[i];
    sum_w += w[i];
    sum_t += tok[i];
    (vit[i] > 0 ? w_tiled : w_text) += w[i];
    count[vit[i]] += 1;
    vmax = std::max(vmax, vit[i]);
  }
  const i128 mulv = sum_v > 0 ? sum_v : 1;
  // Phases 0 and 1 for `packs` packs; while tiles are left over, more packs (`grow` at a time).
  i64 packs = packs_in, fill = 0;
  std::vector<i128> key(n);
  std::vector<Keyed> heavy;
  Vec tiles, cap;
  std::vector<char> pre;
  Slots free;
  while (true) {
    // Tiles of a full pack: the tile budget, or fewer if the token budget binds first at the
    // data's tokens per tile, or if fewer suffice to hold all tiles (never fewer than the
    // largest sample's tiles).
    const i64 by_tokens =
        static_cast<i64>(static_cast<i128>(token_budget) * sum_v / std::max<i64>(sum_t, 1));
    fill = sum_v == 0 ? 0
                      : std::min<i64>(vit_budget,
                                      std::max<i64>(vmax, std::min<i64>(
                                          by_tokens, (sum_v + packs - 1) / packs)));
    for (i64 i = 0; i < n; ++i)
      key[i] = static_cast<i128>(packs) *
               (static_cast<i128>(w[i]) * mulv - static_cast<i128>(vit[i]) * sum_w);

    // Phase 0: heavy samples.
    heavy.clear();
    for (i64 r = 0; r < n; ++r) {
      const i64 i = shuffled[r], c = vit[i];
      if (c == 0 || c > fill) continue;
      const i128 excess =
          1024 * (static_cast<i128>(w[i]) * sum_v - static_cast<i128>(c) * sum_w);
      const i128 offset = static_cast<i128>(fill - c) *
                          (1024 * static_cast<i128>(sum_w) - static_cast<i128>(ratio_lo) * sum_v);
      if (excess > offset) heavy.push_back({key[i], r, i});
    }
    std::sort(heavy.begin(), heavy.end(), [](const Keyed& a, const Keyed& b) {
      return a.key != b.key ? a.key > b.key : a.rank < b.rank;
    });
    if (static_cast<i64>(heavy.size()) > packs) heavy.resize(packs);
    tiles.assign(packs, 0);
    cap.assign(packs, -1);
    pre.assign(n, 0);
    Vec left(count);
    for (size_t k = 0; k < heavy.size(); ++k) {
      const i64 h = heavy[k].id, c = vit[h];
      const i128 room_w = static_cast<i128>(sum_w) - static_cast<i128>(packs) * w[h];
      const i128 more = room_w > 0 && ratio_lo > 0
                            ? room_w * 1024 / (static_cast<i128>(packs) * ratio_lo) : 0;
      cap[k] = c + static_cast<i64>(std::min<i128>(fill - c, more));
      tiles[k] = c;
      left[c] -= 1;
      pre[h] = 1;
    }

    // Phase 1: tile slots.
    free = tile_slots(left, fill, vit_budget, packs, w_tiled, w_text, tiles, cap);
    i64 short_tiles = 0;
    for (i64 c = 1; c <= vit_budget; ++c) short_tiles += c * left[c];
    if (short_tiles == 0 || grow <= 0) break;
    packs += grow * std::max<i64>(1, (short_tiles + fill * grow - 1) / (fill * grow));
  }

  // Phase 2: samples into slots.
  std::vector<i128> need(packs);
  Vec pack_tokens(packs, 0);
  std::vector<Vec> members(packs);
  // Weight targets (key units, weight * unit): one common level W for every pack that can carry
  // it (tiles * a high weight per tile, ratio_hi / 1024, plus its text-only slots * the heaviest
  // text-only sample, reaches W; heavy packs always), the
  // rest what they can carry; W is the least level at which the targets hold all the weight.
  // The largest pack of a step is what its ranks wait for, so the level is what matters.
  const i128 unit = mulv * packs;
  std::vector<i128> reach_w(packs), target(packs);
  const i128 no_limit = static_cast<i128>(sum_w + 1) * unit;
  i64 text_max = 0;  // heaviest text-only sample: what a text-only slot can carry
  for (i64 i = 0; i < n; ++i)
    if (vit[i] == 0) text_max = std::max(text_max, w[i]);
  for (i64 p = 0; p < packs; ++p) {
    i64 text_slots = 0;
    for (const auto& [c, k] : free[p])
      if (c == 0) text_slots = k;
    reach_w[p] = cap[p] >= 0 || sum_v == 0
                     ? no_limit
                     : static_cast<i128>(tiles[p]) * ratio_hi * unit / 1024 +
                           static_cast<i128>(text_slots) * text_max * unit;
  }
  auto held = [&](i128 level) {
    i128 total = 0;
    for (i64 p = 0; p < packs; ++p) total += std::min(level * unit, reach_w[p]);
    return total;
  };
  i128 lo_w = 0, hi_w = sum_w;  // held(hi_w) >= sum_w * unit unless the reach is too small
  while (lo_w < hi_w) {
    const i128 mid = (lo_w + hi_w) / 2;
    if (held(mid) >= static_cast<i128>(sum_w) * unit) hi_w = mid; else lo_w = mid + 1;
  }
  for (i64 p = 0; p < packs; ++p) {
    target[p] = std::min(lo_w * unit, reach_w[p]);
    need[p] = target[p] - static_cast<i128>(packs) * tiles[p] * sum_w;
  }
  Vec pack_tiles(packs, 0);
  for (size_t k = 0; k < heavy.size(); ++k) {
    members[k].push_back(heavy[k].id);
    need[k] -= heavy[k].key;
    pack_tokens[k] += tok[heavy[k].id];
    pack_tiles[k] += vit[heavy[k].id];
  }
  auto slot_of = [&](i64 p, i64 c) -> i64* {
    for (auto& e : free[p])
      if (e.first == c) return &e.second;
    return nullptr;
  };
  std::vector<Keyed> positive, negative;
  for (i64 r = 0; r < n; ++r) {
    const i64 i = shuffled[r];
    if (!pre[i]) (key[i] >= 0 ? positive : negative).push_back({key[i], r, i});
  }
  std::sort(positive.begin(), positive.end(), [](const Keyed& a, const Keyed& b) {
    return a.key != b.key ? a.key > b.key : a.rank < b.rank;
  });
  std::sort(negative.begin(), negative.end(), [](const Keyed& a, const Keyed& b) {
    return a.key != b.key ? a.key < b.key : a.rank < b.rank;
  });
  SlotResult res;
  // Needs only fall while positive samples are placed and only rise while negative ones are, so
  // a heap entry with a stale need is re-queued with the current one (lazy update).
  auto place = [&](const std::vector<Keyed>& items, auto cmp) {
    using Heap = std::priority_queue<HeapItem, std::vector<HeapItem>, decltype(cmp)>;
    std::vector<Heap> heaps(vit_budget + 1, Heap(cmp));
    for (i64 p = 0; p < packs; ++p)
      for (const auto& [c, k] : free[p])
        if (k > 0) heaps[c].push({need[p], p});
    std::vector<HeapItem> stash;
    for (const Keyed& item : items) {
      const i64 i = item.id, c = vit[i];
      Heap& heap = heaps[c];
      i64 chosen = -1;
      stash.clear();
      while (!heap.empty()) {
        const HeapItem e = heap.top();
        heap.pop();
        i64* k = slot_of(e.pack, c);
        if (k == nullptr || *k == 0) continue;
        if (e.need != need[e.pack]) {
          heap.push({need[e.pack], e.pack});
          continue;
        }
        if (pack_tokens[e.pack] + tok[i] > token_budget) {
          stash.push_back(e);
          continue;
        }
        chosen = e.pack;
        break;
      }
      for (const HeapItem& e : stash) heap.push(e);
      bool in_slot = chosen >= 0;
      if (!in_slot) {
        // No slot of its tile count has token room left: the neediest pack with room for its
        // tiles and tokens takes it beyond its slots (rare: tiny or token-bound inputs).
        for (i64 p = 0; p < packs; ++p)
          if (pack_tiles[p] + c <= vit_budget && pack_tokens[p] + tok[i] <= token_budget &&
              (chosen < 0 || need[p] > need[chosen]))
            chosen = p;
        if (chosen < 0) {
          res.leftover.push_back(i);
          continue;
        }
      }
      members[chosen].push_back(i);
      pack_tokens[chosen] += tok[i];
      pack_tiles[chosen] += c;
      need[chosen] -= item.key;
      if (!in_slot) continue;
      i64* k = slot_of(chosen, c);
      *k -= 1;
      if (*k > 0) heap.push({need[chosen], chosen});
    }
  };
  place(positive, MaxFirst());
  place(negative, MinFirst());

  auto emit = [&]() {
    res.ptr.push_back(0);
    for (const Vec& m : members) {
      res.samples.insert(res.samples.end(), m.begin(), m.end());
      res.ptr.push_back(static_cast<i64>(res.samples.size()));
    }
    return res;
  };
  if (repair_passes == 0) return emit();

  // Phase 3: repair.
  // Deviations from the targets in key units; a pack is fine within target / tol_div.
  Vec pack_of(n, -1);
  std::vector<i128> dev(packs), tol(packs);
  for (i64 p = 0; p < packs; ++p) {
    i64 sw = 0;
    for (i64 i : members[p]) {
      pack_of[i] = p;
      sw += w[i];
    }
    dev[p] = sw * unit - target[p];
    tol[p] = target[p] / tol_div;
  }
  struct ByWeight {
    i64 vit, w, id;
  };
  std::vector<ByWeight> by_w;
  by_w.reserve(n);
  for (i64 i = 0; i < n; ++i)
    if (pack_of[i] >= 0) by_w.push_back({vit[i], w[i], i});
  std::sort(by_w.begin(), by_w.end(), [](const ByWeight& a, const ByWeight& b) {
    return std::tie(a.vit, a.w, a.id) < std::tie(b.vit, b.w, b.id);
  });
  Vec cls_start(vit_budget + 2, 0);
  for (const ByWeight& e : by_w) cls_start[e.vit + 1] += 1;
  for (i64 c = 0; c <= vit_budget; ++c) cls_start[c + 1] += cls_start[c];
  // Heavy packs are what a step waits for; light ones only lower its mean a little, so they are
  // repaired only when far off (UNDER_FACTOR tolerances). A pack that finds no swap 8 times is
  // left alone.
  constexpr i64 UNDER_FACTOR = 4;
  auto bad = [&](i64 p) { return dev[p] > tol[p] || dev[p] < -UNDER_FACTOR * tol[p]; };
  Vec work, next;
  std::vector<char> queued(packs, 0), fails(packs, 0);
  for (i64 p = 0; p < packs; ++p)
    if (bad(p)) work.push_back(p);
  // Partners beyond the window: the most deviating packs of the other sign, best pair swap.
  Vec over, under;
  auto extremes = [&](Vec& out, bool positive, size_t want) {
    out.clear();
    for (i64 p = 0; p < packs; ++p)
      if (positive ? dev[p] > 0 : dev[p] < 0) out.push_back(p);
    auto worse = [&](i64 a, i64 b) {
      const i128 da = abs128(dev[a]), db = abs128(dev[b]);
      return da != db ? da > db : a < b;
    };
    if (out.size() > want) {
      std::nth_element(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(want), out.end(),
                       worse);
      out.resize(want);
    }
    std::sort(out.begin(), out.end(), worse);
  };
  for (i64 pass = 0; pass < repair_passes && !work.empty(); ++pass) {
    std::sort(work.begin(), work.end(), [&](i64 a, i64 b) {
      const i128 da = abs128(dev[a]), db = abs128(dev[b]);
      return da != db ? da > db : a < b;
    });
    for (i64 p : work) queued[p] = 0;
    next.clear();
    extremes(over, true, 2 * work.size() + partners);
    extremes(under, false, 2 * work.size() + partners);
    size_t next_over = 0, next_under = 0;
    for (i64 p : work) {
      if (!bad(p)) continue;
      i128 best = abs128(dev[p]);
      i64 bx = -1, by = -1;
      auto consider = [&](i64 x, i64 y) {
        const i64 q = pack_of[y];
        if (q == p || vit[x] != vit[y]) return;
        if (pack_tokens[p] - tok[x] + tok[y] > token_budget ||
            pack_tokens[q] - tok[y] + tok[x] > token_budget)
          return;
        const i128 delta = (w[x] - w[y]) * unit;
        const i128 cost = std::max(abs128(dev[p] - delta), abs128(dev[q] + delta));
        if (cost < best) {
          best = cost;
          bx = x;
          by = y;
        }
      };
      for (i64 x : members[p]) {
        const i64 c = vit[x], lo = cls_start[c], hi = cls_start[c + 1];
        const i64 want = w[x] - static_cast<i64>(dev[p] / (2 * unit));
        const i64 k = std::lower_bound(by_w.begin() + lo, by_w.begin() + hi, want,
                                       [](const ByWeight& e, i64 value) { return e.w < value; }) -
                      by_w.begin();
        // Outward from k, the first `window` candidates on each side in packs that are not
        // off the same way as p (those could not take the difference), within 4 * window.
        for (const i64 step : {i64{1}, i64{-1}}) {
          i64 taken = 0;
          for (i64 j = step > 0 ? k : k - 1, seen = 0;
               j >= lo && j < hi && taken < window && seen < 4 * window; j += step, ++seen) {
            const i64 q = pack_of[by_w[j].id];
            if (dev[p] > 0 ? dev[q] > tol[q] : dev[q] < -tol[q]) continue;
            consider(x, by_w[j].id);
            taken += 1;
          }
        }
      }
      const Vec& other = dev[p] > 0 ? under : over;
      size_t& at = dev[p] > 0 ? next_under : next_over;
      for (i64 t = 0; t < partners && at < other.size(); ++t, ++at)
        for (i64 x : members[p])
          for (i64 y : members[other[at]]) consider(x, y);
      if (bx < 0) {
        if (++fails[p] < 8 && !queued[p]) {  // nothing now; the packs around it may change
          queued[p] = 1;
          next.push_back(p);
        }
        continue;
      }
      const i64 q = pack_of[by];
      const i128 delta = (w[bx] - w[by]) * unit;
      dev[p] -= delta;
      dev[q] += delta;
      pack_tokens[p] += tok[by] - tok[bx];
      pack_tokens[q] += tok[bx] - tok[by];
      *std::find(members[p].begin(), members[p].end(), bx) = by;
      *std::find(members[q].begin(), members[q].end(), by) = bx;
      pack_of[bx] = q;
      pack_of[by] = p;
      for (i64 r : {p, q})
        if (bad(r) && !queued[r]) {
          queued[r] = 1;
          next.push_back(r);
        }
    }
    work.swap(next);
  }
  return emit();
}

// ---------------------------------------------------------------- bindings
using Arr = py::array_t<i64, py::array::c_style | py::array::forcecast>;

py::array_t<i64> to_numpy(const Vec& v) {
  py::array_t<i64> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

void check_same(const Arr& a, const Arr& b, const char* what) {
  if (a.ndim() != 1 || b.ndim() != 1 || a.size() != b.size())
    throw std::invalid_argument(std::string(what) + ": arrays must be 1-D and of equal length");
}

}  // namespace

PYBIND11_MODULE(_isf_core, m) {
  m.doc() = "megatron-omnibal balancing core: splitmix64 PRNG, ISF, slot balancing";

  m.def("random_u64", [](uint64_t seed, i64 count) {
    Rng rng(seed);
    py::array_t<uint64_t> out(count);
    for (i64 i = 0; i < count; ++i) out.mutable_data()[i] = rng.next();
    return out;
  }, py::arg("seed"), py::arg("count"), "The first `count` outputs of splitmix64(seed).");

  m.def("permutation", [](i64 n, uint64_t seed) {
    Vec a(n);
    {
      py::gil_scoped_release release;
      for (i64 i = 0; i < n; ++i) a[i] = i;
      Rng rng(seed);
      shuffle(a, rng);
    }
    return to_numpy(a);
  }, py::arg("n"), py::arg("seed"), "Fisher-Yates permutation of range(n) with splitmix64(seed).");

  m.def("isf", [](Arr vit, Arr tok, i64 vit_budget, i64 token_budget, i64 token_threshold,
                  i64 rounds, uint64_t seed) {
    check_same(vit, tok, "isf");
    Packs r;
    {
      py::gil_scoped_release release;
      r = isf(vit.data(), tok.data(), vit.size(), vit_budget, token_budget, token_threshold,
              rounds, seed);
    }
    return py::make_tuple(to_numpy(r.first), to_numpy(r.second));
  }, py::arg("vit"), py::arg("tokens"), py::arg("vit_budget"), py::arg("token_budget"),
     py::arg("token_threshold"), py::arg("rounds"), py::arg("seed"),
     "OmniBal ISF: returns (samples, pack_ptr) over positions of the input arrays.");

  m.def("slot_balance", [](Arr vit, Arr weight, Arr tok, i64 vit_budget, i64 token_budget,
                           i64 packs, i64 grow, uint64_t seed, i64 repair_passes, i64 tol_div,
                           i64 window, i64 partners, i64 ratio_lo, i64 ratio_hi) {
    check_same(vit, tok, "slot_balance");
    check_same(weight, tok, "slot_balance");
    if (packs < 1 || repair_passes < 0 || vit_budget < 0 || tol_div < 1 || window < 0 ||
        partners < 0)
      throw std::invalid_argument("slot_balance: packs and tol_div must be >= 1, "
                                  "repair_passes, window and partners >= 0");
    const i64* v = vit.data();
    for (i64 i = 0; i < vit.size(); ++i)
      if (v[i] < 0 || v[i] > vit_budget)
        throw std::invalid_argument("slot_balance: vit values must lie in [0, vit_budget]");
    SlotResult r;
    {
      py::gil_scoped_release release;
      r = slot_balance(v, weight.data(), tok.data(), vit.size(), vit_budget, token_budget,
                       packs, grow, seed, repair_passes, tol_div, window, partners, ratio_lo,
                       ratio_hi);
    }
    return py::make_tuple(to_numpy(r.samples), to_numpy(r.ptr), to_numpy(r.leftover));
  }, py::arg("vit"), py::arg("weight"), py::arg("tokens"), py::arg("vit_budget"),
     py::arg("token_budget"), py::arg("packs"), py::arg("grow"), py::arg("seed"), py::arg("repair_passes"),
     py::arg("tol_div"),
     py::arg("window"), py::arg("partners"), py::arg("ratio_lo"), py::arg("ratio_hi"),
     "Slot balancing into `packs` packs (more, `grow` at a time, while tiles do not fit): "
     "returns (samples, pack_ptr, leftover).");
}
