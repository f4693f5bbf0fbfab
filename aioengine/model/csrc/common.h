// Helpers every kernel file shares: the task split over torch's threads, eight-float vectors, the exp
// approximation, an 8x8 register transpose and (AVX-512) a sixteen-wide exp. Inline, so each file gets its
// own copy.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

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

// exp(x) for 16 floats by exp_approx's approximation (Cephes: range reduction by ln 2, degree-6 polynomial,
// 2^n from the exponent bits), with fused multiply-adds.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 half = _mm512_set1_ps(0.5f), log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, log2e, half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                    _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(y, x), x), x), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}
#endif

}  // namespace aioengine_cpu
