// overdrive's row kernels for decode on the CPU (torch ops overdrive_rows::*): built on first use by
// rows_mm.py (torch.utils.cpp_extension.load_inline, for the CPU's instruction set); its docstring says what
// each op computes and why.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <sleef.h>

// y[m, n] = sum_k x[m, k] * w[n, k], int8 x [M, K], int8 w [N, K], int32 out [M, N]. Each thread takes a span of
// weight rows, one at a time, in order (one sequential stream: interleaving four rows read ~45% slower on an
// AVX-512 CPU, two ~30% slower on an AVX2 one), and computes every row of x against it, four at a time (the
// accumulators held in registers; the weight row, at most 64 KiB, read again from the cache for the next four).
// NARROW: no activation is -128 (the layer's own rounding gives -127..127).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The activations as u8 (q + 128), each row padded to a multiple of 64 bytes (against weights masked to zero);
// 128 * wsum[n] taken off. One form whatever the activations.
static constexpr int64_t STEP = 64;
template <bool NARROW> struct act { typedef uint8_t type; };
template <bool NARROW> static inline uint8_t widen(int8_t v) { return (uint8_t)(v ^ (int8_t)0x80); }

template <bool NARROW, int R>
static inline void dot_rows(const uint8_t* xa, int64_t Kp, const int8_t* r, int64_t K, int32_t wsum, int32_t* out,
                            int64_t stride) {
  const int64_t full = K / 64 * 64;
  __m512i acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_si512();
  for (int64_t k = 0; k < full; k += 64) {
    const __m512i b = _mm512_loadu_si512(r + k);
    for (int m = 0; m < R; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(xa + m * Kp + k), b);
  }
  if (K > full) {
    const __m512i b = _mm512_maskz_loadu_epi8(~0ULL >> (64 - (K - full)), r + full);
    for (int m = 0; m < R; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(xa + m * Kp + full), b);
  }
  for (int m = 0; m < R; ++m) out[m * stride] = _mm512_reduce_add_epi32(acc[m]) - 128 * wsum;
}
#elif defined(__AVX2__)
// Each row of the activations padded with zeros to a multiple of 32; the weights' tail in scalar code.
// NARROW: the activations as int8; 32 weights a step as |w| (u8) against x with w's sign (s8) by vpmaddubsw
// (|pair| <= 2 * 128 * 127 < 2^15: never saturates, for any weight), then vpmaddwd by ones into int32.
// Else (an activation may be -128, which has no int8 negation): the activations widened to int16, the weights
// sign-extended, vpmaddwd into int32 (|pair| <= 2 * 128^2 = 2^15). The weight stream is prefetched 1 KiB ahead.
static constexpr int64_t STEP = 32;
static constexpr int64_t PREFETCH = 1024;
template <bool NARROW> struct act { typedef int16_t type; };
template <> struct act<true> { typedef int8_t type; };
template <bool NARROW> static inline typename act<NARROW>::type widen(int8_t v) { return v; }

static inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

template <bool NARROW, int R>
static inline void dot_rows(const typename act<NARROW>::type* xa, int64_t Kp, const int8_t* r, int64_t K, int32_t,
                            int32_t* out, int64_t stride) {
  const int64_t full = K / 32 * 32;
  __m256i acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_si256();
  if constexpr (NARROW) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t k = 0; k < full; k += 32) {
      _mm_prefetch((const char*)(r + k + PREFETCH), _MM_HINT_T0);
      const __m256i w = _mm256_loadu_si256((const __m256i*)(r + k));
      const __m256i aw = _mm256_abs_epi8(w);
      for (int m = 0; m < R; ++m) {
        const __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(xa + m * Kp + k)), w);
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
      }
    }
  } else {
    for (int64_t k = 0; k < full; k += 32) {
      _mm_prefetch((const char*)(r + k + PREFETCH), _MM_HINT_T0);
      const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(r + k)));
      const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(r + k + 16)));
      for (int m = 0; m < R; ++m) {
        const int16_t* a = xa + m * Kp + k;
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i*)a)));
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i*)(a + 16))));
      }
    }
  }
  for (int m = 0; m < R; ++m) {
    int32_t s = sum8(acc[m]);
    for (int64_t k = full; k < K; ++k) s += (int32_t)xa[m * Kp + k] * (int32_t)r[k];
    out[m * stride] = s;
  }
}
#else
#error "overdrive's int8 kernel needs AVX-512 VNNI or AVX2"
#endif

