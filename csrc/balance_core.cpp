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
template <class T>
void shuffle(std::vector<T>& a, Rng& rng) {
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
  struct Sample {  // shuffled whole, so that the filling pass reads in order
    i64 id, v, t;
  };
  std::vector<Sample> ids(n), rest;
  for (i64 i = 0; i < n; ++i) ids[i] = {i, vit[i], tok[i]};
  Vec out_samples, out_ptr{0};
  out_samples.reserve(n);
  for (i64 r = 0; r < p.rounds && !ids.empty(); ++r) {
    Rng rng(p.seed + static_cast<uint64_t>(r));
    shuffle(ids, rng);
    const bool last = r == p.rounds - 1;
    rest.clear();
    auto close = [&](size_t begin, size_t end, i64 sv, i64 st) {
      if (last || sv == vit_budget || st >= p.token_threshold) {
        for (size_t k = begin; k < end; ++k) out_samples.push_back(ids[k].id);
        out_ptr.push_back(static_cast<i64>(out_samples.size()));
      } else {
        rest.insert(rest.end(), ids.begin() + static_cast<std::ptrdiff_t>(begin),
                    ids.begin() + static_cast<std::ptrdiff_t>(end));
      }
    };
    size_t begin = 0;
    i64 sv = 0, st = 0;
    for (size_t k = 0; k < ids.size(); ++k) {
      const Sample& x = ids[k];
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
// Two weights per sample: `w` (the tokens), placed and repaired, and `w2` (the modeled time,
// tokens plus attention; zeros: none), repaired beside it. Weights are balanced in units of
// "excess": a sample's weight beyond what the data's weight per tile predicts for its tiles
// (key = packs * (w * sum_v - vit * sum_w), exact in 128 bits).
// 0. heavy_samples: samples with more excess than a full pack's other tiles could offset even at
//    a low weight per tile each start a pack of their own, heaviest first, whose tile target is
//    cut (heavy_cuts) to what their weight leaves room for: such a pack ends light in tiles
//    instead of heavy in weight. The cuts share the tiles the packs have to spare
//    (share_slack); when more than `max_uncut` packs would go without theirs, reserve() adds
//    packs first.
// 1. tile_slots: each pack's multiset of tile counts (compose_pack) is the one that keeps every
//    tile count closest to its proportional share, and hits the pack's tile target exactly.
//    Targets (tile_targets) are the full-pack tiles, except that the packs at the end give up
//    evenly what the data lacks to fill them all (none is left empty). refill_end() repairs an
//    end game with samples left over; reserve() adds packs (`grow` at a time) while tiles are
//    still left without a slot.
// 2. place_samples: samples into slots of their tile count (tiles stay exact): samples of
//    positive excess, largest first, each to the pack that most lacks weight; then those of
//    negative excess, most negative first, each to the pack with the most
//    (longest-processing-time-first). weight_targets() sets what each pack should carry.
// 3. repair: a pack off its target in either weight swaps one sample for one of equal tiles in
//    another pack, the swap that best lowers the worse of the two packs' deviations (both
//    weights, each in units of its tolerance); candidates are the `window` samples on either
//    side of the weight, and of the second weight, that would halve the deviation.
// Budgets are hard: a sample is only ever placed where the pack's tiles (placed and reserved)
// and tokens stay within them.
using i128 = __int128;
using Slots = std::vector<std::vector<std::pair<i64, i64>>>;  // per pack: (tile count, slots)

struct SlotParams {
  i64 vit_budget = 0, token_budget = 1;
  i64 packs = 1, grow = 0;  // packs to start with; packs added at a time while tiles do not fit
  i64 max_uncut = 0;        // heavy packs that may go without their tile cut before packs grow
  uint64_t seed = 0;
  i64 repair_passes = 0, tol_div = 400, tol2_div = 400, window = 8, partners = 4;
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
  const i64 *vit, *w, *w2, *tok;  // w2: the second weight, balanced beside w by the repair
  i64 n = 0, sum_v = 0, sum_w = 0, sum_w2 = 0, sum_t = 0, w_tiled = 0, w_text = 0, vmax = 0,
      text_max = 0;
  Vec count;     // samples per tile count
  Vec shuffled;  // positions in random order
};

Data describe(const i64* vit, const i64* w, const i64* w2, const i64* tok, i64 n,
              const SlotParams& p) {
  Data d{vit, w, w2, tok};
  d.n = n;
  d.count.assign(p.vit_budget + 1, 0);
  for (i64 i = 0; i < n; ++i) {
    d.sum_v += vit[i];
    d.sum_w += w[i];
    d.sum_w2 += w2[i];
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

constexpr i64 AHEAD = 16;  // samples read ahead (prefetched) where they are read in random order

// Phase 0: the heavy samples, heaviest first, at most one per pack.
std::vector<Keyed> heavy_samples(const Data& d, const SlotParams& p,
                                 const std::vector<i128>& key, i64 fill, i64 packs) {
  std::vector<Keyed> heavy;
  for (i64 r = 0; r < d.n; ++r) {
    if (r + AHEAD < d.n) {
      __builtin_prefetch(&d.vit[d.shuffled[r + AHEAD]]);
      __builtin_prefetch(&d.w[d.shuffled[r + AHEAD]]);
    }
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

// Tiles each heavy sample's pack gives up (what the rest of the pack cannot fill at the data's
// low weight per tile, ratio_lo / 1024, never below the sample's own tiles): `cut` so that the
// pack can carry the mean weight, `hard` so that it can stay within the token budget (the
// weight is the tokens, or close to them).
struct Cuts {
  Vec cut, hard;
};

Cuts heavy_cuts(const Data& d, const SlotParams& p, const std::vector<Keyed>& heavy, i64 fill,
                i64 packs) {
  Cuts out{Vec(heavy.size(), 0), Vec(heavy.size(), 0)};
  auto tiles_for = [&](i128 room, i128 per) {  // tiles `room` holds at ratio_lo, x `per`
    return room > 0 && p.ratio_lo > 0 ? room * 1024 / (per * p.ratio_lo) : i128{0};
  };
  for (size_t k = 0; k < heavy.size(); ++k) {
    const i64 h = heavy[k].id, c = d.vit[h];
    const i128 more = tiles_for(static_cast<i128>(d.sum_w) - static_cast<i128>(packs) * d.w[h],
                                packs);
    const i128 room = tiles_for(static_cast<i128>(p.token_budget) - d.tok[h], 1);
    out.cut[k] = fill - c - static_cast<i64>(std::min<i128>(fill - c, more));
    out.hard[k] = std::min(out.cut[k], fill - c - static_cast<i64>(std::min<i128>(fill - c, room)));
  }
  return out;
}

// The cuts within the tiles the packs have to spare (`slack`: full-pack tiles of all packs minus
// the tiles there are), so that cutting costs no packs: every hard cut, then the rest of the
// cuts, smallest first, as many whole as fit. A pack left with its hard cut only stays over its
// weight target (a partial cut would leave it over anyway, and uneven with the others); the
// layout gives such packs steps of their own.
Vec share_slack(const Cuts& c, i64 slack) {
  Vec cut(c.hard);
  std::vector<size_t> order;
  for (size_t k = 0; k < cut.size(); ++k) {
    slack -= c.hard[k];
    if (c.cut[k] > c.hard[k]) order.push_back(k);
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return c.cut[a] - c.hard[a] < c.cut[b] - c.hard[b];
  });
  for (const size_t k : order) {
    const i64 extra = c.cut[k] - c.hard[k];
    if (extra <= slack) {
      cut[k] = c.cut[k];
      slack -= extra;
    }
  }
  return cut;
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

void add_slot(std::vector<std::pair<i64, i64>>& slots, i64 c) {
  for (auto& e : slots)
    if (e.first == c) {
      e.second += 1;
      return;
    }
  slots.emplace_back(c, 1);
}

i128 floor_div(i128 a, i128 b) {  // rounding toward -infinity, as Python's //
  constexpr i128 lo = INT64_MIN, hi = INT64_MAX;
  if (a >= lo && a <= hi && b > 0 && b <= hi) {  // 64-bit division: several times faster
    const i64 x = static_cast<i64>(a), y = static_cast<i64>(b), q = x / y;
    return x % y != 0 && x < 0 ? q - 1 : q;
  }
  const i128 q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// One pack's tile counts summing to `rest` exactly (or as close below as the counts allow):
// the multiset that keeps every tile count c closest to its share of the packs that can hold
// it, i.e. least sum over c of total[c] * (used[c] / total[c] - done[c] / room[c])^2 after the
// pack (fixed point, x 2^16), room[c] the tile targets of all packs with room for c, done[c]
// those of the packs composed so far, this one included. A bounded knapsack over the sum:
// counts ascending, each taken k times at cost k (2 ahead[c] + k room[c]) / (total[c] room[c]),
// `ahead` how far c is ahead of its share. Unlike a count-by-count choice it looks at the whole
// pack, so small counts are not used up early closing odd remainders (which leaves large counts
// with no holes at the end); and large counts are used up while packs large enough for them
// remain (the end packs that give up tiles cannot take them).
struct ComposeBuffers {  // compose_pack's tables, kept across the packs of tile_slots
  std::vector<std::vector<i128>> step_cost;  // per tile count present: cost of taking it k times
  std::vector<i128> cost, next;
  std::vector<i64> cost64, next64;
  std::vector<char> ok, next_ok;
  std::vector<Vec> took;  // per tile count present: the k that reached each sum
  Vec kinds, out;
};

// The knapsack over the sums 0..rest in cost type C: i64 where every sum of step costs provably
// fits it (the same choices as in 128 bits, several times faster), else i128.
template <class C>
void knapsack(i64 rest, ComposeBuffers& b, std::vector<C>& cost, std::vector<C>& next) {
  cost.assign(rest + 1, 0);
  b.ok.assign(rest + 1, 0);
  b.ok[0] = 1;
  for (size_t j = 0; j < b.kinds.size(); ++j) {
    const i64 c = b.kinds[j];
    const std::vector<i128>& step = b.step_cost[j];
    const i64 most = static_cast<i64>(step.size()) - 1;
    next = cost;
    b.next_ok = b.ok;
    Vec& k_at = b.took[j];
    k_at.assign(rest + 1, 0);
    // raw pointers: stores through the char flags would otherwise reload the vectors' own
    const C* from = cost.data();
    C* to = next.data();
    const char* ok = b.ok.data();
    char* to_ok = b.next_ok.data();
    i64* took = k_at.data();
    for (i64 s = 0; s < rest; ++s) {
      if (!ok[s]) continue;
      const C base = from[s];
      for (i64 k = 1, t = s + c; k <= most && t <= rest; ++k, t += c) {
        const C v = base + static_cast<C>(step[k]);
        if (!to_ok[t] || v < to[t]) {
          to[t] = v;
          to_ok[t] = 1;
          took[t] = k;
        }
      }
    }
    cost.swap(next);
    b.ok.swap(b.next_ok);
  }
}

const Vec& compose_pack(const Vec& count, const Vec& total, const Vec& room, const Vec& done,
                        i64 rest, ComposeBuffers& b) {
  b.kinds.clear();
  i128 largest = 0;  // the largest |step cost|
  for (i64 c = 1; c <= rest; ++c) {
    if (count[c] == 0 || room[c] == 0) continue;
    const i128 ahead = static_cast<i128>(total[c] - count[c]) * room[c] -
                       static_cast<i128>(done[c] + rest) * total[c];
    const size_t j = b.kinds.size();
    if (b.took.size() <= j) b.took.emplace_back();
    if (b.step_cost.size() <= j) b.step_cost.emplace_back();
    std::vector<i128>& step = b.step_cost[j];
    const i64 most = std::min(count[c], rest / c);
    step.assign(most + 1, 0);
    for (i64 k = 1; k <= most; ++k) {
      step[k] = floor_div(
          static_cast<i128>(k) * (2 * ahead + static_cast<i128>(k) * room[c]) * 65536,
          static_cast<i128>(total[c]) * room[c]);
      largest = std::max(largest, step[k] < 0 ? -step[k] : step[k]);
    }
    b.kinds.push_back(c);
  }
  // A sum adds at most one step cost per tile count present (at most `rest` of them).
  if (largest <= static_cast<i128>(INT64_MAX / 2) / (rest + 1))
    knapsack(rest, b, b.cost64, b.next64);
  else
    knapsack(rest, b, b.cost, b.next);
  i64 s = rest;
  while (s > 0 && !b.ok[s]) --s;
  b.out.assign(count.size(), 0);
  for (i64 j = static_cast<i64>(b.kinds.size()) - 1; j >= 0; --j) {
    const i64 k = b.took[j][s];
    b.out[b.kinds[j]] = k;
    s -= k * b.kinds[j];
  }
  return b.out;
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

bool any_tiles_left(const Vec& count) {
  for (size_t c = 1; c < count.size(); ++c)
    if (count[c] > 0) return true;
  return false;
}

// The end game of phase 1. compose_pack keeps the mix even but does not look ahead, so the last
// packs can be left with samples that fit no hole (5-tile samples for 3-tile holes). Then the
// packs with holes and the last `span` packs give their slots back and are filled again,
// largest tile count first while the rest stays reachable (small counts kept to close the
// packs); `span` doubles until nothing is left over, up to 1/REFILL_SHARE of the packs (beyond
// that the packs' mix would suffer; reserve() then drops the end packs' cut or adds packs).
constexpr i64 REFILL_SHARE = 8;
void refill_end(Vec& count, const Vec& limit, i64 vit_budget, Vec& tiles, Slots& slots) {
  const i64 packs = static_cast<i64>(limit.size());
  if (!any_tiles_left(count)) return;
  std::vector<char> reach(vit_budget + 1);
  for (i64 span = 2 * (vit_budget + 1); span / 2 < packs / REFILL_SHARE; span *= 2) {
    Vec left(count), filled(tiles);
    Slots trial(slots);
    Vec redo;
    for (i64 q = 0; q < packs; ++q) {
      if (limit[q] <= filled[q] && q < packs - span) continue;
      redo.push_back(q);
      for (const auto& [c, k] : trial[q]) {
        left[c] += k;
        filled[q] -= c * k;
      }
      trial[q].clear();
    }
    rebuild_reach(left, reach);
    for (const i64 q : redo) {
      i64 rest = std::max<i64>(0, limit[q] - filled[q]);
      while (rest > 0) {
        i64 chosen = 0;
        for (i64 c = rest; c >= 1; --c)
          if (left[c] > 0 && reach[rest - c]) {
            chosen = c;
            break;
          }
        if (chosen == 0) break;
        add_slot(trial[q], chosen);
        filled[q] += chosen;
        rest -= chosen;
        left[chosen] -= 1;
        if (left[chosen] == 0) rebuild_reach(left, reach);
      }
    }
    if (!any_tiles_left(left)) {
      count.swap(left);
      tiles.swap(filled);
      slots.swap(trial);
      return;
    }
  }
}

// Phase 1. `count`: samples per tile count not yet placed (on return: those that found no
// slot); `tiles`: tiles already placed per pack; `limit`: each pack's tile target. Text-only
// slots go where the expected weight is lowest (w_tiled / w_text: weight with / without tiles).
Slots tile_slots(Vec& count, const Vec& limit, i64 vit_budget, i64 w_tiled, i64 w_text,
                 Vec& tiles) {
  const i64 packs = static_cast<i64>(limit.size());
  Slots slots(packs);
  i64 slot_tiles = 0, sum_v = 0;
  for (i64 c = 1; c <= vit_budget; ++c) slot_tiles += c * count[c];
  sum_v = slot_tiles;
  for (i64 p = 0; p < packs; ++p) sum_v += tiles[p];
  const Vec total(count);
  Vec host(vit_budget + 1, 0), done(vit_budget + 1, 0);  // per tile count, see compose_pack
  for (i64 p = 0; p < packs; ++p) {
    const i64 open = std::min<i64>(std::max<i64>(0, limit[p] - tiles[p]), vit_budget);
    for (i64 c = 1; c <= open; ++c) host[c] += open;
  }
  i64 placed = 0;
  ComposeBuffers buffers;
  for (i64 p = 0; p < packs && placed < slot_tiles; ++p) {
    const i64 open = std::min<i64>(std::max<i64>(0, limit[p] - tiles[p]), vit_budget);
    const i64 rest = std::min(open, slot_tiles - placed);
    if (rest == 0) continue;
    const Vec& take = compose_pack(count, total, host, done, rest, buffers);
    for (i64 c = 1; c <= open; ++c) done[c] += rest;
    for (i64 c = 1; c <= rest; ++c) {
      if (take[c] == 0) continue;
      slots[p].emplace_back(c, take[c]);
      tiles[p] += c * take[c];
      placed += c * take[c];
      count[c] -= take[c];
    }
  }
  refill_end(count, limit, vit_budget, tiles, slots);
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
constexpr i64 UNCUT_GROWTH = 64;

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
    const Cuts raw = heavy_cuts(d, p, r.heavy, r.fill, r.packs);
    const Vec cut = share_slack(raw, r.packs * r.fill - d.sum_v);
    // More than max_uncut heavy packs left over their target: more packs, if as many as the
    // missing cuts need keep the total within 1/UNCUT_GROWTH more than asked for (beyond that
    // the data is too lumpy for its budgets: more packs would only cost steps).
    if (p.grow > 0) {
      Vec denied;
      for (size_t k = 0; k < cut.size(); ++k)
        if (cut[k] < raw.cut[k]) denied.push_back(raw.cut[k] - cut[k]);
      if (static_cast<i64>(denied.size()) > p.max_uncut) {
        std::sort(denied.begin(), denied.end());
        i64 need = 0;
        for (size_t k = 0; k < denied.size() - static_cast<size_t>(p.max_uncut); ++k)
          need += denied[k];
        const i64 more = p.grow * std::max<i64>(1, (need + r.fill * p.grow - 1) /
                                                       (r.fill * p.grow));
        if (r.packs + more <= p.packs + std::max(p.grow, p.packs / UNCUT_GROWTH)) {
          r.packs += more;
          continue;
        }
      }
    }
    for (size_t k = 0; k < r.heavy.size(); ++k) {
      const i64 h = r.heavy[k].id, c = d.vit[h];
      r.cap[k] = r.fill - cut[k];
      r.tiles[k] = c;
      left[c] -= 1;
      r.pre[h] = 1;
    }
    // Targets with the end packs' cut first; if tiles then find no slot (sums that cannot be
    // made exactly), no end cut; then no heavy cuts either (the data's large samples may need
    // every tile there is: at a 9-tile budget, one 5-tile sample per pack); only then more
    // packs.
    const Vec seated(r.tiles), count(left);
    for (const int attempt : {0, 1, 2, 3}) {
      const bool cut = attempt % 2 == 0;
      if (attempt == 2) r.cap.assign(r.packs, -1);
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
  std::vector<i128> target, need, target2;  // target2: the second weight's, target's share of it
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
  t.target2.resize(packs);
  for (i64 q = 0; q < packs; ++q)
    t.target2[q] = d.sum_w > 0 ? t.target[q] * d.sum_w2 / d.sum_w
                               : static_cast<i128>(d.sum_w2) * t.unit / packs;
  return t;
}

struct Packing {
  std::vector<Vec> members;
  Vec pack_tokens, committed;  // tokens placed; tiles placed or reserved by open slots
  Vec leftover;
};

// Keyed items (built in rank order) by key, descending or ascending, ties by rank: as 64-bit
// (key, position) pairs where the keys fit (the same order, a cheaper sort).
void sort_by_key(std::vector<Keyed>& items, bool descending) {
  bool fits = true;
  for (const Keyed& e : items) fits = fits && e.key >= -INT64_MAX && e.key <= INT64_MAX;
  if (!fits) {
    std::sort(items.begin(), items.end(), [descending](const Keyed& a, const Keyed& b) {
      return a.key != b.key ? (descending ? a.key > b.key : a.key < b.key) : a.rank < b.rank;
    });
    return;
  }
  std::vector<std::pair<i64, i64>> order(items.size());
  for (size_t k = 0; k < items.size(); ++k) {
    const i64 key = static_cast<i64>(items[k].key);
    order[k] = {descending ? -key : key, static_cast<i64>(k)};
  }
  std::sort(order.begin(), order.end());
  std::vector<Keyed> sorted(items.size());
  for (size_t k = 0; k < order.size(); ++k) {
    if (k + AHEAD < order.size()) __builtin_prefetch(&items[order[k + AHEAD].second]);
    sorted[k] = items[order[k].second];
  }
  items.swap(sorted);
}

// Phase 2. A sample whose slots all lack token room goes to the neediest pack with room for its
// tiles (placed and reserved) and tokens; with none, to `leftover`.
Packing place_samples(const Data& d, const SlotParams& p, Reservation& r, Targets& t) {
  const i64 packs = r.packs;
  Packing out;
  out.members.assign(packs, {});
  for (i64 q = 0; q < packs; ++q) {  // room for the heavy sample and the slots: one allocation
    i64 size = 1;
    for (const auto& e : r.free[q]) size += e.second;
    out.members[q].reserve(size);
  }
  out.pack_tokens.assign(packs, 0);
  out.committed = r.tiles;
  for (size_t k = 0; k < r.heavy.size(); ++k) {
    out.members[k].push_back(r.heavy[k].id);
    t.need[k] -= r.heavy[k].key;
    out.pack_tokens[k] += d.tok[r.heavy[k].id];
  }
  std::vector<Keyed> positive, negative;
  for (i64 q = 0; q < d.n; ++q) {
    if (q + AHEAD < d.n) __builtin_prefetch(&r.key[d.shuffled[q + AHEAD]]);
    const i64 i = d.shuffled[q];
    if (!r.pre[i]) (r.key[i] >= 0 ? positive : negative).push_back({r.key[i], q, i});
  }
  sort_by_key(positive, true);
  sort_by_key(negative, false);
  // Open slots per pack and tile count, one row per pack (r.free's lists, looked up directly).
  const i64 width = p.vit_budget + 1;
  std::vector<int32_t> open(packs * width, 0);
  for (i64 q = 0; q < packs; ++q)
    for (const auto& [c, k] : r.free[q]) open[q * width + c] = static_cast<int32_t>(k);
  auto slot_of = [&](i64 q, i64 c) -> int32_t* { return &open[q * width + c]; };
  // Needs only fall while positive samples are placed and only rise while negative ones are, so
  // a heap entry with a stale need is re-queued with the current one (lazy update).
  auto place = [&](const std::vector<Keyed>& items, auto cmp) {
    using Heap = std::priority_queue<HeapItem, std::vector<HeapItem>, decltype(cmp)>;
    std::vector<Heap> heaps(p.vit_budget + 1, Heap(cmp));
    for (i64 q = 0; q < packs; ++q)
      for (const auto& [c, k] : r.free[q])
        if (open[q * width + c] > 0) heaps[c].push({t.need[q], q});
    std::vector<HeapItem> stash;
    for (size_t n_item = 0; n_item < items.size(); ++n_item) {
      if (n_item + AHEAD < items.size()) {
        __builtin_prefetch(&d.vit[items[n_item + AHEAD].id]);
        __builtin_prefetch(&d.tok[items[n_item + AHEAD].id]);
      }
      const Keyed& item = items[n_item];
      const i64 i = item.id, c = d.vit[i];
      Heap& heap = heaps[c];
      i64 chosen = -1;
      stash.clear();
      while (!heap.empty()) {
        const HeapItem e = heap.top();
        heap.pop();
        if (*slot_of(e.pack, c) == 0) continue;
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
      int32_t* k = slot_of(chosen, c);
      *k -= 1;
      if (*k > 0) heap.push({t.need[chosen], chosen});
    }
  };
  place(positive, MaxFirst());
  place(negative, MinFirst());
  return out;
}

// Phase 3: swaps of equal-tile samples between packs, balancing both weights. A pack is off when
// a weight is over its target by more than target / tol_div (tol2_div for the second weight) or
// under it by UNDER_FACTOR times that: heavy packs are what a step waits for, light ones only
// lower its mean a little. How far off a pack is: its worst weight, each in units of its
// tolerance (light deviations count 1 / UNDER_FACTOR), in integers: score = max(pen(dev) * A,
// pen(dev2) * B), pen(d) = d * UNDER_FACTOR if d > 0 else -d, A = tol_div * sum_w2, B =
// tol2_div * sum_w (without a second weight, A = 1 and B = 0). A swap is taken if it lowers the
// larger score of the two packs below the off pack's score; the best such swap among: for each
// member, the `window` samples on either side of the weight (and of the second weight) that
// would halve the pack's deviation, in packs not off the same way, and the members of the
// `partners` most deviating packs of the other sign. A pack that finds no swap 8 times is left.
constexpr i64 UNDER_FACTOR = 4;

struct Scorer {
  i128 a = 1, b = 0;
  static i128 pen(i128 d) { return d > 0 ? d * UNDER_FACTOR : -d; }
  i128 operator()(i128 d1, i128 d2) const { return std::max(pen(d1) * a, pen(d2) * b); }
  // +1 / -1: the sign of the weight that sets the score (ties: the first weight).
  int sign(i128 d1, i128 d2) const {
    const bool second = pen(d2) * b > pen(d1) * a;
    const i128 d = second ? d2 : d1;
    return d > 0 ? 1 : d < 0 ? -1 : 0;
  }
};

// The deviations whose score stays below `best`, as ranges: score(d1, d2) < best exactly when
// lo1 <= d1 <= hi1 and lo2 <= d2 <= hi2 (pen(d) * a < best: pen(d) <= (best - 1) // a, and pen(d)
// <= m: -m <= d <= m // UNDER_FACTOR), so that a swap candidate is tested without products.
struct Below {
  i128 lo1, hi1, lo2, hi2;
  Below(const Scorer& s, i128 best) {
    constexpr i128 huge = static_cast<i128>(1) << 120;
    const i128 m1 = floor_div(best - 1, s.a);
    const i128 m2 = s.b > 0 ? floor_div(best - 1, s.b) : best > 0 ? huge : -1;
    lo1 = -m1;
    hi1 = floor_div(m1, UNDER_FACTOR);
    lo2 = -m2;
    hi2 = floor_div(m2, UNDER_FACTOR);
  }
};

// The weight differences dw = w(x) - w(y) whose change dw * unit keeps `dev - dw * unit` within
// [lo, hi] (the pack giving x for y stays below `best`): [ceil((dev - hi) / unit), floor((dev -
// lo) / unit)], clamped to 64 bits ({1, 0}: none).
std::pair<i64, i64> diff_range(i128 dev, i128 lo, i128 hi, i128 unit) {
  const i128 first = -floor_div(hi - dev, unit), last = floor_div(dev - lo, unit);
  if (first > last || first > INT64_MAX || last < INT64_MIN) return {1, 0};
  return {static_cast<i64>(std::max<i128>(first, INT64_MIN)),
          static_cast<i64>(std::min<i128>(last, INT64_MAX))};
}

// A sample as the repair reads it, in weight order: everything a swap candidate needs in one
// sequential read (its pack kept up to date at every swap through `at`, its place in the run).
struct Entry {
  i64 w, w2, tok;
  int32_t id, pack;
};

// A pack's member as the repair reads it: the pack's members side by side (a swap exchanges one
// for one, so each pack keeps its place), everything the scans need without a lookup per member.
struct Member {
  i64 w, w2, tok;
  int32_t id, tiles;
};

// Every FENCE-th weight of a run, so that a search reads a small array and then one block of
// the run instead of jumping across it (the run does not fit the cache).
constexpr i64 FENCE = 16;

template <class Key>
Vec fences(const std::vector<Entry>& run, Key key) {
  Vec out((run.size() + FENCE - 1) / FENCE);
  for (size_t b = 0; b < out.size(); ++b) out[b] = key(run[b * FENCE]);
  return out;
}

// std::lower_bound over run[lo, hi) (sorted by `key`) for `want`, through the fences.
template <class Key>
i64 fenced_lower_bound(const std::vector<Entry>& run, const Vec& fence, i64 lo, i64 hi,
                       i64 want, Key key) {
  const i64 b_lo = (lo + FENCE - 1) / FENCE, b_hi = (hi + FENCE - 1) / FENCE;
  const i64 b = std::lower_bound(fence.begin() + b_lo, fence.begin() + b_hi, want) -
                fence.begin();
  const i64 from = b > b_lo ? (b - 1) * FENCE : lo, to = b < b_hi ? b * FENCE : hi;
  return std::lower_bound(run.begin() + from, run.begin() + to, want,
                          [key](const Entry& e, i64 value) { return key(e) < value; }) -
         run.begin();
}

// Samples in packs by (tiles, weight, id), and where each tile count starts. Weights in a small
// range (tokens, the modeled time in token units): a counting sort by weight (ids ascending
// within one), then a stable count by tile count; else each tile count's run sorted on
// (weight, id). at[i]: sample i's place.
constexpr i64 COUNTING_RANGE = i64{1} << 22;  // the most weight values a counting sort takes

std::vector<Entry> sorted_by(const i64* vit, const i64* w, const i64* w2, const i64* tok,
                             const i64* key, const Vec& pack_of, i64 vit_budget, Vec& cls_start,
                             std::vector<int32_t>& at) {
  cls_start.assign(vit_budget + 2, 0);
  const i64 n = static_cast<i64>(pack_of.size());
  i64 lo = INT64_MAX, hi = INT64_MIN;
  for (i64 i = 0; i < n; ++i)
    if (pack_of[i] >= 0) {
      cls_start[vit[i] + 1] += 1;
      lo = std::min(lo, key[i]);
      hi = std::max(hi, key[i]);
    }
  for (i64 c = 0; c <= vit_budget; ++c) cls_start[c + 1] += cls_start[c];
  Vec ids(cls_start[vit_budget + 1]);
  Vec next(cls_start.begin(), cls_start.end() - 1);
  if (!ids.empty() && lo >= 0 && hi < COUNTING_RANGE) {
    Vec start(hi + 2, 0), by_key(ids.size());
    for (i64 i = 0; i < n; ++i)
      if (pack_of[i] >= 0) start[key[i] + 1] += 1;
    for (i64 v = 0; v <= hi; ++v) start[v + 1] += start[v];
    for (i64 i = 0; i < n; ++i)
      if (pack_of[i] >= 0) by_key[start[key[i]]++] = i;
    for (size_t k = 0; k < by_key.size(); ++k) {
      if (k + AHEAD < by_key.size()) __builtin_prefetch(&vit[by_key[k + AHEAD]]);
      ids[next[vit[by_key[k]]]++] = by_key[k];
    }
  } else {
    for (i64 i = 0; i < n; ++i)
      if (pack_of[i] >= 0) ids[next[vit[i]]++] = i;
    for (i64 c = 0; c <= vit_budget; ++c)
      std::sort(ids.begin() + cls_start[c], ids.begin() + cls_start[c + 1],
                [key](i64 a, i64 b) { return key[a] != key[b] ? key[a] < key[b] : a < b; });
  }
  std::vector<Entry> by(ids.size());
  for (size_t k = 0; k < ids.size(); ++k) {
    if (k + AHEAD < ids.size()) {
      const i64 ahead = ids[k + AHEAD];
      for (const i64* a : {w, w2, tok}) __builtin_prefetch(&a[ahead]);
      __builtin_prefetch(&pack_of[ahead]);
    }
    const i64 i = ids[k];
    by[k] = {w[i], w2[i], tok[i], static_cast<int32_t>(i), static_cast<int32_t>(pack_of[i])};
    at[i] = static_cast<int32_t>(k);
  }
  return by;
}

// A pack's state as a swap candidate's test reads it: one cache line.
struct alignas(64) PackState {
  i128 dev, dev2;
  i64 tokens;
};
constexpr char OVER = 1, UNDER = 2;  // a pack's bits in off_by (one byte a pack: cache-resident)

void repair(const Data& d, const SlotParams& p, const Reservation& r, const Targets& t,
            Packing& pk) {
  const i64 packs = r.packs, n = d.n;
  if (n > INT32_MAX || packs > INT32_MAX)  // Entry holds ids and packs in 32 bits
    throw std::length_error("slot_balance: the repair takes at most 2^31 - 1 samples and packs");
  const i64 *vit = d.vit, *w = d.w, *w2 = d.w2, *tok = d.tok;
  const i128 unit = t.unit;
  Scorer score;
  if (d.sum_w2 > 0) {
    score.a = static_cast<i128>(p.tol_div) * d.sum_w2;
    score.b = static_cast<i128>(p.tol2_div) * d.sum_w;
  }
  Vec pack_of(n, -1);
  std::vector<PackState> st(packs);
  std::vector<i128> tol(packs), tol2(packs);
  for (i64 q = 0; q < packs; ++q) {
    i64 sw = 0, sw2 = 0;
    for (i64 i : pk.members[q]) {
      pack_of[i] = q;
      sw += w[i];
      sw2 += w2[i];
    }
    st[q].dev = sw * unit - t.target[q];
    st[q].dev2 = sw2 * unit - t.target2[q];
    st[q].tokens = pk.pack_tokens[q];
    tol[q] = t.target[q] / p.tol_div;
    tol2[q] = t.target2[q] / p.tol2_div;
  }
  Vec cls1, cls2;
  std::vector<int32_t> at1(n, -1), at2;
  std::vector<Entry> by_w = sorted_by(vit, w, w2, tok, w, pack_of, p.vit_budget, cls1, at1);
  std::vector<Entry> by_w2;
  if (d.sum_w2 > 0) {
    at2.assign(n, -1);
    by_w2 = sorted_by(vit, w, w2, tok, w2, pack_of, p.vit_budget, cls2, at2);
  }
  pack_of.clear();
  pack_of.shrink_to_fit();
  const Vec fence1 = fences(by_w, [](const Entry& e) { return e.w; });
  const Vec fence2 = fences(by_w2, [](const Entry& e) { return e.w2; });
  // Each pack's members side by side, in the order of pk.members (written back at the end).
  Vec first(packs + 1, 0);
  for (i64 q = 0; q < packs; ++q)
    first[q + 1] = first[q] + static_cast<i64>(pk.members[q].size());
  std::vector<Member> mem(first[packs]);
  for (i64 q = 0; q < packs; ++q)
    for (size_t j = 0; j < pk.members[q].size(); ++j) {
      const i64 i = pk.members[q][j];
      mem[first[q] + static_cast<i64>(j)] = {w[i], w2[i], tok[i], static_cast<int32_t>(i),
                                            static_cast<int32_t>(vit[i])};
    }
  auto off = [](i128 dv, i128 tl, int sign) {  // over (sign > 0) / under its tolerance
    return sign > 0 ? dv > tl : dv < -UNDER_FACTOR * tl;
  };
  // Per pack: over / under by more than its tolerance in either weight (a scan skips such
  // packs on the side of the pack it repairs), kept up to date at every swap.
  std::vector<char> off_by(packs);
  auto mark = [&](i64 q) {
    PackState& s = st[q];
    off_by[q] = static_cast<char>(
        (s.dev > tol[q] || (d.sum_w2 > 0 && s.dev2 > tol2[q]) ? OVER : 0) |
        (s.dev < -tol[q] || (d.sum_w2 > 0 && s.dev2 < -tol2[q]) ? UNDER : 0));
  };
  for (i64 q = 0; q < packs; ++q) mark(q);
  auto bad = [&](i64 q) {
    const PackState& s = st[q];
    return off(s.dev, tol[q], 1) || off(s.dev, tol[q], -1) ||
           (d.sum_w2 > 0 && (off(s.dev2, tol2[q], 1) || off(s.dev2, tol2[q], -1)));
  };
  // Each pack's score and the sign of the weight that sets it, as of the start of a pass: what
  // the pass's orderings compare (most off first, then the lower pack), sorted as (-score, pack)
  // pairs.
  std::vector<i128> pass_score(packs);
  std::vector<signed char> pass_sign(packs);
  std::vector<std::pair<i128, i64>> keyed;
  auto order_worst_first = [&](Vec& qs, size_t want) {  // the `want` most off of qs, in order
    keyed.clear();
    for (const i64 q : qs) keyed.emplace_back(-pass_score[q], q);
    if (keyed.size() > want) {
      std::nth_element(keyed.begin(), keyed.begin() + static_cast<std::ptrdiff_t>(want),
                       keyed.end());
      keyed.resize(want);
    }
    std::sort(keyed.begin(), keyed.end());
    qs.clear();
    for (const auto& e : keyed) qs.push_back(e.second);
  };
  Vec work, next;
  std::vector<char> queued(packs, 0), fails(packs, 0);
  for (i64 q = 0; q < packs; ++q)
    if (bad(q)) work.push_back(q);
  Vec over, under;
  auto extremes = [&](Vec& out, int sign, size_t want) {
    out.clear();
    for (i64 q = 0; q < packs; ++q)
      if (pass_sign[q] == sign) out.push_back(q);
    order_worst_first(out, want);
  };
  for (i64 pass = 0; pass < p.repair_passes && !work.empty(); ++pass) {
    for (i64 q = 0; q < packs; ++q) {
      pass_score[q] = score(st[q].dev, st[q].dev2);
      pass_sign[q] = static_cast<signed char>(score.sign(st[q].dev, st[q].dev2));
    }
    order_worst_first(work, work.size());
    for (i64 q : work) queued[q] = 0;
    next.clear();
    extremes(over, 1, 2 * work.size() + p.partners);
    extremes(under, -1, 2 * work.size() + p.partners);
    size_t next_over = 0, next_under = 0;
    // The packs read next (the next pack of the work list, this one's partners) are fetched
    // ahead, while this pack's scans run.
    auto fetch = [&](i64 q) {
      __builtin_prefetch(&st[q]);
      __builtin_prefetch(mem.data() + first[q]);
    };
    for (size_t at = 0; at < work.size(); ++at) {
      const i64 q0 = work[at];
      if (at + 1 < work.size()) fetch(work[at + 1]);
      if (!bad(q0)) continue;
      const PackState s0 = st[q0];
      const int sign = score.sign(s0.dev, s0.dev2);
      {
        const Vec& ahead = sign > 0 ? under : over;
        for (size_t k = sign > 0 ? next_under : next_over, s = 0;
             k < ahead.size() && s < static_cast<size_t>(p.partners); ++k, ++s)
          fetch(ahead[k]);
      }
      i128 best = score(s0.dev, s0.dev2);
      i64 bx = -1, by = -1;
      // What a swap must keep below `best` (both packs' scores): q0's side as ranges of the
      // weight differences, the partner's as ranges of its deviations; set again at every
      // better swap.
      Below below(score, best);
      std::pair<i64, i64> dw1, dw2;
      auto limit = [&] {
        below = Below(score, best);
        dw1 = diff_range(s0.dev, below.lo1, below.hi1, unit);
        dw2 = diff_range(s0.dev2, below.lo2, below.hi2, unit);
      };
      limit();
      // x: a member of q0, y: a candidate in another pack q with x's tiles; taken if both
      // packs' scores end below `best` (the best swap so far).
      auto consider = [&](const Member& x, const auto& y, i64 q) {
        const i64 e1 = x.w - y.w, e2 = x.w2 - y.w2;
        if (e1 < dw1.first || e1 > dw1.second || e2 < dw2.first || e2 > dw2.second) return;
        if (q == q0) return;
        const PackState& s = st[q];
        if (s0.tokens - x.tok + y.tok > p.token_budget || s.tokens - y.tok + x.tok > p.token_budget)
          return;
        const i128 d1 = static_cast<i128>(e1) * unit, d2 = static_cast<i128>(e2) * unit;
        const i128 v1 = s.dev + d1, v2 = s.dev2 + d2;
        if (v1 < below.lo1 || v1 > below.hi1 || v2 < below.lo2 || v2 > below.hi2) return;
        best = std::max(score(s0.dev - d1, s0.dev2 - d2), score(v1, v2));
        bx = x.id;
        by = y.id;
        limit();
      };
      // Outward from the sample that would halve q0's deviation, the first `window` candidates
      // on each side in packs not off the same way as q0 (those could not take the difference),
      // within 4 * window.
      auto scan = [&](const std::vector<Entry>& run, const Vec& cls, const Vec& fence,
                      const Member& x, bool second, i64 want) {
        const i64 c = x.tiles, lo = cls[c], hi = cls[c + 1];
        const i64 k =
            second ? fenced_lower_bound(run, fence, lo, hi, want,
                                        [](const Entry& e) { return e.w2; })
                   : fenced_lower_bound(run, fence, lo, hi, want,
                                        [](const Entry& e) { return e.w; });
        const char skip = sign > 0 ? OVER : UNDER;
        const Entry* e = run.data();
        for (i64 j = k, end = std::min(hi, k + 4 * p.window), taken = 0;
             j < end && taken < p.window; ++j)
          if (!(off_by[e[j].pack] & skip)) {
            consider(x, e[j], e[j].pack);
            taken += 1;
          }
        for (i64 j = k - 1, end = std::max(lo, k - 4 * p.window) - 1, taken = 0;
             j > end && taken < p.window; --j)
          if (!(off_by[e[j].pack] & skip)) {
            consider(x, e[j], e[j].pack);
            taken += 1;
          }
      };
      const Member *m0 = mem.data() + first[q0], *m0_end = mem.data() + first[q0 + 1];
      const i64 half = static_cast<i64>(s0.dev / (2 * unit));
      const i64 half2 = static_cast<i64>(s0.dev2 / (2 * unit));
      for (const Member* x = m0; x != m0_end; ++x) {
        scan(by_w, cls1, fence1, *x, false, x->w - half);
        if (d.sum_w2 > 0) scan(by_w2, cls2, fence2, *x, true, x->w2 - half2);
      }
      const Vec& other = sign > 0 ? under : over;
      size_t& next_at = sign > 0 ? next_under : next_over;
      for (i64 s = 0; s < p.partners && next_at < other.size(); ++s, ++next_at) {
        const i64 q = other[next_at];
        const Member *m1 = mem.data() + first[q], *m1_end = mem.data() + first[q + 1];
        for (const Member* x = m0; x != m0_end; ++x)
          for (const Member* y = m1; y != m1_end; ++y)
            if (x->tiles == y->tiles) consider(*x, *y, q);
      }
      if (bx < 0) {
        if (++fails[q0] < 8 && !queued[q0]) {  // nothing now; the packs around it may change
          queued[q0] = 1;
          next.push_back(q0);
        }
        continue;
      }
      const Entry &ex = by_w[at1[bx]], &ey = by_w[at1[by]];
      const i64 q = ey.pack;
      const i128 d1 = static_cast<i128>(ex.w - ey.w) * unit;
      const i128 d2 = static_cast<i128>(ex.w2 - ey.w2) * unit;
      st[q0].dev -= d1;
      st[q].dev += d1;
      st[q0].dev2 -= d2;
      st[q].dev2 += d2;
      st[q0].tokens += ey.tok - ex.tok;
      st[q].tokens += ex.tok - ey.tok;
      Member* mx = mem.data() + first[q0];
      while (mx->id != bx) ++mx;
      Member* my = mem.data() + first[q];
      while (my->id != by) ++my;
      std::swap(*mx, *my);
      for (auto [i, to] : {std::pair<i64, i64>{bx, q}, {by, q0}}) {
        by_w[at1[i]].pack = static_cast<int32_t>(to);
        if (d.sum_w2 > 0) by_w2[at2[i]].pack = static_cast<int32_t>(to);
      }
      mark(q0);
      mark(q);
      for (i64 s : {q0, q})
        if (bad(s) && !queued[s]) {
          queued[s] = 1;
          next.push_back(s);
        }
    }
    work.swap(next);
  }
  for (i64 q = 0; q < packs; ++q) {
    pk.pack_tokens[q] = st[q].tokens;
    for (i64 j = first[q]; j < first[q + 1]; ++j) pk.members[q][j - first[q]] = mem[j].id;
  }
}

struct SlotResult {
  Vec samples, ptr, leftover;
};

SlotResult slot_balance(const i64* vit, const i64* w, const i64* w2, const i64* tok, i64 n,
                        const SlotParams& p) {
  const Data d = describe(vit, w, w2, tok, n, p);
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

// ---------------------------------------------------------------- token balancing (LPT)
// When the tokens bind long before the tiles (the short levels of hierarchical balance packing:
// text-only and small-image samples, many packs per rank), a pack's tiles follow from its
// samples' tokens and exact tile slots do not fit the data. Then samples go, most tokens first
// (ties in a seeded random order), each to the pack with the fewest tokens that has room for
// its tiles and tokens (longest-processing-time-first into a fixed number of packs): tokens even
// out and no pack stays empty while there are samples. Samples with no room: `leftover`.
SlotResult lpt_balance(const i64* vit, const i64* tok, i64 n, const SlotParams& p) {
  Vec rank(n), order(n);
  {
    Vec shuffled(n);
    for (i64 i = 0; i < n; ++i) shuffled[i] = i;
    Rng rng(p.seed);
    shuffle(shuffled, rng);
    for (i64 r = 0; r < n; ++r) rank[shuffled[r]] = r;
  }
  for (i64 i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](i64 a, i64 b) {
    return tok[a] != tok[b] ? tok[a] > tok[b] : rank[a] < rank[b];
  });
  const i64 packs = p.packs;
  Vec tiles(packs, 0), tokens(packs, 0);
  std::vector<Vec> members(packs);
  using Entry = std::pair<i64, i64>;  // (tokens, pack): the lightest pack on top
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> light;
  for (i64 q = 0; q < packs; ++q) light.push({0, q});
  SlotResult res;
  std::vector<Entry> stash;
  for (const i64 i : order) {
    i64 chosen = -1;
    stash.clear();
    while (!light.empty()) {
      const Entry e = light.top();
      if (e.first + tok[i] > p.token_budget) break;  // the lightest has no room: none has
      light.pop();
      if (tiles[e.second] + vit[i] <= p.vit_budget) {
        chosen = e.second;
        break;
      }
      stash.push_back(e);
    }
    for (const Entry& e : stash) light.push(e);
    if (chosen < 0) {
      res.leftover.push_back(i);
      continue;
    }
    members[chosen].push_back(i);
    tiles[chosen] += vit[i];
    tokens[chosen] += tok[i];
    light.push({tokens[chosen], chosen});
  }
  res.ptr.push_back(0);
  for (const Vec& m : members) {
    res.samples.insert(res.samples.end(), m.begin(), m.end());
    res.ptr.push_back(static_cast<i64>(res.samples.size()));
  }
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
  m.doc() = "megatron-omnibal balancing core: splitmix64 PRNG, ISF, slot and token balancing";

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
      .def_readwrite("max_uncut", &SlotParams::max_uncut)
      .def_readwrite("seed", &SlotParams::seed)
      .def_readwrite("repair_passes", &SlotParams::repair_passes)
      .def_readwrite("tol_div", &SlotParams::tol_div)
      .def_readwrite("tol2_div", &SlotParams::tol2_div)
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

  m.def("slot_balance", [](Arr vit, Arr weight, Arr weight2, Arr tok, const SlotParams& p) {
    check_same(vit, tok, "slot_balance");
    check_same(weight, tok, "slot_balance");
    check_same(weight2, tok, "slot_balance");
    if (p.packs < 1 || p.repair_passes < 0 || p.vit_budget < 0 || p.tol_div < 1 || p.tol2_div < 1 ||
        p.window < 0 || p.partners < 0 || p.grow < 0)
      throw std::invalid_argument("slot_balance: packs, tol_div and tol2_div must be >= 1, "
                                  "grow, repair_passes, window and partners >= 0");
    const i64* w2 = weight2.data();
    for (i64 i = 0; i < weight2.size(); ++i)
      if (w2[i] < 0)
        throw std::invalid_argument("slot_balance: weight2 values must be >= 0");
    const i64* v = vit.data();
    for (i64 i = 0; i < vit.size(); ++i)
      if (v[i] < 0 || v[i] > p.vit_budget)
        throw std::invalid_argument("slot_balance: vit values must lie in [0, vit_budget]");
    SlotResult r;
    {
      py::gil_scoped_release release;
      r = slot_balance(v, weight.data(), w2, tok.data(), vit.size(), p);
    }
    return py::make_tuple(to_numpy(r.samples), to_numpy(r.ptr), to_numpy(r.leftover));
  }, py::arg("vit"), py::arg("weight"), py::arg("weight2"), py::arg("tokens"), py::arg("params"),
     "Slot balancing into params.packs packs (more, params.grow at a time, while tiles do not "
     "fit): returns (samples, pack_ptr, leftover).");

  m.def("lpt_balance", [](Arr vit, Arr tok, const SlotParams& p) {
    check_same(vit, tok, "lpt_balance");
    if (p.packs < 1) throw std::invalid_argument("lpt_balance: packs must be >= 1");
    SlotResult r;
    {
      py::gil_scoped_release release;
      r = lpt_balance(vit.data(), tok.data(), vit.size(), p);
    }
    return py::make_tuple(to_numpy(r.samples), to_numpy(r.ptr), to_numpy(r.leftover));
  }, py::arg("vit"), py::arg("tokens"), py::arg("params"),
     "Token balancing (longest-processing-time-first) into params.packs packs within the "
     "budgets: returns (samples, pack_ptr, leftover).");
}
