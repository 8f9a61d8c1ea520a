// int4 (and int8) weights × two int8 digits of each activation, in AVX-512 VNNI integer
// dot products (M26 §5.7: the engine's per-token cost). Built and loaded by
// engine/q4vnni.py, which documents the layouts; registered as torch.ops.hearthnet.q4_mm
// (4-bit values, a GGUF's Q4 blocks) and torch.ops.hearthnet.q8_mm (8-bit: Q8_0 blocks, or
// int8 per output channel: one fp32 scale per row for every group, s of shape (tiles, 1, 16)).
//
// Why two digits: one int8 digit per activation (llama.cpp's Q8_0 activations) leaves a
// relative error of ~5e-3 in a product; the residual as a second digit brings it to ~2e-5
// (x ≈ d·(hi + lo/254)), and decode stays memory-bound (the weights are read once for both).
// Every integer sum is exact; for 4-bit values |Σ q·(254·hi + lo)| over a group of 32 is
// < 2^24, so its conversion to fp32 is exact too (8-bit: one fp32 rounding, 2^-24).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t kGroup = 32;       // inputs per group: a Q4_0/Q4_1 block, a Q4_K sub-block
constexpr int64_t kTile = 16;        // output rows per tile: one 512-bit lane each
constexpr int kRows = 8;             // activation rows sharing a tile's unpacked values

// a tile's group: 16 rows × 32 values of BITS bits
template <int BITS>
constexpr int64_t group_bytes() { return 16 * 32 * BITS / 8; }

// Rows x (m, k) fp32 → digits (2, m, k) int8, one scale d per group of 32 (m, k / 32) and
// each group's digit sum 254·Σhi + Σlo (m, k / 32).
void digits_of(const float* x, int64_t m, int64_t k, int8_t* q, float* d, int32_t* sum) {
  const int64_t groups = m * (k / kGroup);
  int8_t* lo = q + m * k;
  at::parallel_for(0, groups, 256, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* xi = x + i * kGroup;
      const __m512 a0 = _mm512_loadu_ps(xi), a1 = _mm512_loadu_ps(xi + 16);
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
      const float di = amax / 127.0f;
      const float inv = di != 0.0f ? 1.0f / di : 0.0f;
      const __m512i h0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, _mm512_set1_ps(inv)));
      const __m512i h1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, _mm512_set1_ps(inv)));
      // the residual x − hi·d lies in [−d/2, d/2]: a second digit of d / 254
      const __m512 r0 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(h0), _mm512_set1_ps(di), a0);
      const __m512 r1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(h1), _mm512_set1_ps(di), a1);
      const __m512 inv_lo = _mm512_set1_ps(254.0f * inv);
      const __m512i l0 = _mm512_cvtps_epi32(_mm512_mul_ps(r0, inv_lo));
      const __m512i l1 = _mm512_cvtps_epi32(_mm512_mul_ps(r1, inv_lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup), _mm512_cvtsepi32_epi8(h0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup + 16), _mm512_cvtsepi32_epi8(h1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i * kGroup), _mm512_cvtsepi32_epi8(l0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i * kGroup + 16), _mm512_cvtsepi32_epi8(l1));
      d[i] = di;
      sum[i] = 254 * _mm512_reduce_add_epi32(_mm512_add_epi32(h0, h1)) +
               _mm512_reduce_add_epi32(_mm512_add_epi32(l0, l1));
    }
  });
}

// f(std::integral_constant<int, R>{}) for the R = `rows` (1..7) left after whole blocks
// of kRows: the rest in one pass over a tile, not one pass per row
template <typename F>
inline void by_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

template <typename S>
inline __m512 load16(const S* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i dot8(const __m512i* v, const int8_t* a) {
  // two chains of four: vpdpbusd's latency, not its throughput, bounds one chain of eight
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int c = 0; c < 8; c += 2) {
    s0 = _mm512_dpbusd_epi32(s0, v[c], _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + 4 * c)));
    s1 = _mm512_dpbusd_epi32(s1, v[c + 1], _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + 4 * c + 4)));
  }
  return _mm512_add_epi32(s0, s1);
}