// One weight of a product over several (a decoder's q, k and v projections of the same x): w [n, K], its row
// sums (for the VNNI form), the output y [M, n]
struct Int8Segment { const int8_t* w; const int32_t* sums; int64_t n; int32_t* y; };

// Each segment's y = xp [M, K] · wᵀ in int32; one parallel region over all the segments' weight rows
template <bool NARROW>
static void rows_product(const int8_t* xp, int64_t M, int64_t K, const std::vector<Int8Segment>& segments) {
  typedef typename act<NARROW>::type act_t;
  const int64_t Kp = (K + STEP - 1) / STEP * STEP;
  std::vector<act_t> xa(M * Kp, widen<NARROW>(0));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xa[m * Kp + k] = widen<NARROW>(xp[m * K + k]);
  const act_t* xs = xa.data();
  int64_t total = 0;
  for (const auto& g : segments) total += g.n;
  at::parallel_for(0, total, 64, [&](int64_t n0, int64_t n1) {
    int64_t base = 0;
    for (const auto& g : segments) {
      for (int64_t n = std::max(n0, base); n < std::min(n1, base + g.n); ++n) {
        const int64_t row = n - base;
        const int8_t* r = g.w + row * K;
        for (int64_t m = 0; m < M; m += 4) {
          const act_t* a = xs + m * Kp;
          int32_t* out = g.y + m * g.n + row;
          switch (std::min<int64_t>(M - m, 4)) {
            case 1: dot_rows<NARROW, 1>(a, Kp, r, K, g.sums[row], out, g.n); break;
            case 2: dot_rows<NARROW, 2>(a, Kp, r, K, g.sums[row], out, g.n); break;
            case 3: dot_rows<NARROW, 3>(a, Kp, r, K, g.sums[row], out, g.n); break;
            default: dot_rows<NARROW, 4>(a, Kp, r, K, g.sums[row], out, g.n); break;
          }
        }
      }
      base += g.n;
    }
  });
}

static void check_weight(const at::Tensor& w, const at::Tensor& wsum, const char* op) {
  TORCH_CHECK(w.dtype() == torch::kInt8 && wsum.dtype() == torch::kInt32, op,
              " takes an int8 weight and int32 weight_sums, got ", w.dtype(), ", ", wsum.dtype());
  TORCH_CHECK(w.dim() == 2 && wsum.dim() == 1 && wsum.size(0) == w.size(0), op,
              " takes weight [out, in], weight_sums [out], got shapes ", w.sizes(), ", ", wsum.sizes());
  TORCH_CHECK(w.size(1) <= 65536, op, ": ", w.size(1), " in features could overflow its int32 sums (at most 65536)");
  TORCH_CHECK(w.device().is_cpu() && wsum.device().is_cpu(), op, " takes CPU tensors");
}

at::Tensor int8_rows_mm(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& wsum_in) {
  check_weight(w_in, wsum_in, "int8_rows_mm");
  TORCH_CHECK(x_in.dtype() == torch::kInt8, "int8_rows_mm takes int8 x, got ", x_in.dtype());
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w_in.size(1), "int8_rows_mm takes x [M, in] against weight [out, in], got shapes ",
              x_in.sizes(), ", ", w_in.sizes());
  TORCH_CHECK(x_in.device().is_cpu(), "int8_rows_mm takes CPU tensors");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), wsum = wsum_in.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kInt32));
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const int8_t* xp = x.data_ptr<int8_t>();
  const bool narrow = std::find(xp, xp + M * K, (int8_t)-128) == xp + M * K;
  const std::vector<Int8Segment> one{{w.data_ptr<int8_t>(), wsum.data_ptr<int32_t>(), N, y.data_ptr<int32_t>()}};
  (narrow ? rows_product<true> : rows_product<false>)(xp, M, K, one);
  return y;
}

