// Helpers every kernel file shares: the task split over torch's threads, eight-float vectors, the exp
// approximation, an 8x8 register transpose, and the widest register the build has (Wide) with an exp over it.
// Inline, so each file gets its own copy.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"  // AIOENGINE_WIDE

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace aioengine_cpu {

// Runs body(task, end) for every task in [0, n) on torch's threads. Each thread takes the tasks of its own
// contiguous share in order (end: where that share ends as it stands, so a task can prefetch for the one
// after it), then takes the other shares' last tasks one at a time (end: task + 1). at::parallel_for hands
// out the same shares and waits for the slowest: on cores the threads share with others (the event loop's
// thread runs beside the two compute threads on a 2-core host) a thread the OS preempted held the region
// for the rest of its share while the other spun at the barrier; here it holds it for one task.
template <typename Body>
void parallel_tasks(int64_t n, const Body& body) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region() || n > 0xFFFFFFFFLL) {
    for (int64_t task = 0; task < n; ++task) body(task, n);
    return;
  }
  // Share s is [front, back), packed in one word: its owner advances front, a thief lowers back, and one
  // compare-and-swap settles who gets the last task.
  auto pack = [](uint64_t front, uint64_t back) { return front << 32 | back; };
  std::unique_ptr<std::atomic<uint64_t>[]> shares(new std::atomic<uint64_t>[static_cast<size_t>(threads)]);
  for (int64_t s = 0; s < threads; ++s) shares[s].store(pack(n * s / threads, n * (s + 1) / threads));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      for (int64_t k = 0; k < threads; ++k) {
        std::atomic<uint64_t>& share = shares[(s + k) % threads];
        const bool own = k == 0;
        uint64_t word = share.load(std::memory_order_relaxed);
        while (true) {
          const uint64_t front = word >> 32, back = word & 0xFFFFFFFFu;
          if (front >= back) break;
          const uint64_t next = own ? pack(front + 1, back) : pack(front, back - 1);
          if (!share.compare_exchange_weak(word, next, std::memory_order_relaxed)) continue;  // word reloaded
          if (own) body(static_cast<int64_t>(front), static_cast<int64_t>(back));
          else body(static_cast<int64_t>(back - 1), static_cast<int64_t>(back));
          word = share.load(std::memory_order_relaxed);
        }
      }
    }
  });
}


// Whether value v at column c beats the row's best so far (best, at): greedy's rule, the first maximum, NaN
// never; so the best over any split of a row's columns, merged in any order, is the whole row's.
inline bool beats(float v, int64_t c, float best, int64_t at) {
  return v > best || (v == best && (at < 0 || c < at));
}

// Eight floats as one value (GCC/Clang vector extensions): AVX registers on x86, pairs of NEON
// registers on Arm. Loads and stores go through memcpy, so no pointer needs to be aligned.
typedef float vec8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof(v)); }

inline float sum8(vec8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

// out[0..3] = the sums of a0..a3.
inline void sum8x4(vec8 a0, vec8 a1, vec8 a2, vec8 a3, float* out) {
#if defined(__AVX__)
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a0, (__m256)a1), _mm256_hadd_ps((__m256)a2, (__m256)a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  out[0] = sum8(a0);
  out[1] = sum8(a1);
  out[2] = sum8(a2);
  out[3] = sum8(a3);
#endif
}

// One head of the rotate-half rotary embedding, from src into dst (src itself, or another head's place):
// dst[i] = a c[i] - b s[i] and dst[i + half] = b c[i + half] + a s[i + half] with a = src[i], b = src[i + half], c and
// s the position's cos and sin rows.
inline void rotate_head(const float* src, float* dst, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = src[i], b = src[i + half];
    dst[i] = a * c[i] + (-b) * s[i];
    dst[i + half] = b * c[i + half] + a * s[i + half];
  }
}

// exp(x) for float32 as Cephes computes it (range reduction by ln 2, degree-6 polynomial, 2^n from
// the exponent bits): within 2 ulp of std::exp, and plain arithmetic, so loops over it vectorise.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