// One tile (16 output rows) for R activation rows: y[r][0..16).
// OFFSET: weight = q·s + o per group; else weight = (q − z)·s, z = 8 for 4-bit values
// (Q4_0), 128 for 8-bit ones (Q8_0's int8 held as u8 = q + 128: VNNI multiplies u8 × s8).
template <typename S, bool OFFSET, int BITS, int R>
inline void tile(const uint8_t* w, const S* s, int64_t ss, const S* o, int64_t groups,
                 const int8_t* hi, const int8_t* lo, const float* d, const int32_t* sum,
                 int64_t k, float* y, int64_t n) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  constexpr int64_t bytes = group_bytes<BITS>();
  constexpr int32_t zero = BITS == 4 ? 8 : 128;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * bytes;
    // 16 groups ahead: with several activation rows (a batch, a speculative pass) the
    // hardware prefetcher falls behind (8 rows: ~20 % faster from memory; one row: same)
    for (int64_t c = 0; c < bytes; c += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + 16 * bytes + c), _MM_HINT_T0);
    }
    __m512i v[8];  // v[c]: lane j holds row j's inputs 4c..4c+3
    if constexpr (BITS == 4) {
      // 4 × 64 bytes: inputs 8c..8c+3 in the low nibbles, 8c+4..8c+7 in the high ones
      for (int c = 0; c < 4; ++c) {
        const __m512i b = _mm512_loadu_si512(wg + 64 * c);
        v[2 * c] = _mm512_and_si512(b, nib);
        v[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), nib);
      }
    } else {
      for (int c = 0; c < 8; ++c) v[c] = _mm512_loadu_si512(wg + 64 * c);
    }
    const __m512 sc = load16<S>(s + g * ss);  // ss = 0: one scale per row
    __m512 of = _mm512_setzero_ps();
    if constexpr (OFFSET) of = load16<S>(o + g * kTile);
    for (int r = 0; r < R; ++r) {
      const int64_t at = r * k + g * kGroup;
      __m512i isum = _mm512_add_epi32(
          _mm512_mullo_epi32(dot8(v, hi + at), _mm512_set1_epi32(254)), dot8(v, lo + at));
      const int32_t asum = sum[r * groups + g];
      if constexpr (!OFFSET) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(zero * asum));
      const float da = d[r * groups + g] * (1.0f / 254.0f);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sc, _mm512_set1_ps(da)),
                               acc[r]);
      if constexpr (OFFSET) acc[r] = _mm512_fmadd_ps(of, _mm512_set1_ps(da * float(asum)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n, acc[r]);
}

// rows r.. r + R of the product through one tile
template <typename S, bool OFFSET, int BITS, int R>
inline void rows(const uint8_t* wt, const S* st, int64_t ss, const S* ot, int64_t groups,
                 const int8_t* q, const int8_t* lo, const float* d, const int32_t* sum,
                 int64_t k, float* y, int64_t n, int64_t r) {
  tile<S, OFFSET, BITS, R>(wt, st, ss, ot, groups, q + r * k, lo + r * k, d + r * groups,
                           sum + r * groups, k, y + r * n, n);
}

// tile t's weights, scales, offsets (or none) and outputs
template <typename S, bool OFFSET, int BITS>
struct TileOf {
  const uint8_t* w;
  const S* s;
  const S* o;
  float* y;
  TileOf(int64_t t, const uint8_t* w0, const S* s0, int64_t ss, const S* o0, int64_t groups,
         float* y0)
      : w(w0 + t * groups * group_bytes<BITS>()), s(s0 + t * (ss ? groups : 1) * kTile),
        o(OFFSET ? o0 + t * groups * kTile : nullptr), y(y0 + t * kTile) {}
};

template <typename S, bool OFFSET, int BITS>
void product(const uint8_t* w, const S* s, int64_t ss, const S* o, const int8_t* q,
             const float* d, const int32_t* sum, int64_t m, int64_t n, int64_t k, float* y) {
  const int64_t groups = k / kGroup;
  const int8_t* lo = q + m * k;
  at::parallel_for(0, n / kTile, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const TileOf<S, OFFSET, BITS> at(t, w, s, ss, o, groups, y);
      int64_t r = 0;
      for (; r + kRows <= m; r += kRows) {
        rows<S, OFFSET, BITS, kRows>(at.w, at.s, ss, at.o, groups, q, lo, d, sum, k, at.y, n, r);
      }
      by_rows(m - r, [&](auto rest) {
        rows<S, OFFSET, BITS, decltype(rest)::value>(at.w, at.s, ss, at.o, groups, q, lo, d,
                                                     sum, k, at.y, n, r);
      });
    }
  });
}