// Each y [M, N] float32 = ((qx · qwᵀ) · sx) · scale (+ bias), each row of x rounded to int8 with its own symmetric
// scale sx = max(absmax, 1e-12) / 127, q = round half to even (x / sx) clamped to -127..127: quantize._int8_rows
// and Int8RowwiseLinear's float32 arithmetic, the same operations in the same order (no contraction into FMA:
// built with -ffp-contract=off). A row holding NaN or inf gives NaN throughout. x rounded once for all weights.
static std::vector<at::Tensor> linears(const char* op, const at::Tensor& x_in, at::TensorList weights,
                                       at::TensorList sums, at::TensorList scales,
                                       const std::vector<std::optional<at::Tensor>>& biases) {
  TORCH_CHECK(weights.size() == sums.size() && weights.size() == scales.size(), op,
              " takes as many weights, weight_sums and scales, got ", weights.size(), ", ", sums.size(), ", ",
              scales.size());
  TORCH_CHECK(x_in.dtype() == torch::kFloat32 && x_in.dim() == 2 && x_in.device().is_cpu(), op,
              " takes float32 x [M, in] on the CPU, got ", x_in.dtype(), " ", x_in.sizes());
  const int64_t M = x_in.size(0), K = x_in.size(1);
  std::vector<at::Tensor> w, ws, sc, bs, ys;
  for (size_t i = 0; i < weights.size(); ++i) {
    check_weight(weights[i], sums[i], op);
    const auto& bias = biases[i];
    const int64_t N = weights[i].size(0);
    TORCH_CHECK(scales[i].dtype() == torch::kFloat32 && (!bias || bias->dtype() == torch::kFloat32), op,
                " takes float32 x, scale and bias, got ", x_in.dtype(), ", ", scales[i].dtype(), ", ",
                bias ? std::string(bias->dtype().name()) : std::string("no bias"));
    TORCH_CHECK(weights[i].size(1) == K && scales[i].dim() == 1 && scales[i].size(0) == N &&
                (!bias || (bias->dim() == 1 && bias->size(0) == N)), op,
                " takes x [M, in], weight [out, in], scale [out], bias [out], got shapes ", x_in.sizes(), ", ",
                weights[i].sizes(), ", ", scales[i].sizes(), ", ", bias ? bias->sizes() : c10::IntArrayRef{});
    TORCH_CHECK(scales[i].device().is_cpu() && (!bias || bias->device().is_cpu()), op, " takes CPU tensors");
    w.push_back(weights[i].contiguous()); ws.push_back(sums[i].contiguous()); sc.push_back(scales[i].contiguous());
    bs.push_back(bias ? bias->contiguous() : at::Tensor());
    ys.push_back(torch::empty({M, N}, x_in.options()));
  }
  if (M == 0) return ys;
  const at::Tensor x = x_in.contiguous();
  const float* xp = x.data_ptr<float>();
  std::vector<int8_t> q(M * K, 0);
  std::vector<float> sx(M);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = xp + m * K;
      float amax = 0.f;
      bool finite = true;
      for (int64_t k = 0; k < K; ++k) {
        const float a = std::fabs(row[k]);
        finite = finite && a <= FLT_MAX;
        amax = a > amax ? a : amax;
      }
      if (!finite) { sx[m] = NAN; continue; }
      const float s = (amax > 1e-12f ? amax : 1e-12f) / 127.f;
      for (int64_t k = 0; k < K; ++k)
        q[m * K + k] = (int8_t)std::min(127.f, std::max(-127.f, std::nearbyint(row[k] / s)));
      sx[m] = s;
    }
  });
  std::vector<std::vector<int32_t>> acc;
  std::vector<Int8Segment> segments;
  for (size_t i = 0; i < w.size(); ++i) {
    acc.emplace_back(M * w[i].size(0), 0);
    segments.push_back({w[i].data_ptr<int8_t>(), ws[i].data_ptr<int32_t>(), w[i].size(0), acc[i].data()});
  }
  if (K > 0) rows_product<true>(q.data(), M, K, segments);
  for (size_t i = 0; i < w.size(); ++i) {
    const int64_t N = w[i].size(0);
    const float* sp = sc[i].data_ptr<float>();
    const float* bp = bs[i].defined() ? bs[i].data_ptr<float>() : nullptr;
    float* yp = ys[i].data_ptr<float>();
    const int32_t* ap = acc[i].data();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t n = 0; n < N; ++n) {
          float v = (float)ap[m * N + n] * sx[m];
          v = v * sp[n];
          yp[m * N + n] = bp ? v + bp[n] : v;
        }
    });
  }
  return ys;
}

