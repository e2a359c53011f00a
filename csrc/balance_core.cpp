// C++ balancing core (pybind11): the project's PRNG, OmniBal's ISF and our slot-balancing
// packer. megatron_omnibal/balance/reference.py mirrors this file function by function (same
// names, same phases); tests compare the two on random inputs (same seed, same packs), so any
// change here must be made there too. Every function works on positions 0..n-1 of the arrays
// it gets. Parameters come in one struct per packer (IsfParams, SlotParams), built in Python
// from the BalanceConfig.
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
struct IsfParams {
  i64 vit_budget = 0, token_budget = 1, token_threshold = 0, rounds = 1;
  uint64_t seed = 0;
};

Packs isf(const i64* vit, const i64* tok, i64 n, const IsfParams& p) {
  const i64 vit_budget = p.vit_budget, token_budget = p.token_budget;
  struct VT {
    i64 v, t;
  };
  std::vector<VT> vt(n);  // one cache line per sample in the random-order pass
  for (i64 i = 0; i < n; ++i) vt[i] = {vit[i], tok[i]};
  Vec out_samples, out_ptr{0};
  out_samples.reserve(n);
  Vec ids(n), rest;
  for (i64 i = 0; i < n; ++i) ids[i] = i;
  for (i64 r = 0; r < p.rounds && !ids.empty(); ++r) {
    Rng rng(p.seed + static_cast<uint64_t>(r));
    shuffle(ids, rng);
    const bool last = r == p.rounds - 1;
    rest.clear();
    auto close = [&](size_t begin, size_t end, i64 sv, i64 st) {
      Vec& to = last || sv == vit_budget || st >= p.token_threshold ? out_samples : rest;
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
// 0. heavy_samples: samples with more excess than a full pack's other tiles could offset even at
//    a low weight per tile each start a pack of their own, heaviest first, whose tile target is
//    cut to what their weight leaves room for: such a pack ends light in tiles instead of heavy
//    in weight.
// 1. tile_slots: each pack's multiset of tile counts is drawn one at a time, taking the tile
//    count most behind its proportional share, among those that still let the pack hit its tile
//    target exactly. Targets (tile_targets) are the full-pack tiles, except that the packs at the
//    end give up evenly what the data lacks to fill them all (none is left empty). reserve()
//    adds packs (`grow` at a time) while tiles are left without a slot.
// 2. place_samples: samples into slots of their tile count (tiles stay exact): samples of
//    positive excess, largest first, each to the pack that most lacks weight; then those of
//    negative excess, most negative first, each to the pack with the most
//    (longest-processing-time-first). weight_targets() sets what each pack should carry.
// 3. repair: a pack off its weight target by more than the tolerance swaps one sample for one of
//    equal tiles in any other pack, the swap that best lowers the larger of the two deviations;
//    candidates are the `window` samples on either side of the weight that would halve it.
// Budgets are hard: a sample is only ever placed where the pack's tiles (placed and reserved)
// and tokens stay within them.
using i128 = __int128;
using Slots = std::vector<std::vector<std::pair<i64, i64>>>;  // per pack: (tile count, slots)

i128 abs128(i128 x) { return x < 0 ? -x : x; }

struct SlotParams {
  i64 vit_budget = 0, token_budget = 1;
  i64 packs = 1, grow = 0;  // packs to start with; packs added at a time while tiles do not fit
  uint64_t seed = 0;
  i64 repair_passes = 0, tol_div = 400, window = 8, partners = 4;
  i64 ratio_lo = 0, ratio_hi = 0;  // weight per tile x1024: low (heavy samples), high (reach)
};

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

struct Keyed {
  i128 key;
  i64 rank, id;
};

// The samples, their totals and their shuffled order (ties in every sort go by this order).
struct Data {
  const i64 *vit, *w, *tok;
  i64 n = 0, sum_v = 0, sum_w = 0, sum_t = 0, w_tiled = 0, w_text = 0, vmax = 0, text_max = 0;
  Vec count;     // samples per tile count
  Vec shuffled;  // positions in random order
};

Data describe(const i64* vit, const i64* w, const i64* tok, i64 n, const SlotParams& p) {
  Data d{vit, w, tok};
  d.n = n;
  d.count.assign(p.vit_budget + 1, 0);
  for (i64 i = 0; i < n; ++i) {
    d.sum_v += vit[i];
    d.sum_w += w[i];
    d.sum_t += tok[i];
    (vit[i] > 0 ? d.w_tiled : d.w_text) += w[i];
    d.count[vit[i]] += 1;
    d.vmax = std::max(d.vmax, vit[i]);
    if (vit[i] == 0) d.text_max = std::max(d.text_max, w[i]);
  }
  d.shuffled.resize(n);
  for (i64 i = 0; i < n; ++i) d.shuffled[i] = i;
  Rng rng(p.seed);
  shuffle(d.shuffled, rng);
  return d;
}

// Tiles of a full pack: the tile budget, or fewer if the token budget binds first at the data's
// tokens per tile, or if fewer suffice to hold all tiles (never fewer than the largest sample's).
i64 full_pack_tiles(const Data& d, const SlotParams& p, i64 packs) {
  if (d.sum_v == 0) return 0;
  const i64 by_tokens = static_cast<i64>(static_cast<i128>(p.token_budget) * d.sum_v /
                                         std::max<i64>(d.sum_t, 1));
  return std::min<i64>(p.vit_budget,
                       std::max<i64>(d.vmax, std::min<i64>(by_tokens,
                                                           (d.sum_v + packs - 1) / packs)));
}

std::vector<i128> excess_keys(const Data& d, i64 packs) {
  const i128 mulv = d.sum_v > 0 ? d.sum_v : 1;
  std::vector<i128> key(d.n);
  for (i64 i = 0; i < d.n; ++i)
    key[i] = static_cast<i128>(packs) *
             (static_cast<i128>(d.w[i]) * mulv - static_cast<i128>(d.vit[i]) * d.sum_w);
  return key;
}

// Phase 0: the heavy samples, heaviest first, at most one per pack.
std::vector<Keyed> heavy_samples(const Data& d, const SlotParams& p,
                                 const std::vector<i128>& key, i64 fill, i64 packs) {
  std::vector<Keyed> heavy;
  for (i64 r = 0; r < d.n; ++r) {
    const i64 i = d.shuffled[r], c = d.vit[i];
    if (c == 0 || c > fill) continue;
    const i128 excess =
        1024 * (static_cast<i128>(d.w[i]) * d.sum_v - static_cast<i128>(c) * d.sum_w);
    const i128 offset = static_cast<i128>(fill - c) *
                        (1024 * static_cast<i128>(d.sum_w) - static_cast<i128>(p.ratio_lo) * d.sum_v);
    if (excess > offset) heavy.push_back({key[i], r, i});
  }
  std::sort(heavy.begin(), heavy.end(), [](const Keyed& a, const Keyed& b) {
    return a.key != b.key ? a.key > b.key : a.rank < b.rank;
  });
  if (static_cast<i64>(heavy.size()) > packs) heavy.resize(packs);
  return heavy;
}

// Packs, their heavy samples and tile slots (phases 0 and 1).
struct Reservation {
  i64 packs = 0, fill = 0;
  std::vector<i128> key;
  std::vector<Keyed> heavy;  // heavy[k] starts pack k
  Vec tiles, cap, limit;     // tiles reserved per pack; heavy packs' cut target (-1: none)
  std::vector<char> pre;     // sample placed in phase 0
  Slots free;
  i64 short_tiles = 0;  // tiles of samples left without a slot
};

// Tile target of each pack: `fill`, a heavy pack's cap; with `cut`, if the targets exceed the
// tiles there are, the last packs give the excess up evenly, each at most half a full pack, so
// that no pack is left empty by the rounding of the pack count to whole steps. It fails (tiles
// left without a slot: reserve() then drops the cut) when large samples are left for the end.
Vec tile_targets(const Data& d, i64 packs, i64 fill, const Vec& cap, bool cut) {
  Vec limit(packs, fill);
  i64 total = 0;
  Vec light;  // packs that may give up tiles, last first
  for (i64 p = packs - 1; p >= 0; --p) {
    if (cap[p] >= 0) limit[p] = cap[p]; else light.push_back(p);
    total += limit[p];
  }
  const i64 excess = total - d.sum_v, most = fill / 2;
  if (!cut || excess <= 0 || most <= 0 || light.empty()) return limit;
  const i64 k = std::min<i64>(static_cast<i64>(light.size()), (excess + most - 1) / most);
  for (i64 j = 0; j < k; ++j) {
    const i64 cut = excess / k + (j < excess % k ? 1 : 0);
    limit[light[j]] -= std::min(cut, limit[light[j]]);
  }
  return limit;
}

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
// slot); `tiles`: tiles already placed per pack; `limit`: each pack's tile target. Text-only
// slots go where the expected weight is lowest (w_tiled / w_text: weight with / without tiles).
Slots tile_slots(Vec& count, const Vec& limit, i64 vit_budget, i64 w_tiled, i64 w_text,
                 Vec& tiles) {
  const i64 packs = static_cast<i64>(limit.size());
  std::vector<char> reach(vit_budget + 1);
  rebuild_reach(count, reach);
  Slots slots(packs);
  i64 sum_v = 0;
  for (i64 c = 1; c <= vit_budget; ++c) sum_v += c * count[c];
  for (i64 p = 0; p < packs; ++p) sum_v += tiles[p];
  const Vec total(count);
  i64 placed = 0;
  for (i64 p = 0; p < packs; ++p) {
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
    count[0] = 0;
  }
  for (auto& s : slots) std::sort(s.begin(), s.end());
  return slots;
}

// Phases 0 and 1 for `packs` packs; while tiles are left over, more packs (`grow` at a time).
Reservation reserve(const Data& d, const SlotParams& p) {
  Reservation r;
  r.packs = p.packs;
  while (true) {
    r.fill = full_pack_tiles(d, p, r.packs);
    r.key = excess_keys(d, r.packs);
    r.heavy = heavy_samples(d, p, r.key, r.fill, r.packs);
    r.tiles.assign(r.packs, 0);
    r.cap.assign(r.packs, -1);
    r.pre.assign(d.n, 0);
    Vec left(d.count);
    for (size_t k = 0; k < r.heavy.size(); ++k) {
      const i64 h = r.heavy[k].id, c = d.vit[h];
      const i128 room_w = static_cast<i128>(d.sum_w) - static_cast<i128>(r.packs) * d.w[h];
      const i128 more = room_w > 0 && p.ratio_lo > 0
                            ? room_w * 1024 / (static_cast<i128>(r.packs) * p.ratio_lo) : 0;
      r.cap[k] = c + static_cast<i64>(std::min<i128>(r.fill - c, more));
      r.tiles[k] = c;
      left[c] -= 1;
      r.pre[h] = 1;
    }
    // Targets with the end packs' cut first; if tiles then find no slot (sums that cannot be
    // made exactly), no cut; only then more packs.
    const Vec seated(r.tiles), count(left);
    for (const bool cut : {true, false}) {
      r.tiles = seated;
      left = count;
      r.limit = tile_targets(d, r.packs, r.fill, r.cap, cut);
      r.free = tile_slots(left, r.limit, p.vit_budget, d.w_tiled, d.w_text, r.tiles);
      r.short_tiles = 0;
      for (i64 c = 1; c <= p.vit_budget; ++c) r.short_tiles += c * left[c];
      if (r.short_tiles == 0) break;
    }
    if (r.short_tiles == 0 || p.grow <= 0) break;
    r.packs += p.grow * std::max<i64>(1, (r.short_tiles + r.fill * p.grow - 1) /
                                             (r.fill * p.grow));
  }
  return r;
}

// What each pack should carry (key units, weight * unit): one common level W for every pack
// that can carry it (tiles * a high weight per tile, ratio_hi / 1024, plus its text-only slots *
// the heaviest text-only sample, reaches W; heavy packs always), the rest what they can carry;
// W is the least level at which the targets hold all the weight. The largest pack of a step is
// what its ranks wait for, so the level is what matters. `need`: target minus what the slots'
// tiles are expected to bring.
struct Targets {
  i128 unit = 0;
  std::vector<i128> target, need;
};

Targets weight_targets(const Data& d, const SlotParams& p, const Reservation& r) {
  Targets t;
  const i64 packs = r.packs;
  const i128 mulv = d.sum_v > 0 ? d.sum_v : 1;
  t.unit = mulv * packs;
  std::vector<i128> reach_w(packs);
  const i128 no_limit = static_cast<i128>(d.sum_w + 1) * t.unit;
  for (i64 q = 0; q < packs; ++q) {
    i64 text_slots = 0;
    for (const auto& [c, k] : r.free[q])
      if (c == 0) text_slots = k;
    reach_w[q] = r.cap[q] >= 0 || d.sum_v == 0
                     ? no_limit
                     : static_cast<i128>(r.tiles[q]) * p.ratio_hi * t.unit / 1024 +
                           static_cast<i128>(text_slots) * d.text_max * t.unit;
  }
  auto held = [&](i128 level) {
    i128 total = 0;
    for (i64 q = 0; q < packs; ++q) total += std::min(level * t.unit, reach_w[q]);
    return total;
  };
  i128 lo_w = 0, hi_w = d.sum_w;  // held(hi_w) >= sum_w * unit unless the reach is too small
  while (lo_w < hi_w) {
    const i128 mid = (lo_w + hi_w) / 2;
    if (held(mid) >= static_cast<i128>(d.sum_w) * t.unit) hi_w = mid; else lo_w = mid + 1;
  }
  t.target.resize(packs);
  t.need.resize(packs);
  for (i64 q = 0; q < packs; ++q) {
    t.target[q] = std::min(lo_w * t.unit, reach_w[q]);
    t.need[q] = t.target[q] - static_cast<i128>(packs) * r.tiles[q] * d.sum_w;
  }
  return t;
}

struct Packing {
  std::vector<Vec> members;
  Vec pack_tokens, committed;  // tokens placed; tiles placed or reserved by open slots
  Vec leftover;
};

// Phase 2. A sample whose slots all lack token room goes to the neediest pack with room for its
// tiles (placed and reserved) and tokens; with none, to `leftover`.
Packing place_samples(const Data& d, const SlotParams& p, Reservation& r, Targets& t) {
  const i64 packs = r.packs;
  Packing out;
  out.members.assign(packs, {});
  out.pack_tokens.assign(packs, 0);
  out.committed = r.tiles;
  for (size_t k = 0; k < r.heavy.size(); ++k) {
    out.members[k].push_back(r.heavy[k].id);
    t.need[k] -= r.heavy[k].key;
    out.pack_tokens[k] += d.tok[r.heavy[k].id];
  }
  std::vector<Keyed> positive, negative;
  for (i64 q = 0; q < d.n; ++q) {
    const i64 i = d.shuffled[q];
    if (!r.pre[i]) (r.key[i] >= 0 ? positive : negative).push_back({r.key[i], q, i});
  }
  std::sort(positive.begin(), positive.end(), [](const Keyed& a, const Keyed& b) {
    return a.key != b.key ? a.key > b.key : a.rank < b.rank;
  });
  std::sort(negative.begin(), negative.end(), [](const Keyed& a, const Keyed& b) {
    return a.key != b.key ? a.key < b.key : a.rank < b.rank;
  });
  auto slot_of = [&](i64 q, i64 c) -> i64* {
    for (auto& e : r.free[q])
      if (e.first == c) return &e.second;
    return nullptr;
  };
  // Needs only fall while positive samples are placed and only rise while negative ones are, so
  // a heap entry with a stale need is re-queued with the current one (lazy update).
  auto place = [&](const std::vector<Keyed>& items, auto cmp) {
    using Heap = std::priority_queue<HeapItem, std::vector<HeapItem>, decltype(cmp)>;
    std::vector<Heap> heaps(p.vit_budget + 1, Heap(cmp));
    for (i64 q = 0; q < packs; ++q)
      for (const auto& [c, k] : r.free[q])
        if (k > 0) heaps[c].push({t.need[q], q});
    std::vector<HeapItem> stash;
    for (const Keyed& item : items) {
      const i64 i = item.id, c = d.vit[i];
      Heap& heap = heaps[c];
      i64 chosen = -1;
      stash.clear();
      while (!heap.empty()) {
        const HeapItem e = heap.top();
        heap.pop();
        i64* k = slot_of(e.pack, c);
        if (k == nullptr || *k == 0) continue;
        if (e.need != t.need[e.pack]) {
          heap.push({t.need[e.pack], e.pack});
          continue;
        }
        if (out.pack_tokens[e.pack] + d.tok[i] > p.token_budget) {
          stash.push_back(e);
          continue;
        }
        chosen = e.pack;
        break;
      }
      for (const HeapItem& e : stash) heap.push(e);
      const bool in_slot = chosen >= 0;
      if (!in_slot) {
        for (i64 q = 0; q < packs; ++q)
          if (out.committed[q] + c <= p.vit_budget &&
              out.pack_tokens[q] + d.tok[i] <= p.token_budget &&
              (chosen < 0 || t.need[q] > t.need[chosen]))
            chosen = q;
        if (chosen < 0) {
          out.leftover.push_back(i);
          continue;
        }
        out.committed[chosen] += c;
      }
      out.members[chosen].push_back(i);
      out.pack_tokens[chosen] += d.tok[i];
      t.need[chosen] -= item.key;
      if (!in_slot) continue;
      i64* k = slot_of(chosen, c);
      *k -= 1;
      if (*k > 0) heap.push({t.need[chosen], chosen});
    }
  };
  place(positive, MaxFirst());
  place(negative, MinFirst());
  return out;
}

// Phase 3: swaps of equal-tile samples between packs (deviations in key units; a pack is fine
// within target / tol_div).
void repair(const Data& d, const SlotParams& p, const Reservation& r, const Targets& t,
            Packing& pk) {
  const i64 packs = r.packs, n = d.n;
  const i64 *vit = d.vit, *w = d.w, *tok = d.tok;
  const i128 unit = t.unit;
  Vec pack_of(n, -1);
  std::vector<i128> dev(packs), tol(packs);
  for (i64 q = 0; q < packs; ++q) {
    i64 sw = 0;
    for (i64 i : pk.members[q]) {
      pack_of[i] = q;
      sw += w[i];
    }
    dev[q] = sw * unit - t.target[q];
    tol[q] = t.target[q] / p.tol_div;
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
  Vec cls_start(p.vit_budget + 2, 0);
  for (const ByWeight& e : by_w) cls_start[e.vit + 1] += 1;
  for (i64 c = 0; c <= p.vit_budget; ++c) cls_start[c + 1] += cls_start[c];
  // Heavy packs are what a step waits for; light ones only lower its mean a little, so they are
  // repaired only when far off (UNDER_FACTOR tolerances). A pack that finds no swap 8 times is
  // left alone.
  constexpr i64 UNDER_FACTOR = 4;
  auto bad = [&](i64 q) { return dev[q] > tol[q] || dev[q] < -UNDER_FACTOR * tol[q]; };
  Vec work, next;
  std::vector<char> queued(packs, 0), fails(packs, 0);
  for (i64 q = 0; q < packs; ++q)
    if (bad(q)) work.push_back(q);
  // Partners beyond the window: the most deviating packs of the other sign, best pair swap.
  Vec over, under;
  auto extremes = [&](Vec& out, bool positive, size_t want) {
    out.clear();
    for (i64 q = 0; q < packs; ++q)
      if (positive ? dev[q] > 0 : dev[q] < 0) out.push_back(q);
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
  for (i64 pass = 0; pass < p.repair_passes && !work.empty(); ++pass) {
    std::sort(work.begin(), work.end(), [&](i64 a, i64 b) {
      const i128 da = abs128(dev[a]), db = abs128(dev[b]);
      return da != db ? da > db : a < b;
    });
    for (i64 q : work) queued[q] = 0;
    next.clear();
    extremes(over, true, 2 * work.size() + p.partners);
    extremes(under, false, 2 * work.size() + p.partners);
    size_t next_over = 0, next_under = 0;
    for (i64 q0 : work) {
      if (!bad(q0)) continue;
      i128 best = abs128(dev[q0]);
      i64 bx = -1, by = -1;
      auto consider = [&](i64 x, i64 y) {
        const i64 q = pack_of[y];
        if (q == q0 || vit[x] != vit[y]) return;
        if (pk.pack_tokens[q0] - tok[x] + tok[y] > p.token_budget ||
            pk.pack_tokens[q] - tok[y] + tok[x] > p.token_budget)
          return;
        const i128 delta = (w[x] - w[y]) * unit;
        const i128 cost = std::max(abs128(dev[q0] - delta), abs128(dev[q] + delta));
        if (cost < best) {
          best = cost;
          bx = x;
          by = y;
        }
      };
      for (i64 x : pk.members[q0]) {
        const i64 c = vit[x], lo = cls_start[c], hi = cls_start[c + 1];
        const i64 want = w[x] - static_cast<i64>(dev[q0] / (2 * unit));
        const i64 k = std::lower_bound(by_w.begin() + lo, by_w.begin() + hi, want,
                                       [](const ByWeight& e, i64 value) { return e.w < value; }) -
                      by_w.begin();
        // Outward from k, the first `window` candidates on each side in packs that are not
        // off the same way as q0 (those could not take the difference), within 4 * window.
        for (const i64 step : {i64{1}, i64{-1}}) {
          i64 taken = 0;
          for (i64 j = step > 0 ? k : k - 1, seen = 0;
               j >= lo && j < hi && taken < p.window && seen < 4 * p.window; j += step, ++seen) {
            const i64 q = pack_of[by_w[j].id];
            if (dev[q0] > 0 ? dev[q] > tol[q] : dev[q] < -tol[q]) continue;
            consider(x, by_w[j].id);
            taken += 1;
          }
        }
      }
      const Vec& other = dev[q0] > 0 ? under : over;
      size_t& at = dev[q0] > 0 ? next_under : next_over;
      for (i64 s = 0; s < p.partners && at < other.size(); ++s, ++at)
        for (i64 x : pk.members[q0])
          for (i64 y : pk.members[other[at]]) consider(x, y);
      if (bx < 0) {
        if (++fails[q0] < 8 && !queued[q0]) {  // nothing now; the packs around it may change
          queued[q0] = 1;
          next.push_back(q0);
        }
        continue;
      }
      const i64 q = pack_of[by];
      const i128 delta = (w[bx] - w[by]) * unit;
      dev[q0] -= delta;
      dev[q] += delta;
      pk.pack_tokens[q0] += tok[by] - tok[bx];
      pk.pack_tokens[q] += tok[bx] - tok[by];
      *std::find(pk.members[q0].begin(), pk.members[q0].end(), bx) = by;
      *std::find(pk.members[q].begin(), pk.members[q].end(), by) = bx;
      pack_of[bx] = q;
      pack_of[by] = q0;
      for (i64 s : {q0, q})
        if (bad(s) && !queued[s]) {
          queued[s] = 1;
          next.push_back(s);
        }
    }
    work.swap(next);
  }
}

struct SlotResult {
  Vec samples, ptr, leftover;
};

SlotResult slot_balance(const i64* vit, const i64* w, const i64* tok, i64 n,
                        const SlotParams& p) {
  const Data d = describe(vit, w, tok, n, p);
  Reservation r = reserve(d, p);
  Targets t = weight_targets(d, p, r);
  Packing pk = place_samples(d, p, r, t);
  if (p.repair_passes > 0) repair(d, p, r, t, pk);
  SlotResult res;
  res.ptr.push_back(0);
  for (const Vec& m : pk.members) {
    res.samples.insert(res.samples.end(), m.begin(), m.end());
    res.ptr.push_back(static_cast<i64>(res.samples.size()));
  }
  res.leftover = pk.leftover;
  return res;
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

PYBIND11_MODULE(_balance_core, m) {
  m.doc() = "megatron-omnibal balancing core: splitmix64 PRNG, ISF, slot balancing";

  py::class_<IsfParams>(m, "IsfParams", "Parameters of isf(): budgets, threshold, rounds, seed.")
      .def(py::init<>())
      .def_readwrite("vit_budget", &IsfParams::vit_budget)
      .def_readwrite("token_budget", &IsfParams::token_budget)
      .def_readwrite("token_threshold", &IsfParams::token_threshold)
      .def_readwrite("rounds", &IsfParams::rounds)
      .def_readwrite("seed", &IsfParams::seed);

  py::class_<SlotParams>(m, "SlotParams", "Parameters of slot_balance() (see the source).")
      .def(py::init<>())
      .def_readwrite("vit_budget", &SlotParams::vit_budget)
      .def_readwrite("token_budget", &SlotParams::token_budget)
      .def_readwrite("packs", &SlotParams::packs)
      .def_readwrite("grow", &SlotParams::grow)
      .def_readwrite("seed", &SlotParams::seed)
      .def_readwrite("repair_passes", &SlotParams::repair_passes)
      .def_readwrite("tol_div", &SlotParams::tol_div)
      .def_readwrite("window", &SlotParams::window)
      .def_readwrite("partners", &SlotParams::partners)
      .def_readwrite("ratio_lo", &SlotParams::ratio_lo)
      .def_readwrite("ratio_hi", &SlotParams::ratio_hi);

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

  m.def("isf", [](Arr vit, Arr tok, const IsfParams& p) {
    check_same(vit, tok, "isf");
    if (p.rounds < 1) throw std::invalid_argument("isf: rounds must be >= 1");
    Packs r;
    {
      py::gil_scoped_release release;
      r = isf(vit.data(), tok.data(), vit.size(), p);
    }
    return py::make_tuple(to_numpy(r.first), to_numpy(r.second));
  }, py::arg("vit"), py::arg("tokens"), py::arg("params"),
     "OmniBal ISF: returns (samples, pack_ptr) over positions of the input arrays.");

  m.def("slot_balance", [](Arr vit, Arr weight, Arr tok, const SlotParams& p) {
    check_same(vit, tok, "slot_balance");
    check_same(weight, tok, "slot_balance");
    if (p.packs < 1 || p.repair_passes < 0 || p.vit_budget < 0 || p.tol_div < 1 ||
        p.window < 0 || p.partners < 0 || p.grow < 0)
      throw std::invalid_argument("slot_balance: packs and tol_div must be >= 1, "
                                  "grow, repair_passes, window and partners >= 0");
    const i64* v = vit.data();
    for (i64 i = 0; i < vit.size(); ++i)
      if (v[i] < 0 || v[i] > p.vit_budget)
        throw std::invalid_argument("slot_balance: vit values must lie in [0, vit_budget]");
    SlotResult r;
    {
      py::gil_scoped_release release;
      r = slot_balance(v, weight.data(), tok.data(), vit.size(), p);
    }
    return py::make_tuple(to_numpy(r.samples), to_numpy(r.ptr), to_numpy(r.leftover));
  }, py::arg("vit"), py::arg("weight"), py::arg("tokens"), py::arg("params"),
     "Slot balancing into params.packs packs (more, params.grow at a time, while tiles do not "
     "fit): returns (samples, pack_ptr, leftover).");
}