// ---- Products in AMX tiles (Intel AMX-INT8), where the CPU and the kernel have them.
//
// The same products as `tile`: per group of 32 inputs, one TDPBSUD sums the group's
// products for 16 outputs and every digit row of up to 8 activation rows at once (VNNI
// needs 16 dot-product instructions per row), then the same int32 combination and the
// same fp32 operations in the same order; every integer sum is exact, so the results are
// bit for bit those of the VNNI path, for any number of rows. What is left per group and
// row is combining the tile's sums in vector registers (the digits' per-group scales need
// it): 8 rows cost ~15-25 % less than in VNNI for 8-bit values, ~10 % for 4-bit ones
// (M26 §5.3: batched decode; §5.7: the per-token cost); one row gains nothing.
#if (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
    (defined(__clang__) && __clang_major__ >= 12)
#define HEARTHNET_AMX 1
#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))

std::atomic<bool> g_amx{false};
// rows from which a product takes the tiles, measured (scripts/amx_rows.py: Sapphire
// Rapids-class VM, one thread, 8960 × 1536): 8-bit values, 1-4 rows about the same
// either way, 8 and more 10-30 % faster; 4-bit values (unpacked to bytes for each tile),
// 1-3 rows 1.1-2.4× slower in tiles, 4-5 about the same, 6 and more 5-20 % faster
constexpr int64_t kAmxMinRows8 = 2;
constexpr int64_t kAmxMinRows4 = 6;

// tiles 0 and 3: A, a group's digits (hi rows then lo rows: 2R × 32 bytes); 1 and 4: B,
// the group's weights in the VNNI layout (8 × 64 bytes: row c holds inputs 4c..4c+3 of
// each of the 16 outputs; `amx_weights`); 2 and 5: C, 2R × 16 int32. Two sets, so
// that one group's products run while the other's are combined.
AMX_TARGET void amx_configure(int digit_rows) {
  // the 64-byte configuration: palette (byte 0), each tile's bytes per row (uint16 at
  // 16 + 2t) and rows (byte 48 + t)
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;
  auto set = [&cfg](int t, int rows, int colsb) {
    cfg[16 + 2 * t] = static_cast<uint8_t>(colsb);
    cfg[48 + t] = static_cast<uint8_t>(rows);
  };
  set(0, digit_rows, kGroup);
  set(3, digit_rows, kGroup);
  set(1, 8, 64);
  set(4, 8, 64);
  set(2, digit_rows, 64);
  set(5, digit_rows, 64);
  // GCC's builtin does not tell the optimiser that it reads the bytes: without the
  // barrier the stores above are dropped and every tile is left unconfigured
  __asm__ volatile("" : : "r"(cfg) : "memory");
  _tile_loadconfig(cfg);
}

// a group's 2R × 16 sums (hi rows, then lo rows) into the R rows' fp32 accumulators, as
// `tile` does for one group. `da` is d / 254 per row and group and `off` the group's
// digit sum times the values' zero (OFFSET: the digit sum itself), as `mm` makes them, so
// that both are broadcasts from memory.
template <typename S, bool OFFSET, int R>
AMX_TARGET inline void amx_combine(const int32_t* c, const S* s, int64_t ss, const S* o,
                                   int64_t g, const float* da, const int32_t* off,
                                   int64_t groups, __m512* acc) {
  const __m512 sc = load16<S>(s + g * ss);
  __m512 of = _mm512_setzero_ps();
  if constexpr (OFFSET) of = load16<S>(o + g * kTile);
  for (int r = 0; r < R; ++r) {
    const __m512i hi = _mm512_load_si512(c + 16 * r);
    // 254·hi as (hi << 8) − (hi << 1): the same int32, without a slow 32-bit multiply
    __m512i isum = _mm512_sub_epi32(_mm512_slli_epi32(hi, 8), _mm512_slli_epi32(hi, 1));
    isum = _mm512_add_epi32(isum, _mm512_load_si512(c + 16 * (R + r)));
    if constexpr (!OFFSET) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(off[r * groups + g]));
    const float dr = da[r * groups + g];
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sc, _mm512_set1_ps(dr)),
                             acc[r]);
    if constexpr (OFFSET) {
      acc[r] = _mm512_fmadd_ps(of, _mm512_set1_ps(dr * float(off[r * groups + g])), acc[r]);
    }
  }
}

