// C++ balancing core (pybind11): the project's PRNG, OmniBal's ISF and our fill-and-complete
// packer. megatron_omnibal/data/isf_reference.py is a line-by-line Python mirror of this file;
// tests compare the two on random inputs (same seed, same packs), so any change here must be
// made there too. Every function works on positions 0..n-1 of the arrays it gets.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <deque>
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
// One pass of sequential filling: a pack closes when the next sample would exceed a budget.
void fill_in_order(const Vec& ids, const i64* vit, const i64* tok, i64 vit_budget,
                   i64 token_budget, Vec& samples, Vec& ptr) {
  i64 sv = 0, st = 0;
  bool open = false;
  for (i64 id : ids) {
    if (open && (sv + vit[id] > vit_budget || st + tok[id] > token_budget)) {
      ptr.push_back(static_cast<i64>(samples.size()));
      sv = 0;
      st = 0;
    }
    samples.push_back(id);
    sv += vit[id];
    st += tok[id];
    open = true;
  }
  if (open) ptr.push_back(static_cast<i64>(samples.size()));  // the last open pack is kept
}

Packs isf(const i64* vit, const i64* tok, i64 n, i64 vit_budget, i64 token_budget,
          i64 token_threshold, i64 rounds, uint64_t seed) {
  Vec out_samples, out_ptr{0};
  Vec ids(n);
  for (i64 i = 0; i < n; ++i) ids[i] = i;
  for (i64 r = 0; r < rounds && !ids.empty(); ++r) {
    Rng rng(seed + static_cast<uint64_t>(r));
    shuffle(ids, rng);
    Vec samples, ptr{0};
    fill_in_order(ids, vit, tok, vit_budget, token_budget, samples, ptr);
    Vec rest;
    const bool last = r == rounds - 1;
    for (size_t p = 0; p + 1 < ptr.size(); ++p) {
      i64 sv = 0, st = 0;
      for (i64 k = ptr[p]; k < ptr[p + 1]; ++k) {
        sv += vit[samples[k]];
        st += tok[samples[k]];
      }
      if (last || sv == vit_budget || st >= token_threshold) {
        out_samples.insert(out_samples.end(), samples.begin() + ptr[p],
                           samples.begin() + ptr[p + 1]);
        out_ptr.push_back(static_cast<i64>(out_samples.size()));
      } else {
        rest.insert(rest.end(), samples.begin() + ptr[p], samples.begin() + ptr[p + 1]);
      }
    }
    ids.swap(rest);
  }
  return {out_samples, out_ptr};
}

// ---------------------------------------------------------------- fill-and-complete
// Unused samples sorted by (vit, weight, index), one contiguous bucket per vit value, with two
// union-find "skip" arrays so that the nearest unused sample above / below a weight is found in
// near-constant time after removals.
struct Buckets {
  Vec order;      // sample ids sorted by (vit, weight, id)
  Vec weight;     // weight of order[k]
  Vec start;      // bucket v is order[start[v]:start[v+1]]
  Vec pos;        // position of sample id in order
  Vec up;         // up-find: next unused position >= k (n = none)
  Vec down;       // down-find over k+1: previous unused position <= k, stored shifted (0 = none)

