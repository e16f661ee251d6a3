// Batch-invariant attention over the paged KV pool: every query token of a forward in one call.
//
// Token i attends the keys key_slots[key_offsets[i] .. key_offsets[i + 1]) of the pool (its
// context, then its own ancestors for a tree node), in that order. One task computes one
// (token, KV head) pair, with the query heads that share the KV head, from start to end on one
// thread: the scores, the softmax and the weighted sum of V are each reduced in one fixed order
// that depends on nothing but the token's own keys. So a token's bits do not depend on which
// other tokens share the call, on how many threads run it, or on where the token sits in the
// batch: a decode row and the same token verified in a tree get the same output.
//
// Dot products keep 16 partial sums (lanes the compiler vectorises without reassociating) that
// are added in a fixed order at the end; all arithmetic is float32, the output is rounded once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t LANES = 16;

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float part[LANES] = {0};
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES)
    for (int64_t l = 0; l < LANES; ++l) part[l] += a[d + l] * b[d + l];
  for (int64_t l = 0; d < n; ++d, ++l) part[l] += a[d] * b[d];
  float s = 0.f;
  for (int64_t l = 0; l < LANES; ++l) s += part[l];
  return s;
}

template <typename T>
void attend(const T* q, const T* k, const T* v, T* out, const int64_t* slots, const int64_t* offsets,
            int64_t tokens, int64_t hq, int64_t hkv, int64_t dk, int64_t dv,
            int64_t k_row, int64_t v_row, float scale) {
  const int64_t rep = hq / hkv;
  at::parallel_for(0, tokens * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rep * dk), kf(dk), vf(dv), acc(rep * dv), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / hkv, g = task % hkv;
      const int64_t first = offsets[i], n = offsets[i + 1] - first;
      scores.assign(rep * n, 0.f);
      for (int64_t r = 0; r < rep; ++r) to_float(q + (i * hq + g * rep + r) * dk, qf.data() + r * dk, dk);
      for (int64_t j = 0; j < n; ++j) {
        to_float(k + slots[first + j] * k_row + g * dk, kf.data(), dk);
        for (int64_t r = 0; r < rep; ++r) scores[r * n + j] = dot(qf.data() + r * dk, kf.data(), dk) * scale;
      }
      std::vector<float> total(rep, 0.f);
      for (int64_t r = 0; r < rep; ++r) {
        float* s = scores.data() + r * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
        for (int64_t j = 0; j < n; ++j) {
          s[j] = std::exp(s[j] - m);
          total[r] += s[j];
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        to_float(v + slots[first + j] * v_row + g * dv, vf.data(), dv);
        for (int64_t r = 0; r < rep; ++r) {
          const float p = scores[r * n + j];
          float* a = acc.data() + r * dv;
          for (int64_t d = 0; d < dv; ++d) a[d] += p * vf[d];
        }
      }
      for (int64_t r = 0; r < rep; ++r) {
        T* o = out + (i * hq + g * rep + r) * dv;
        const float inv = total[r] > 0.f ? 1.f / total[r] : 0.f;
        for (int64_t d = 0; d < dv; ++d) o[d] = static_cast<T>(acc[r * dv + d] * inv);
      }
    }
  });
}

}  // namespace

// q [N, Hq, D]; k_pool [slots, Hkv, D], v_pool [slots, Hkv, Dv] (contiguous); key_slots [total]
// int64; key_offsets [N + 1] int64. Returns [N, Hq, Dv] in q's dtype.
torch::Tensor exact_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor key_slots,
                              torch::Tensor key_offsets, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "q, k and v must be 3-D");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "the KV pool must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "q, k and v must share a dtype");
  TORCH_CHECK(key_slots.scalar_type() == torch::kLong && key_offsets.scalar_type() == torch::kLong,
              "key slots and offsets must be int64");
  q = q.contiguous();
  key_slots = key_slots.contiguous();
  key_offsets = key_offsets.contiguous();
  const int64_t tokens = q.size(0), hq = q.size(1), dk = q.size(2), hkv = k_pool.size(1), dv = v_pool.size(2);
  TORCH_CHECK(hq % hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(key_offsets.numel() == tokens + 1, "key_offsets must have one entry per token plus one");
  auto out = torch::empty({tokens, hq, dv}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "exact_attention", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(),
                     out.data_ptr<scalar_t>(), key_slots.data_ptr<int64_t>(), key_offsets.data_ptr<int64_t>(),
                     tokens, hq, hkv, dk, dv, hkv * dk, hkv * dv, static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exact_attention", &exact_attention, "batch-invariant attention of listed query tokens over the paged pool");
}