#if defined(__AVX__)
// out[k * ld_out + j] = in[j * ld_in + k] for an 8x8 tile, transposed in registers.
inline void transpose8x8(const float* in, int64_t ld_in, float* out, int64_t ld_out) {
  __m256 a[8], b[8], c[8];
  for (int r = 0; r < 8; ++r) a[r] = _mm256_loadu_ps(in + r * ld_in);
  for (int r = 0; r < 8; r += 2) {
    b[r] = _mm256_unpacklo_ps(a[r], a[r + 1]);
    b[r + 1] = _mm256_unpackhi_ps(a[r], a[r + 1]);
  }
  for (int r = 0; r < 8; r += 4) {
    c[r] = _mm256_shuffle_ps(b[r], b[r + 2], 0x44);
    c[r + 1] = _mm256_shuffle_ps(b[r], b[r + 2], 0xEE);
    c[r + 2] = _mm256_shuffle_ps(b[r + 1], b[r + 3], 0x44);
    c[r + 3] = _mm256_shuffle_ps(b[r + 1], b[r + 3], 0xEE);
  }
  for (int r = 0; r < 4; ++r) {
    _mm256_storeu_ps(out + r * ld_out, _mm256_permute2f128_ps(c[r], c[r + 4], 0x20));
    _mm256_storeu_ps(out + (r + 4) * ld_out, _mm256_permute2f128_ps(c[r], c[r + 4], 0x31));
  }
}
#endif

#if defined(__AVX512F__)
// The sum of a 16-float register's halves, as eight floats (to reduce further with sum8 / sum8x4).
inline vec8 fold16(__m512 a) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  return (vec8)_mm256_add_ps(_mm512_castps512_ps256(a), hi);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The lanes of an 8-float register below n (all of them from 8 on, none from 0 down), as maskload's mask.
inline __m256i lanes_below(int64_t n) {
  const int count = static_cast<int>(std::clamp<int64_t>(n, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

// n scratch floats, uninitialised, on a 64-byte boundary (torch's CPU allocator): a line and an AVX-512 register.
// A std::vector's memory is aligned to 16 bytes only, and then three of four 64-byte loads from it straddle two
// lines; which happens varies from process to process with the heap's state.
struct ScratchFloats {
  explicit ScratchFloats(int64_t n)
      : owner(at::empty({n}, at::TensorOptions().dtype(at::kFloat))), data(owner.data_ptr<float>()) {}
  at::Tensor owner;  // holds the memory
  float* data;
};

// The widest float register the build has, for kernels written once for both: 16 lanes (AVX-512, 32 registers)
// or 8 (AVX2 with FMA, 16 registers).
#if defined(AIOENGINE_WIDE) && defined(__AVX512F__)
struct Wide {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V clamp(V x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, set1(lo)), set1(hi)); }
  static V floor(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  // 2^n for whole-numbered n (as floats) in the exponent's range.
  static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  // The largest of the lanes below n (n >= 1), and v with the lanes from n on set to 0 (all of them for n <= 0).
  static float max_below(V v, int64_t n) { return _mm512_mask_reduce_max_ps(mask(n), v); }
  static V zero_from(V v, int64_t n) { return _mm512_maskz_mov_ps(mask(n), v); }
  static __mmask16 mask(int64_t n) {
    return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1);
  }
};
#elif defined(AIOENGINE_WIDE)
struct Wide {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V clamp(V x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, set1(lo)), set1(hi)); }
  static V floor(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float max_below(V v, int64_t n) {
    v = _mm256_blendv_ps(set1(-std::numeric_limits<float>::infinity()), v, _mm256_castsi256_ps(lanes_below(n)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static V zero_from(V v, int64_t n) { return _mm256_and_ps(v, _mm256_castsi256_ps(lanes_below(n))); }
};
#endif

#if defined(AIOENGINE_WIDE)
// exp(x) lane by lane by exp_approx's approximation (Cephes: range reduction by ln 2, degree-6 polynomial,
// 2^n from the exponent bits), with fused multiply-adds.
inline Wide::V exp_wide(Wide::V x) {
  using W = Wide;
  x = W::clamp(x, -87.3f, 88.7f);
  const W::V n = W::floor(W::fmadd(x, W::set1(1.44269504088896341f), W::set1(0.5f)));
  x = W::add(W::sub(x, W::mul(n, W::set1(0.693359375f))), W::mul(n, W::set1(2.12194440e-4f)));
  W::V y = W::set1(1.9875691500e-4f);
  y = W::fmadd(y, x, W::set1(1.3981999507e-3f));
  y = W::fmadd(y, x, W::set1(8.3334519073e-3f));
  y = W::fmadd(y, x, W::set1(4.1665795894e-2f));
  y = W::fmadd(y, x, W::set1(1.6666665459e-1f));
  y = W::fmadd(y, x, W::set1(5.0000001201e-1f));
  y = W::add(W::add(W::mul(W::mul(y, x), x), x), W::set1(1.0f));
  return W::mul(y, W::pow2(n));
}
#endif

// What both attention kernels need of q [tokens, H, D], the cache and out: float32, and a cache whose heads and
// head size fit q's (query head h reads KV head h / (H / Hkv)); raises, naming `kernel`, where they do not.
// Defined in attention.cpp.
void check_against_cache(const char* kernel, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& out);

}  // namespace aioengine_cpu
