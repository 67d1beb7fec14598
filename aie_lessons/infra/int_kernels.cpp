// Integer matrix products for quantized decode steps on x86 CPUs with AVX2 (every x86 CPU the
// course has met: AMD Zen 3 and 4, Intel Xeon). Loaded by int_kernels.py; the why is there.
//
// Both products quantize the activations to int8 in blocks of 32 (one float scale a block) and
// multiply integers: _mm256_maddubs_epi16 takes 32 unsigned-by-signed byte products in one
// instruction, so a weight costs a fraction of an instruction instead of a load, a conversion and
// a fused multiply-add in float. The weights stay at 4 or 8 bits, in tiles of four rows
// (int_kernels.py's layouts).
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
constexpr int kTile = 4;       // weights: output columns a tile

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

inline __m128 fold_halves(__m256 v) {
    return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

// The horizontal sums of four accumulators, each added as a single vector's sum is: the two
// halves, then neighbours, then the pairs.
inline __m128 horizontal_sums(const __m256 v[kTile]) {
    const __m128 pairs01 = _mm_hadd_ps(fold_halves(v[0]), fold_halves(v[1]));
    const __m128 pairs23 = _mm_hadd_ps(fold_halves(v[2]), fold_halves(v[3]));
    return _mm_hadd_ps(pairs01, pairs23);
}

// Weight bytes a loop touches about this far ahead are asked for before it needs them: the
// hardware's prefetchers alone left a step's products at half the memory's speed on a Zen 3.
constexpr int64_t kAhead = 2048;

// Asks for the two cache lines kAhead bytes past `at`. A hint, never a load: near a weight's end
// the address lies past it, so it is made as an integer rather than as a pointer into the weight.
inline void prefetch_ahead(const void* at) {
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(at) + kAhead;
    _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 64), _MM_HINT_T0);
}

// Why tiles of four output columns (four rows of the weight): one weight row at batch 1 is a few
// hundred bytes, and a row
// at a time keeps one chain of fused multiply-adds waiting on itself. Four columns make four
// independent chains, share each block of activations (loaded, its signs taken) between them,
// and end in one horizontal sum of four. The tile's blocks are interleaved in memory
// (int_kernels.py's layouts), so the four columns are still read front to back as one stream:
// with four rows read side by side from a plain layout the products got slower, not faster.
// Each output is its own accumulator over the blocks in order, so its bits do not depend on the
// tile, on the rows around it or on the threads.

// Columns 4t ... 4t + 3 of one activation row times an int4 tile: per pair of blocks 128 bytes,
// 32 a column (low nibbles one block of 32 levels, high nibbles the next); per group the tile's
// four scales then its four lows, float16.
inline void int4_tile(const uint8_t* levels, const uint16_t* scale_low, int64_t per_group, const int8_t* x,
                      const float* dx, const float* sums, int64_t blocks, float* out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 first[kTile], second[kTile];
    for (int c = 0; c < kTile; ++c) first[c] = second[c] = _mm256_setzero_ps();
    __m128 offset = _mm_setzero_ps();
    alignas(16) float step0[kTile], step1[kTile];
    for (int64_t b = 0; b < blocks; b += 2) {
        const uint8_t* tile = levels + b * (kTile * kBlock / 2);
        prefetch_ahead(tile);
        const uint16_t* g0 = scale_low + (b / per_group) * 2 * kTile;
        const uint16_t* g1 = scale_low + ((b + 1) / per_group) * 2 * kTile;
        const auto halves = [](const uint16_t* h) {
            return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h)));
        };
        // a weight is level × scale + low: the scales meet each block's activation scale, the
        // lows each block's sum
        _mm_store_ps(step0, _mm_mul_ps(halves(g0), _mm_set1_ps(dx[b])));
        _mm_store_ps(step1, _mm_mul_ps(halves(g1), _mm_set1_ps(dx[b + 1])));
        offset = _mm_add_ps(offset, _mm_fmadd_ps(halves(g0 + kTile), _mm_set1_ps(sums[b]),
                                                 _mm_mul_ps(halves(g1 + kTile), _mm_set1_ps(sums[b + 1]))));
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b * kBlock));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b * kBlock + kBlock));
        for (int c = 0; c < kTile; ++c) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + c * kBlock));
            const __m256i low_block = _mm256_and_si256(bytes, low4);
            const __m256i high_block = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            const __m256i dot0 = _mm256_madd_epi16(_mm256_maddubs_epi16(low_block, x0), ones);
            const __m256i dot1 = _mm256_madd_epi16(_mm256_maddubs_epi16(high_block, x1), ones);
            first[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), _mm256_broadcast_ss(step0 + c), first[c]);
            second[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), _mm256_broadcast_ss(step1 + c), second[c]);
        }
    }
    __m256 both[kTile];
    for (int c = 0; c < kTile; ++c) both[c] = _mm256_add_ps(first[c], second[c]);
    _mm_storeu_ps(out, _mm_add_ps(horizontal_sums(both), offset));
}