// a group's weights as a B tile: 8-bit values are already its 8 rows of 64 bytes (row c:
// inputs 4c..4c+3 of each of the 16 outputs); 4-bit values are unpacked into `buf` as
// `tile` unpacks them into its registers
template <int BITS>
AMX_TARGET inline const uint8_t* amx_weights(const uint8_t* wg, uint8_t* buf) {
  if constexpr (BITS == 8) {
    return wg;
  } else {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i b = _mm512_loadu_si512(wg + 64 * c);
      _mm512_store_si512(buf + 128 * c, _mm512_and_si512(b, nib));
      _mm512_store_si512(buf + 128 * c + 64, _mm512_and_si512(_mm512_srli_epi16(b, 4), nib));
    }
    return buf;
  }
}

// one tile (16 outputs) for the R rows whose digits are `q` (hi rows, then lo rows, each
// `k` bytes apart), as `tile<S, OFFSET, BITS, R>`. Software-pipelined: two groups'
// products run in the tiles while the previous two groups' sums are combined from memory
// (a tile's store is not forwarded to vector loads: combining right after it waits).
template <typename S, bool OFFSET, int BITS, int R>
AMX_TARGET void amx_tile(const uint8_t* w, const S* s, int64_t ss, const S* o, int64_t groups,
                         const int8_t* q, const float* da, const int32_t* off, int64_t k,
                         float* y, int64_t n) {
  constexpr int64_t bytes = group_bytes<BITS>();
  alignas(64) int32_t c0[2 * R * 16];
  alignas(64) int32_t c1[2 * R * 16];
  alignas(64) uint8_t b0[BITS == 4 ? 512 : 64];
  alignas(64) uint8_t b1[BITS == 4 ? 512 : 64];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  auto pair = [&](int64_t g) AMX_TARGET {  // groups g and g + 1 into tiles 2 and 5
    const uint8_t* wg = w + g * bytes;
    for (int64_t c = 0; c < 2 * bytes; c += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + 16 * bytes + c), _MM_HINT_T0);
    }
    _tile_zero(2);
    _tile_zero(5);
    _tile_loadd(0, q + g * kGroup, k);
    _tile_loadd(1, amx_weights<BITS>(wg, b0), 64);
    _tile_loadd(3, q + (g + 1) * kGroup, k);
    _tile_loadd(4, amx_weights<BITS>(wg + bytes, b1), 64);
    _tile_dpbsud(2, 0, 1);
    _tile_dpbsud(5, 3, 4);
  };
  const int64_t pairs = groups / 2;
  if (pairs > 0) {
    pair(0);
    for (int64_t p = 1; p < pairs; ++p) {
      _tile_stored(2, c0, 64);
      _tile_stored(5, c1, 64);
      pair(2 * p);
      amx_combine<S, OFFSET, R>(c0, s, ss, o, 2 * p - 2, da, off, groups, acc);
      amx_combine<S, OFFSET, R>(c1, s, ss, o, 2 * p - 1, da, off, groups, acc);
    }
    _tile_stored(2, c0, 64);
    _tile_stored(5, c1, 64);
    amx_combine<S, OFFSET, R>(c0, s, ss, o, 2 * pairs - 2, da, off, groups, acc);
    amx_combine<S, OFFSET, R>(c1, s, ss, o, 2 * pairs - 1, da, off, groups, acc);
  }
  if (groups % 2) {
    const int64_t g = groups - 1;
    _tile_zero(2);
    _tile_loadd(0, q + g * kGroup, k);
    _tile_loadd(1, amx_weights<BITS>(w + g * bytes, b0), 64);
    _tile_dpbsud(2, 0, 1);
    _tile_stored(2, c0, 64);
    amx_combine<S, OFFSET, R>(c0, s, ss, o, g, da, off, groups, acc);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n, acc[r]);
}