  Buckets(const i64* vit, const i64* w, i64 n, i64 vit_budget)
      : order(n), weight(n), start(vit_budget + 2, 0), pos(n), up(n + 1), down(n + 1) {
    for (i64 i = 0; i < n; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](i64 a, i64 b) {
      return std::tie(vit[a], w[a], a) < std::tie(vit[b], w[b], b);
    });
    for (i64 k = 0; k < n; ++k) {
      weight[k] = w[order[k]];
      pos[order[k]] = k;
      start[vit[order[k]] + 1] += 1;
    }
    for (i64 v = 0; v <= vit_budget; ++v) start[v + 1] += start[v];
    for (i64 k = 0; k <= n; ++k) {
      up[k] = k;
      down[k] = k;
    }
  }

  static i64 find(Vec& parent, i64 k) {
    i64 root = k;
    while (parent[root] != root) root = parent[root];
    while (parent[k] != root) {
      i64 next = parent[k];
      parent[k] = root;
      k = next;
    }
    return root;
  }
  i64 next_unused(i64 k) { return find(up, k); }           // n when none
  i64 prev_unused(i64 k) { return find(down, k + 1) - 1; }  // -1 when none
  void remove(i64 id) {
    i64 k = pos[id];
    up[k] = k + 1;
    down[k + 1] = k;
  }

  // The unused sample of vit value v whose weight is nearest to target (ties: the lighter one),
  // skipping `exclude` and any whose tokens exceed room or weight exceeds limit; -1 if none.
  i64 closest(i64 v, i64 target, i64 room, i64 exclude, const i64* tok,
              i64 limit = INT64_MAX) {
    if (v < 0 || v + 1 >= static_cast<i64>(start.size())) return -1;
    const i64 lo = start[v], hi = start[v + 1];
    if (lo == hi) return -1;
    const i64 k = std::lower_bound(weight.begin() + lo, weight.begin() + hi, target) -
                  weight.begin();
    i64 a = next_unused(k);
    if (a < hi && order[a] == exclude) a = next_unused(a + 1);
    i64 b = prev_unused(k - 1);
    if (b >= lo && order[b] == exclude) b = prev_unused(b - 1);
    const bool has_a = a < hi && tok[order[a]] <= room && weight[a] <= limit;
    const bool has_b = b >= lo && tok[order[b]] <= room && weight[b] <= limit;
    if (has_a && has_b) return weight[a] - target < target - weight[b] ? order[a] : order[b];
    if (has_a) return order[a];
    if (has_b) return order[b];
    return -1;
  }
};

i64 abs64(i64 x) { return x < 0 ? -x : x; }

struct FillResult {
  Vec samples, ptr, leftover;
};