// Columns 4t ... 4t + 3 of one activation row times an int8 tile (per block of 32 columns 128
// bytes, 32 a column) with the columns' float scales.
inline void int8_tile(const int8_t* weights, const float* scale, const int8_t* x, const float* dx, int64_t blocks,
                      float* out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[kTile];
    for (int c = 0; c < kTile; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* tile = weights + b * kTile * kBlock;
        prefetch_ahead(tile);
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b * kBlock));
        const __m256i magnitude = _mm256_sign_epi8(xv, xv);
        const __m256 d = _mm256_set1_ps(dx[b]);
        for (int c = 0; c < kTile; ++c) {
            const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + c * kBlock));
            // maddubs multiplies unsigned by signed bytes: |x| times w carrying x's sign (w = -128 would
            // flip wrongly: stage 08 keeps int8 weights within ±127)
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(wv, xv)), ones);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[c]);
        }
    }
    _mm_storeu_ps(out, _mm_mul_ps(horizontal_sums(acc), _mm_loadu_ps(scale)));
}

void check_activations(const at::Tensor& x, int64_t K, const char* op) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
                op, ": x should be a contiguous float32 CPU matrix (rows, in), got ", x.sizes(), " ",
                x.scalar_type());
    TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " columns but the weight takes ", K);
    TORCH_CHECK(K % kBlock == 0, op, ": the input width ", K, " is not a multiple of ", kBlock);
}

// The weight's tiles: output columns in fours (out_features a multiple of 4), rows of a tile
// interleaved block by block as int_kernels.py's layouts store them.
void check_tiles(const at::Tensor& q, at::ScalarType type, const char* type_name, int64_t width, const char* op,
                 const char* layout) {
    TORCH_CHECK(q.dim() == 4 && q.size(2) == kTile && q.size(3) == kBlock && q.scalar_type() == type &&
                    q.is_contiguous(),
                op, ": q should be contiguous ", type_name, " tiles (out / 4, in / ", width, ", 4, 32), got ",
                q.sizes(), " ", q.scalar_type(), ". Fix: make it with int_kernels.", layout);
}

// x (M, K) float32 times an int4 weight -> (M, N) float32.
// q (N/4, K/64, 4, 32) uint8: per tile of four columns and pair of blocks, byte i of a column's
// 32 holds level i of one block of 32 inputs in its low four bits and level i of the next block
// in its high four (levels 0 ... 15).
// scale_low (N/4, K/group, 2, 4) float16: per tile and group, the four columns' scales, then their
// lows: w = level * scale + low.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale_low,
                       int64_t group) {
    check_tiles(q, at::kByte, "uint8", 2 * kBlock, "aie::int4_linear", "int4_layout");
    const int64_t tiles = q.size(0), N = tiles * kTile, K = q.size(1) * 2 * kBlock, M = x.size(0);
    check_activations(x, K, "aie::int4_linear");
    TORCH_CHECK(group > 0 && group % kBlock == 0 && K % group == 0, "aie::int4_linear: groups of ", group,
                " do not tile ", K, " columns in blocks of ", kBlock);
    const int64_t G = K / group, per_group = group / kBlock, blocks = K / kBlock;
    TORCH_CHECK(scale_low.scalar_type() == at::kHalf && scale_low.is_contiguous() &&
                    scale_low.sizes() == at::IntArrayRef({tiles, G, 2, kTile}),
                "aie::int4_linear: scale_low should be contiguous float16 of shape (", tiles, ", ", G, ", 2, ", kTile,
                "), got ", scale_low.sizes(), " ", scale_low.scalar_type(), ". Fix: make it with int_kernels.int4_layout");

    std::vector<int8_t> xq(M * K);
    std::vector<float> dx(M * blocks), xs(M * blocks);
    quantize_rows(x.data_ptr<float>(), M, K, xq.data(), dx.data(), xs.data());
    at::Tensor y = at::empty({M, N}, x.options());
    const uint8_t* w = q.data_ptr<uint8_t>();
    const uint16_t* sl = reinterpret_cast<const uint16_t*>(scale_low.data_ptr<at::Half>());
    float* out = y.data_ptr<float>();

    // a thread takes whole tiles; a tile's rows of x follow one another while its bytes are in cache
    at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
            for (int64_t m = 0; m < M; ++m)
                int4_tile(w + t * kTile * K / 2, sl + t * G * 2 * kTile, per_group, xq.data() + m * K,
                          dx.data() + m * blocks, xs.data() + m * blocks, blocks, out + m * N + t * kTile);
    });
    return y;
}

// x (M, K) float32 times an int8 weight -> (M, N) float32.
// q (N/4, K/32, 4, 32) int8: per tile of four columns and block of 32 inputs, the columns' 32
// weights one after another; scale (N,) float32, one a column.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
    check_tiles(q, at::kChar, "int8", kBlock, "aie::int8_linear", "tiled");
    const int64_t tiles = q.size(0), N = tiles * kTile, K = q.size(1) * kBlock, M = x.size(0);
    check_activations(x, K, "aie::int8_linear");
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1 && scale.numel() == N,
                "aie::int8_linear: scale should be contiguous float32 of shape (", N, ",), one a weight row, got ",
                scale.sizes(), " ", scale.scalar_type(), ". Fix: stage 08's quantize_int8 scale, .float().contiguous()");
    const int64_t blocks = K / kBlock;

    std::vector<int8_t> xq(M * K);
    std::vector<float> dx(M * blocks);
    quantize_rows(x.data_ptr<float>(), M, K, xq.data(), dx.data(), nullptr);
    at::Tensor y = at::empty({M, N}, x.options());
    const int8_t* w = q.data_ptr<int8_t>();
    const float* sw = scale.data_ptr<float>();
    float* out = y.data_ptr<float>();

    at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
            for (int64_t m = 0; m < M; ++m)
                int8_tile(w + t * kTile * K, sw + t * kTile, xq.data() + m * K, dx.data() + m * blocks, blocks,
                          out + m * N + t * kTile);
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