template <typename S, bool OFFSET, int BITS, int R>
AMX_TARGET void amx_rows(const uint8_t* wt, const S* st, int64_t ss, const S* ot,
                         int64_t groups, const int8_t* q, const float* da, const int32_t* off,
                         int64_t k, float* y, int64_t n, int64_t r) {
  // the block of rows r.. r + R: its digits at q + 2·r·k (`mm` lays them out by blocks)
  amx_tile<S, OFFSET, BITS, R>(wt, st, ss, ot, groups, q + 2 * r * k, da + r * groups,
                               off + r * groups, k, y + r * n, n);
}

// tiles b.. e of the product on this thread (a lambda would not carry the AMX target)
template <typename S, bool OFFSET, int BITS>
AMX_TARGET void amx_tiles(const uint8_t* w, const S* s, int64_t ss, const S* o,
                          const int8_t* q, const float* da, const int32_t* off, int64_t m,
                          int64_t n, int64_t k, float* y, int64_t b, int64_t e) {
  const int64_t groups = k / kGroup;
  const int tail = static_cast<int>(m % kRows);
  int configured = 0;  // a thread's tile configuration is its own, and oneDNN's AMX
  // kernels set theirs: each call configures, and releases the tiles when done
  for (int64_t t = b; t < e; ++t) {
    const TileOf<S, OFFSET, BITS> at(t, w, s, ss, o, groups, y);
    int64_t r = 0;
    if (m >= kRows && configured != kRows) {
      amx_configure(2 * kRows);
      configured = kRows;
    }
    for (; r + kRows <= m; r += kRows) {
      amx_rows<S, OFFSET, BITS, kRows>(at.w, at.s, ss, at.o, groups, q, da, off, k, at.y, n, r);
    }
    if (tail && tail != configured) {
      amx_configure(2 * tail);
      configured = tail;
    }
    by_rows(tail, [&](auto rest) AMX_TARGET {
      amx_rows<S, OFFSET, BITS, decltype(rest)::value>(at.w, at.s, ss, at.o, groups, q, da,
                                                       off, k, at.y, n, r);
    });
  }
  if (configured) _tile_release();
}

template <typename S, bool OFFSET, int BITS>
void amx_product(const uint8_t* w, const S* s, int64_t ss, const S* o, const int8_t* q,
                 const float* da, const int32_t* off, int64_t m, int64_t n, int64_t k,
                 float* y) {
  at::parallel_for(0, n / kTile, 1, [&](int64_t b, int64_t e) {
    amx_tiles<S, OFFSET, BITS>(w, s, ss, o, q, da, off, m, n, k, y, b, e);
  });
}