at::Tensor int8_rows_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& wsum,
                            const at::Tensor& scale, const std::optional<at::Tensor>& bias) {
  return linears("int8_rows_linear", x, {w}, {wsum}, {scale}, {bias})[0];
}

std::vector<at::Tensor> int8_rows_linears(const at::Tensor& x, at::TensorList w, at::TensorList wsum,
                                          at::TensorList scale) {
  return linears("int8_rows_linears", x, w, wsum, scale, std::vector<std::optional<at::Tensor>>(w.size()));
}

// y[m, n] = sum_k x[m, k] * w[n, k] in float32 with AVX2 FMA; each output summed in one fixed order (in eight
// lanes, k = lane mod 8 in order, then across the lanes, then the tail in order), whatever the block it falls in.
static inline float lanes_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A block of R rows of x against C weight rows: R x C accumulators of eight lanes (4 x 3: 12 of the 16 registers)
template <int R, int C>
static inline void float_block(const float* xa, int64_t K, const float* r, float* out, int64_t stride) {
  const int64_t full = K / 8 * 8;
  __m256 acc[R][C];
  for (int m = 0; m < R; ++m) for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < full; k += 8) {
    __m256 b[C];
    for (int c = 0; c < C; ++c) b[c] = _mm256_loadu_ps(r + c * K + k);
    for (int m = 0; m < R; ++m) {
      const __m256 a = _mm256_loadu_ps(xa + m * K + k);
      for (int c = 0; c < C; ++c) acc[m][c] = _mm256_fmadd_ps(a, b[c], acc[m][c]);
    }
  }
  for (int m = 0; m < R; ++m) for (int c = 0; c < C; ++c) {
    float s = lanes_sum(acc[m][c]);
    for (int64_t k = full; k < K; ++k) s += xa[m * K + k] * r[c * K + k];
    out[m * stride + c] = s;
  }
}

template <int C>
static inline void float_rows(const float* xp, int64_t M, int64_t K, const float* r, float* yp, int64_t N) {
  for (int64_t m = 0; m < M; m += 4) {
    switch (std::min<int64_t>(M - m, 4)) {
      case 1: float_block<1, C>(xp + m * K, K, r, yp + m * N, N); break;
      case 2: float_block<2, C>(xp + m * K, K, r, yp + m * N, N); break;
      case 3: float_block<3, C>(xp + m * K, K, r, yp + m * N, N); break;
      default: float_block<4, C>(xp + m * K, K, r, yp + m * N, N); break;
    }
  }
}

