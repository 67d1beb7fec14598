// Integer matrix products for quantized decode steps on x86 CPUs with AVX2 (every x86 CPU the
// course has met: AMD Zen 3 and 4, Intel Xeon). Loaded by int_kernels.py; the why is there.
//
// Both products quantize the activations to int8 in blocks of 32 (one float scale a block) and
// multiply integers: _mm256_maddubs_epi16 takes 32 unsigned-by-signed byte products in one
// instruction, so a weight costs a fraction of an instruction instead of a load, a conversion and
// a fused multiply-add in float. The weights stay in memory as they are stored (4 or 8 bits).
//
// Built with -fopenmp: at::parallel_for's parallel region is inlined from PyTorch's headers. The
// library then links libgomp.so.1 by name, which resolves to the copy PyTorch loaded: one runtime.
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // activations: one int8 scale per 32 values

inline float horizontal_max(__m256 v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

// x (rows, K) float -> int8 (rows, K), one scale and (where `sum` is given) the float sum of each
// block of 32. A block holding a NaN or an infinity gets a NaN scale, so the outputs it feeds are
// NaN, as a float product's would be, rather than finite numbers made from clamped levels.
// The levels are rounded in vector registers: std::nearbyint, std::fmin and std::fmax are calls
// that keep the floating-point environment, about ninety cycles a value, which made quantizing
// the input cost more than multiplying it by a 576-wide matrix of 64 rows. The round-to-nearest-
// even and the clamp to ±127 are the scalar ones, value for value; the sum stays a scalar sum in
// order, so the offsets of int4 products are what they were, to the bit.
void quantize_rows(const float* x, int64_t rows, int64_t K, int8_t* q, float* scale, float* sum) {
    const int64_t blocks = K / kBlock;
    const __m256 sign = _mm256_set1_ps(-0.f), high = _mm256_set1_ps(127.f), low = _mm256_set1_ps(-127.f);
    // packs interleave the 128-bit lanes: this puts the 32 bytes back in order
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < blocks; ++b) {
            const float* v = x + r * K + b * kBlock;
            __m256 part[4];
            __m256 amax = _mm256_setzero_ps();
            for (int i = 0; i < 4; ++i) {
                part[i] = _mm256_loadu_ps(v + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, part[i]));
            }
            float total = 0.f;
            for (int i = 0; i < kBlock; ++i) total += v[i];
            int8_t* out = q + r * K + b * kBlock;
            float d = horizontal_max(amax) / 127.f;
            if (!std::isfinite(total)) {  // a NaN or an infinity: levels 0 under a NaN scale
                d = NAN;
                std::fill(out, out + kBlock, int8_t{0});
            } else {
                const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);  // an all-zero block: levels 0
                __m256i level[4];
                for (int i = 0; i < 4; ++i) {
                    const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(part[i], inv),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    level[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(rounded, low), high));
                }
                const __m256i words = _mm256_packs_epi32(level[0], level[1]), more = _mm256_packs_epi32(level[2], level[3]);
                const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, more), order);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bytes);
            }
            scale[r * blocks + b] = d;
            if (sum) sum[r * blocks + b] = total;
        }
    }
}

inline float horizontal_sum(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_hadd_ps(h, h);
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(h);
}

// Output column n for R activation rows m ... m + R - 1 of an int4 weight row in the paired
// layout (int_kernels.py's int4_layout): each 32 bytes hold two blocks of 32 levels, the first
// block in the low four bits of each byte and the second in the high four. One load, one shift
// and two masks unpack 64 weights (unpacking a block of stage 08's interleaved nibbles took as
// many instructions as its products); the two blocks go into two accumulators, so a fused
// multiply-add does not wait for the one before it. A row's sums are made in the same order
// whatever R is: a request's outputs do not depend on the batch around it.
template <int R>
inline void int4_rows(const uint8_t* levels, const uint16_t* scale_low, int64_t per_group, const int8_t* xq,
                      const float* dx, const float* xs, int64_t K, int64_t blocks, int64_t m, int64_t N, int64_t n,
                      float* out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 first[R], second[R];
    float offset[R];
    for (int r = 0; r < R; ++r) {
        first[r] = second[r] = _mm256_setzero_ps();
        offset[r] = 0.f;
    }
    for (int64_t b = 0; b < blocks; b += 2) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(levels + b * 16));
        const __m256i low_block = _mm256_and_si256(bytes, low4);
        const __m256i high_block = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        const int64_t g0 = b / per_group, g1 = (b + 1) / per_group;
        const float s0 = _cvtsh_ss(scale_low[2 * g0]), low0 = _cvtsh_ss(scale_low[2 * g0 + 1]);
        const float s1 = _cvtsh_ss(scale_low[2 * g1]), low1 = _cvtsh_ss(scale_low[2 * g1 + 1]);
        for (int r = 0; r < R; ++r) {
            const int8_t* x = xq + (m + r) * K + b * kBlock;
            const float* d = dx + (m + r) * blocks + b;
            const float* sums = xs + (m + r) * blocks + b;
            const __m256i dot0 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(low_block, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), ones);
            const __m256i dot1 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(high_block, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + kBlock))), ones);
            first[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), _mm256_set1_ps(s0 * d[0]), first[r]);
            second[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), _mm256_set1_ps(s1 * d[1]), second[r]);
            offset[r] += low0 * sums[0] + low1 * sums[1];
        }
    }
    for (int r = 0; r < R; ++r) out[(m + r) * N + n] = horizontal_sum(_mm256_add_ps(first[r], second[r])) + offset[r];
}