FillResult fill_complete(const i64* vit, const i64* w, const i64* tok, i64 n, i64 vit_budget,
                         i64 token_budget, i64 weight_cap, i64 packs, uint64_t seed,
                         i64 scan_limit, i64 tol_div, i64 ratio_lo, i64 ratio_hi) {
  Buckets bk(vit, w, n, vit_budget);
  std::vector<char> used(n, 0);
  Vec main(n);
  for (i64 i = 0; i < n; ++i) main[i] = i;
  Rng rng(seed);
  shuffle(main, rng);
  i64 vmax = 0, rem_v = 0, rem_w = 0;
  for (i64 i = 0; i < n; ++i) {
    vmax = std::max(vmax, vit[i]);
    rem_v += vit[i];
    rem_w += w[i];
  }
  size_t mp = 0;
  std::deque<i64> deferred;
  FillResult res;
  res.ptr.push_back(0);
  i64 cur_v = 0, cur_w = 0, cur_t = 0, count = 0;
  auto take = [&](i64 id) {
    used[id] = 1;
    bk.remove(id);
    res.samples.push_back(id);
    cur_v += vit[id];
    cur_w += w[id];
    cur_t += tok[id];
    count += 1;
  };
  for (i64 p = 0; p < packs; ++p) {
    const i64 left = packs - p;
    const i64 tv = std::min(vit_budget, (rem_v + left - 1) / left);
    const i64 tw = std::min(weight_cap, (2 * rem_w + left) / (2 * left));
    const i64 tol = tw / tol_div;
    cur_v = cur_w = cur_t = count = 0;
    Vec rejected_deferred, rejected_main;
    i64 rejects = 0;
    while (true) {
      const i64 need_v = tv - cur_v, need_w = tw - cur_w, room = token_budget - cur_t;
      if (need_v == 0 && abs64(need_w) <= tol) break;
      if (need_v >= 0) {
        const i64 c = bk.closest(need_v, need_w, room, -1, tok);
        if (c >= 0 && abs64(w[c] - need_w) <= tol) {
          take(c);
          break;
        }
      }
      bool done = false, accepted = false;
      while (rejects < scan_limit) {
        i64 s;
        bool from_deferred;
        if (!deferred.empty()) {
          s = deferred.front();
          deferred.pop_front();
          from_deferred = true;
        } else if (mp < main.size()) {
          s = main[mp++];
          from_deferred = false;
        } else {
          break;
        }
        if (used[s]) continue;
        bool ok = false;
        if (vit[s] <= vit_budget - cur_v && tok[s] <= room) {
          const i64 rv = need_v - vit[s], rw = need_w - w[s];
          if (rv == 0 && abs64(rw) <= tol) {
            take(s);
            done = true;
          } else if (rv >= 0) {
            const i64 c = bk.closest(rv, rw, room - tok[s], s, tok);
            if (c >= 0 && abs64(w[c] - rw) <= tol) {
              take(s);
              take(c);
              done = true;
            }
          }
          ok = done || count == 0 ||
               (rv > vmax && rw * 1024 >= rv * ratio_lo && rw * 1024 <= rv * ratio_hi);
        }
        if (done) break;
        if (ok) {
          take(s);
          accepted = true;
          break;
        }
        (from_deferred ? rejected_deferred : rejected_main).push_back(s);
        rejects += 1;
      }
      if (done) break;
      if (accepted) continue;
      // Best effort: keep adding the sample that best keeps the tile/weight proportion of
      // what is missing without passing the weight target: a pack that cannot reach both
      // targets stays light, which costs its step far less than a heavy pack would.
      while (true) {
        const i64 nv = tv - cur_v, nw = tw - cur_w, rm = token_budget - cur_t;
        if (nw <= tol) break;
        bool took = false;
        for (i64 v = std::min(nv, vit_budget - cur_v); v >= 0 && !took; --v) {
          const i64 share = nv > 0 ? nw * v / nv : nw;
          const i64 c = bk.closest(v, share, rm, -1, tok, nw + tol);
          if (c >= 0) {
            take(c);
            took = true;
          }
        }
        if (!took) break;
      }
      break;
    }
    for (auto it = rejected_deferred.rbegin(); it != rejected_deferred.rend(); ++it)
      deferred.push_front(*it);
    for (i64 s : rejected_main) deferred.push_back(s);
    rem_v -= cur_v;
    rem_w -= cur_w;
    res.ptr.push_back(static_cast<i64>(res.samples.size()));
  }
  for (i64 i = 0; i < n; ++i)
    if (!used[i]) res.leftover.push_back(i);
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

PYBIND11_MODULE(_isf_core, m) {
  m.doc() = "megatron-omnibal balancing core: splitmix64 PRNG, ISF, fill-and-complete packing";

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

  m.def("fill_complete", [](Arr vit, Arr weight, Arr tok, i64 vit_budget, i64 token_budget,
                            i64 weight_cap, i64 packs, uint64_t seed, i64 scan_limit,
                            i64 tol_div, i64 ratio_lo, i64 ratio_hi) {
    check_same(vit, tok, "fill_complete");
    check_same(weight, tok, "fill_complete");
    if (packs < 1 || scan_limit < 1 || tol_div < 1 || vit_budget < 0)
      throw std::invalid_argument("fill_complete: packs, scan_limit and tol_div must be >= 1");
    const i64* v = vit.data();
    for (i64 i = 0; i < vit.size(); ++i)
      if (v[i] < 0 || v[i] > vit_budget)
        throw std::invalid_argument("fill_complete: vit values must lie in [0, vit_budget]");
    FillResult r;
    {
      py::gil_scoped_release release;
      r = fill_complete(v, weight.data(), tok.data(), vit.size(), vit_budget, token_budget,
                        weight_cap, packs, seed, scan_limit, tol_div, ratio_lo,
                        ratio_hi);
    }
    return py::make_tuple(to_numpy(r.samples), to_numpy(r.ptr), to_numpy(r.leftover));
  }, py::arg("vit"), py::arg("weight"), py::arg("tokens"), py::arg("vit_budget"),
     py::arg("token_budget"), py::arg("weight_cap"), py::arg("packs"), py::arg("seed"),
     py::arg("scan_limit"), py::arg("tol_div"), py::arg("ratio_lo"), py::arg("ratio_hi"),
     "Fill-and-complete packing into `packs` packs: returns (samples, pack_ptr, leftover).");
}