// Each y [M, n] = x [M, K] · w [n, K]ᵀ; one parallel region over all the weights, three weight rows a task
static std::vector<at::Tensor> float_products(const char* op, const at::Tensor& x_in, at::TensorList weights) {
  TORCH_CHECK(x_in.dtype() == torch::kFloat32 && x_in.dim() == 2 && x_in.device().is_cpu(), op,
              " takes float32 x [M, in] on the CPU, got ", x_in.dtype(), " ", x_in.sizes());
  std::vector<at::Tensor> w, ys;
  std::vector<int64_t> starts{0};  // each weight's first task
  const int64_t M = x_in.size(0), K = x_in.size(1);
  for (const auto& weight : weights) {
    TORCH_CHECK(weight.dtype() == torch::kFloat32, op, " takes float32 x and weight, got ", x_in.dtype(), ", ",
                weight.dtype());
    TORCH_CHECK(weight.dim() == 2 && weight.size(1) == K, op, " takes x [M, in], weight [out, in], got shapes ",
                x_in.sizes(), ", ", weight.sizes());
    TORCH_CHECK(weight.device().is_cpu(), op, " takes CPU tensors");
    w.push_back(weight.contiguous());
    ys.push_back(torch::empty({M, weight.size(0)}, x_in.options()));
    if (K == 0) ys.back().zero_();
    starts.push_back(starts.back() + (weight.size(0) + 2) / 3);
  }
  if (M == 0 || K == 0) return ys;
  const at::Tensor x = x_in.contiguous();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, starts.back(), 8, [&](int64_t p0, int64_t p1) {
    for (size_t i = 0; i < w.size(); ++i) {
      const int64_t N = w[i].size(0);
      const float* wp = w[i].data_ptr<float>();
      float* yp = ys[i].data_ptr<float>();
      const int64_t first = std::max(p0, starts[i]) - starts[i], last = std::min(p1, starts[i + 1]) - starts[i];
      for (int64_t n = 3 * first; n < std::min(3 * last, N); n += 3) {
        switch (std::min<int64_t>(N - n, 3)) {
          case 1: float_rows<1>(xp, M, K, wp + n * K, yp + n, N); break;
          case 2: float_rows<2>(xp, M, K, wp + n * K, yp + n, N); break;
          default: float_rows<3>(xp, M, K, wp + n * K, yp + n, N); break;
        }
      }
    }
  });
  return ys;
}

at::Tensor float_rows_mm(const at::Tensor& x, const at::Tensor& w) { return float_products("float_rows_mm", x, {w})[0]; }

std::vector<at::Tensor> float_rows_mms(const at::Tensor& x, at::TensorList w) {
  return float_products("float_rows_mms", x, w);
}