// Output column n of an int8 weight (row `weights`, scale `scale`) for activation rows m ... m + R - 1.
template <int R>
inline void int8_rows(const int8_t* weights, float scale, const int8_t* xq, const float* dx, int64_t K,
                      int64_t blocks, int64_t m, int64_t N, int64_t n, float* out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + b * kBlock));
        for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (m + r) * K + b * kBlock));
            // maddubs multiplies unsigned by signed bytes: |x| times w carrying x's sign (w = -128 would
            // flip wrongly: stage 08 keeps int8 weights within ±127)
            const __m256i dot = _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dx[(m + r) * blocks + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[(m + r) * N + n] = horizontal_sum(acc[r]) * scale;
}

void check_activations(const at::Tensor& x, int64_t K, const char* op) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
                op, ": x should be a contiguous float32 CPU matrix (rows, in), got ", x.sizes(), " ",
                x.scalar_type());
    TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " columns but the weight takes ", K);
    TORCH_CHECK(K % kBlock == 0, op, ": the input width ", K, " is not a multiple of ", kBlock);
}

// x (M, K) float32 times an int4 weight -> (M, N) float32.
// q (N, K/2) uint8 in the paired layout: byte i of each 32 holds level i of one block of 32 columns
// in its low four bits and level i of the next block in its high four (levels 0 ... 15).
// scale_low (N, K/group, 2) float16: per group, w = level * scale + low.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale_low,
                       int64_t group) {
    TORCH_CHECK(q.dim() == 2, "aie::int4_linear: q should be (out, in / 2), got ", q.sizes());
    const int64_t N = q.size(0), K = q.size(1) * 2, M = x.size(0);
    check_activations(x, K, "aie::int4_linear");
    TORCH_CHECK(group > 0 && group % kBlock == 0 && K % group == 0, "aie::int4_linear: groups of ", group,
                " do not tile ", K, " columns in blocks of ", kBlock);
    TORCH_CHECK(K % (2 * kBlock) == 0, "aie::int4_linear: the input width ", K, " is not a multiple of ",
                2 * kBlock, " (the layout pairs blocks of ", kBlock, ")");
    const int64_t G = K / group, per_group = group / kBlock, blocks = K / kBlock;
    TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous(), "aie::int4_linear: q should be contiguous uint8");
    TORCH_CHECK(scale_low.scalar_type() == at::kHalf && scale_low.is_contiguous() &&
                    scale_low.sizes() == at::IntArrayRef({N, G, 2}),
                "aie::int4_linear: scale_low should be contiguous float16 of shape (", N, ", ", G, ", 2), got ",
                scale_low.sizes(), " ", scale_low.scalar_type(), ". Fix: make it with int_kernels.int4_layout");

    std::vector<int8_t> xq(M * K);
    std::vector<float> dx(M * blocks), xs(M * blocks);
    quantize_rows(x.data_ptr<float>(), M, K, xq.data(), dx.data(), xs.data());
    at::Tensor y = at::empty({M, N}, x.options());
    const uint8_t* w = q.data_ptr<uint8_t>();
    const uint16_t* sl = reinterpret_cast<const uint16_t*>(scale_low.data_ptr<at::Half>());
    float* out = y.data_ptr<float>();

    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
            const uint8_t* row = w + n * (K / 2);
            const uint16_t* pairs = sl + n * G * 2;
            int64_t m = 0;
            for (; m + 4 <= M; m += 4)
                int4_rows<4>(row, pairs, per_group, xq.data(), dx.data(), xs.data(), K, blocks, m, N, n, out);
            for (; m < M; ++m)
                int4_rows<1>(row, pairs, per_group, xq.data(), dx.data(), xs.data(), K, blocks, m, N, n, out);
        }
    });
    return y;
}

// x (M, K) float32 times an int8 weight q (N, K) with one float32 scale per row -> (M, N) float32.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
    TORCH_CHECK(q.dim() == 2, "aie::int8_linear: q should be (out, in), got ", q.sizes());
    const int64_t N = q.size(0), K = q.size(1), M = x.size(0);
    check_activations(x, K, "aie::int8_linear");
    TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "aie::int8_linear: q should be contiguous int8");
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1 && scale.numel() == N,
                "aie::int8_linear: scale should be contiguous float32 of shape (", N, ",)");
    const int64_t blocks = K / kBlock;

    std::vector<int8_t> xq(M * K);
    std::vector<float> dx(M * blocks);
    quantize_rows(x.data_ptr<float>(), M, K, xq.data(), dx.data(), nullptr);
    at::Tensor y = at::empty({M, N}, x.options());
    const int8_t* w = q.data_ptr<int8_t>();
    const float* sw = scale.data_ptr<float>();
    float* out = y.data_ptr<float>();

    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
            int64_t m = 0;
            for (; m + 4 <= M; m += 4) int8_rows<4>(w + n * K, sw[n], xq.data(), dx.data(), K, blocks, m, N, n, out);
            for (; m < M; ++m) int8_rows<1>(w + n * K, sw[n], xq.data(), dx.data(), K, blocks, m, N, n, out);
        }
    });
    return y;
}

}  // namespace

TORCH_LIBRARY(aie, m) {
    m.def("int4_linear(Tensor x, Tensor q, Tensor scale_low, int group) -> Tensor");
    m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(aie, CPU, m) {
    m.impl("int4_linear", &int4_linear);
    m.impl("int8_linear", &int8_linear);
}