// Whether the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24 and 25) and Linux
// lets this process use the tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA,
// feature 18; Linux ≥ 5.16): only then may a tile instruction run.
bool amx_permitted() {
  unsigned eax = 7, ebx = 0, ecx = 0, edx = 0;
  __asm__ volatile("cpuid" : "+a"(eax), "=b"(ebx), "+c"(ecx), "=d"(edx));
  if (!((edx >> 24) & 1) || !((edx >> 25) & 1)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}
#else
#define HEARTHNET_AMX 0
#endif

// Turn the AMX path of q4_mm and q8_mm on (where `amx_permitted`) or off; returns whether it is on.
bool use_amx(bool on) {
#if HEARTHNET_AMX
  g_amx.store(on && amx_permitted());
  return g_amx.load();
#else
  (void)on;
  return false;
#endif
}

// the product in VNNI registers or, with `amx`, in AMX tiles (the same results)
template <typename S, int BITS>
void dispatch(bool amx, const at::Tensor& w, const at::Tensor& s,
              const c10::optional<at::Tensor>& o, const at::Tensor& q, const at::Tensor& d,
              const at::Tensor& sum, int64_t m, int64_t n, int64_t k, at::Tensor& y) {
  const S* op = o.has_value() ? o->data_ptr<S>() : nullptr;
  auto run = o.has_value() ? product<S, true, BITS> : product<S, false, BITS>;
#if HEARTHNET_AMX
  if (amx) run = o.has_value() ? amx_product<S, true, BITS> : amx_product<S, false, BITS>;
#endif
  const int64_t ss = s.size(1) == w.size(1) ? kTile : 0;  // per group, or one scale per row
  run(w.data_ptr<uint8_t>(), s.data_ptr<S>(), ss, op, q.data_ptr<int8_t>(),
      d.data_ptr<float>(), sum.data_ptr<int32_t>(), m, n, k, y.data_ptr<float>());
}

template <int BITS>
at::Tensor mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s,
              const c10::optional<at::Tensor>& o) {
  constexpr const char* name = BITS == 4 ? "q4_mm" : "q8_mm";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.is_cpu(),
              name, ": x must be contiguous fp32 (rows, inputs) on the CPU");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.size(2) == group_bytes<BITS>(),
              name, ": w must be contiguous uint8 (tiles, groups, ", group_bytes<BITS>(), ")");
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup, n = w.size(0) * kTile;
  TORCH_CHECK(k % kGroup == 0 && w.size(1) == groups, name, ": x has ", k,
              " inputs; w is for ", w.size(1) * kGroup);
  TORCH_CHECK(s.is_contiguous() && (s.scalar_type() == at::kHalf || s.scalar_type() == at::kFloat) &&
                  s.dim() == 3 && s.size(0) == w.size(0) && s.size(2) == kTile &&
                  (s.size(1) == groups || (BITS == 8 && s.size(1) == 1)),
              name, ": s must be contiguous fp16 or fp32 (tiles, groups, 16)",
              BITS == 8 ? " or, one per row, (tiles, 1, 16)" : "");
  TORCH_CHECK(!o.has_value() || (o->is_contiguous() && o->scalar_type() == s.scalar_type() &&
                                 o->sizes() == s.sizes() && s.size(1) == groups),
              name, ": o must be as s");
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  auto q = at::empty({2 * m, k}, x.options().dtype(at::kChar));
  auto d = at::empty({m, groups}, x.options());
  auto sum = at::empty({m, groups}, x.options().dtype(at::kInt));
  bool amx = false;
#if HEARTHNET_AMX
  // from kAmxMinRows rows on (one row, or a few 4-bit rows, run faster in VNNI registers)
  amx = m >= (BITS == 4 ? kAmxMinRows4 : kAmxMinRows8) && g_amx.load(std::memory_order_relaxed);
#endif
  if (amx) {
    // digits by blocks of kRows rows (each block's hi rows, then its lo rows: one A tile)
    for (int64_t r = 0; r < m; r += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, m - r);
      digits_of(x.data_ptr<float>() + r * k, rows, k, q.data_ptr<int8_t>() + 2 * r * k,
                d.data_ptr<float>() + r * groups, sum.data_ptr<int32_t>() + r * groups);
    }
    // the per-group factors `tile` makes for each tile, made once: d / 254 and the digit
    // sum times the values' zero (with offsets, the digit sum itself)
    float* dp = d.data_ptr<float>();
    int32_t* sp = sum.data_ptr<int32_t>();
    const int32_t zero = o.has_value() ? 1 : (BITS == 4 ? 8 : 128);
    for (int64_t i = 0; i < m * groups; ++i) {
      dp[i] *= 1.0f / 254.0f;
      sp[i] *= zero;
    }
  } else {
    digits_of(x.data_ptr<float>(), m, k, q.data_ptr<int8_t>(), d.data_ptr<float>(),
              sum.data_ptr<int32_t>());
  }
  if (s.scalar_type() == at::kHalf) {
    dispatch<at::Half, BITS>(amx, w, s, o, q, d, sum, m, n, k, y);
  } else {
    dispatch<float, BITS>(amx, w, s, o, q, d, sum, m, n, k, y);
  }
  return y;
}

at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s,
                 const c10::optional<at::Tensor>& o) {
  return mm<4>(x, w, s, o);
}

at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s) {
  return mm<8>(x, w, s, c10::nullopt);
}

}  // namespace

TORCH_LIBRARY(hearthnet, m) {
  m.def("q4_mm(Tensor x, Tensor w, Tensor s, Tensor? o) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor w, Tensor s) -> Tensor");
  m.def("use_amx(bool on) -> bool", &use_amx);
}
TORCH_LIBRARY_IMPL(hearthnet, CPU, m) {
  m.impl("q4_mm", &q4_mm);
  m.impl("q8_mm", &q8_mm);
}