// Attention of one query token per row, for decode: out [B, H, D] = softmax(q · Kᵀ · scale over the attended
// slots) · V, q [B, H, D], keys and values [B, kv, S, D] float32 (query head h reads key/value head h / (H / kv)),
// mask [B, S] bool. Each (row, key/value head) is one task: its attended slots listed in order, then for them
// the scores of the head's H / kv query heads (each key read once for all of them), the softmax (max, exp by
// SLEEF's vectorised expf, 1-ulp, as ATen's; the sum in eight lanes), and the weighted sum of the values in
// order. Every float operation runs over the attended slots alone, so a row's bits do not depend on where its
// slots sit (padding) or on its batch-mates. A row with no attended slot gives zeros.
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            const at::Tensor& mask_in, double scale) {
  TORCH_CHECK(q_in.dtype() == torch::kFloat32 && k_in.dtype() == torch::kFloat32 &&
              v_in.dtype() == torch::kFloat32 && mask_in.dtype() == torch::kBool,
              "decode_attention takes float32 q, keys, values and a bool mask, got ", q_in.dtype(), ", ",
              k_in.dtype(), ", ", v_in.dtype(), ", ", mask_in.dtype());
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 4 && k_in.sizes() == v_in.sizes() && mask_in.dim() == 2 &&
              k_in.size(0) == q_in.size(0) && k_in.size(3) == q_in.size(2) && k_in.size(1) > 0 &&
              q_in.size(1) % k_in.size(1) == 0 && mask_in.size(0) == q_in.size(0) && mask_in.size(1) == k_in.size(2),
              "decode_attention takes q [B, H, D], keys and values [B, kv, S, D] (H a multiple of kv), mask [B, S], "
              "got shapes ", q_in.sizes(), ", ", k_in.sizes(), ", ", v_in.sizes(), ", ", mask_in.sizes());
  TORCH_CHECK(q_in.device().is_cpu() && k_in.device().is_cpu() && v_in.device().is_cpu() && mask_in.device().is_cpu(),
              "decode_attention takes CPU tensors");
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), mask = mask_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1), S = k.size(2), G = H / KV;
  auto out = torch::zeros({B, H, D}, q.options());
  const float* qp = q.data_ptr<float>(); const float* kp = k.data_ptr<float>(); const float* vp = v.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>(); float* op = out.data_ptr<float>();
  const float sc = (float)scale;
  at::parallel_for(0, B * KV, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> slots(S);
    std::vector<float> p(G * S);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / KV, hk = t % KV;
      const float* K = kp + t * S * D; const float* V = vp + t * S * D;
      int64_t n = 0;
      for (int64_t j = 0; j < S; ++j) if (mp[b * S + j]) slots[n++] = j;
      if (n == 0) continue;
      const float* Q = qp + (b * H + hk * G) * D;
      float* O = op + (b * H + hk * G) * D;
      for (int64_t i = 0; i < n; i += 4) {  // four slots at a time: four independent sums in flight
        const float* kr[4];
        for (int c = 0; c < 4; ++c) kr[c] = K + slots[std::min(i + c, n - 1)] * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = Q + g * D;
          __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
          int64_t d = 0;
          for (; d + 8 <= D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qr + d);
            for (int c = 0; c < 4; ++c) acc[c] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[c] + d), acc[c]);
          }
          for (int c = 0; c < 4 && i + c < n; ++c) {
            float s = lanes_sum(acc[c]);
            for (int64_t e = d; e < D; ++e) s += qr[e] * kr[c][e];
            p[g * S + i + c] = s * sc;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* pg = p.data() + g * S;
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; ++i) mx = pg[i] > mx ? pg[i] : mx;
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
          const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_loadu_ps(pg + i), vmx));
          _mm256_storeu_ps(pg + i, e);
          vsum = _mm256_add_ps(vsum, e);
        }
        if (i < n) {  // the tail through the same vector function, padded with -inf (exp: 0)
          float tail[8];
          for (int64_t c = 0; c < 8; ++c) tail[c] = i + c < n ? pg[i + c] - mx : -INFINITY;
          const __m256 e = Sleef_expf8_u10(_mm256_loadu_ps(tail));
          _mm256_storeu_ps(tail, e);
          vsum = _mm256_add_ps(vsum, e);
          for (int64_t c = 0; i + c < n; ++c) pg[i + c] = tail[c];
        }
        const float total = lanes_sum(vsum);
        for (int64_t i2 = 0; i2 < n; ++i2) pg[i2] = pg[i2] / total;
        float* og = O + g * D;
        const int64_t full = D / 8 * 8;
        for (int64_t d0 = 0; d0 < full; d0 += 64) {  // 64 of the head's dimensions a pass, held in registers
          const int chunks = (int)std::min<int64_t>(8, (full - d0) / 8);
          __m256 acc[8];
          for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
          for (int64_t i2 = 0; i2 < n; ++i2) {
            const __m256 vw = _mm256_set1_ps(pg[i2]);
            const float* vr = V + slots[i2] * D + d0;
            for (int c = 0; c < chunks; ++c) acc[c] = _mm256_fmadd_ps(vw, _mm256_loadu_ps(vr + 8 * c), acc[c]);
          }
          for (int c = 0; c < chunks; ++c) _mm256_storeu_ps(og + d0 + 8 * c, acc[c]);
        }
        for (int64_t i2 = 0; i2 < n; ++i2)
          for (int64_t d = full; d < D; ++d) og[d] += pg[i2] * V[slots[i2] * D + d];
      }
    }
  });
  return out;
}

TORCH_LIBRARY(overdrive_rows, m) {
  m.def("int8_rows_mm(Tensor x, Tensor weight, Tensor weight_sums) -> Tensor");
  m.def("int8_rows_linear(Tensor x, Tensor weight, Tensor weight_sums, Tensor scale, Tensor? bias) -> Tensor");
  m.def("int8_rows_linears(Tensor x, Tensor[] weights, Tensor[] weight_sums, Tensor[] scales) -> Tensor[]");
  m.def("float_rows_mm(Tensor x, Tensor weight) -> Tensor");
  m.def("float_rows_mms(Tensor x, Tensor[] weights) -> Tensor[]");
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(overdrive_rows, CPU, m) {
  m.impl("int8_rows_mm", &int8_rows_mm);
  m.impl("int8_rows_linear", &int8_rows_linear);
  m.impl("int8_rows_linears", &int8_rows_linears);
  m.impl("float_rows_mm", &float_rows_mm);
  m.impl("float_rows_mms", &float_rows_mms);
  m.impl("decode_attention", &decode_attention);
}
