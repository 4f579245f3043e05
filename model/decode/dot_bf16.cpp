// bfloat16 projections on the CPU's bfloat16 instructions: one row on the dot-product instruction (AVX512_BF16
// `vdpbf16ps`), several rows on AMX tiles (`tdpbf16ps`) where the CPU has them.
// Float32 projections of several rows on the same dot-product tiles with fused multiply-adds (AVX-512F).
//
// Registered as operators of the `star_elastic` library so that a compiled decode step calls them from its
// C++ wrapper through the dispatcher, with no interpreter between them (model/decode/dot_bf16.py builds this
// file and says when it is used). Each output is a dot product of bfloat16 values accumulated in float32:
// the products of two bfloat16 values are exact in float32, so this differs from the generated loop's
// float32 multiply-and-add only in the order of the additions (and in flushing denormal inputs to zero).
//
//   gemv_bf16(x (in,), w (out, in)) -> (out,) float32
//   gemv_bf16_gather(x (k, in), w (E, out, in), idx (k,) int64) -> (k, out) float32, row j by w[idx[j]]
//   gemm_bf16(x (m, in), w (out, in)) -> (m, out) float32
//   gemm_bf16_grouped(x (T, in), w (E, out, in), offs (E,) int32) -> (T, out) float32, rows by expert
//   gemm_f32(x (m, in), w (out, in)) / gemm_f32_grouped(...): the same for float32 (fused multiply-adds)
//   argmax_rows(logits (rows, vocab) float32 / bfloat16) -> (rows,) int64, torch.argmax's pick (greedy decoding)
//
// Weights need a contiguous last dimension (any row stride); x's rows too (row stride 0 broadcasts one row).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define STAR_ELASTIC_X86 1
#endif

namespace {

constexpr int64_t kRowsPerTask = 4;  // rows that share one pass over x (four accumulators in flight)
// A task asks for the rows two tasks ahead of it (8 rows, ~8 KB at 512 inputs) to be fetched while it computes:
// weights that come from memory stream ~1.4x faster so (a 49,152 x 512 GEMV over 400 MB of weights, 2 threads:
// ~16 -> ~22 GB/s), ones already in the cache ~0.88x as fast (benchmarks/RESULTS.md). Switched at run time by
// star_elastic::dot_bf16_prefetch (on by default; off for the paired benchmark's variant).
constexpr int64_t kPrefetchRows = 2 * kRowsPerTask;
std::atomic<bool> prefetch_on{true};

bool supported() {
#ifdef STAR_ELASTIC_X86
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

#ifdef STAR_ELASTIC_X86
#define STAR_ELASTIC_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Dot products of ROWS weight rows with XR rows of x (x_stride apart): out[i * x_step + r * row_step] for x row
// i and weight row r. Each chunk of ROWS weight vectors is loaded once for the XR rows (ROWS * XR accumulators).
template <int ROWS, int XR>
STAR_ELASTIC_BF16_TARGET inline void dot_tile(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                                              int64_t row_stride, int64_t n, float* out, int64_t x_step,
                                              int64_t row_step) {
  __m512 acc[ROWS][XR];
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < XR; ++i) acc[r][i] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    __m512bh wv[ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * row_stride + k);
#pragma GCC unroll 4
    for (int i = 0; i < XR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * x_stride + k);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv[r], xv);
    }
  }
  if (k < n) {
    const __mmask32 mask = (__mmask32)((1ULL << (n - k)) - 1);
    __m512bh wv[ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * row_stride + k);
#pragma GCC unroll 4
    for (int i = 0; i < XR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * x_stride + k);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv[r], xv);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < XR; ++i) out[i * x_step + r * row_step] = _mm512_reduce_add_ps(acc[r][i]);
  }
}

// The same tiles for float32 weights and rows (several-rows float32 projections): a fused multiply-add of 16
// values per instruction, each output one 16-lane accumulator summed at the end, so an output does not depend
// on how many rows are computed beside it.
template <int ROWS, int XR>
STAR_ELASTIC_BF16_TARGET inline void dot_tile(const float* x, int64_t x_stride, const float* w, int64_t row_stride,
                                              int64_t n, float* out, int64_t x_step, int64_t row_step) {
  __m512 acc[ROWS][XR];
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < XR; ++i) acc[r][i] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    __m512 wv[ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) wv[r] = _mm512_loadu_ps(w + r * row_stride + k);
#pragma GCC unroll 4
    for (int i = 0; i < XR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * x_stride + k);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) acc[r][i] = _mm512_fmadd_ps(wv[r], xv, acc[r][i]);
    }
  }
  if (k < n) {
    const __mmask16 mask = (__mmask16)((1u << (n - k)) - 1);
    __m512 wv[ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, w + r * row_stride + k);
#pragma GCC unroll 4
    for (int i = 0; i < XR; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * x_stride + k);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) acc[r][i] = _mm512_fmadd_ps(wv[r], xv, acc[r][i]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < XR; ++i) out[i * x_step + r * row_step] = _mm512_reduce_add_ps(acc[r][i]);
  }
}

template <int ROWS, typename T>
STAR_ELASTIC_BF16_TARGET void dot_rows_tiles(const T* x, int64_t x_stride, int64_t m, const T* w,
                                             int64_t row_stride, int64_t n, float* out, int64_t x_step,
                                             int64_t row_step) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) dot_tile<ROWS, 4>(x + i * x_stride, x_stride, w, row_stride, n, out + i * x_step, x_step, row_step);
  switch (m - i) {
    case 3: return dot_tile<ROWS, 3>(x + i * x_stride, x_stride, w, row_stride, n, out + i * x_step, x_step, row_step);
    case 2: return dot_tile<ROWS, 2>(x + i * x_stride, x_stride, w, row_stride, n, out + i * x_step, x_step, row_step);
    case 1: return dot_tile<ROWS, 1>(x + i * x_stride, x_stride, w, row_stride, n, out + i * x_step, x_step, row_step);
    default: return;
  }
}

// `rows` (1-4) weight rows against m rows of x; prefetches `rows` rows from `ahead` first when it is not null.
// T is uint16_t (bfloat16) or float.
template <typename T>
STAR_ELASTIC_BF16_TARGET void dot_block(const T* x, int64_t x_stride, int64_t m, const T* w, int64_t row_stride,
                                        int64_t rows, int64_t n, float* out, int64_t x_step, int64_t row_step,
                                        const T* ahead) {
  if (ahead != nullptr) {
    for (int64_t r = 0; r < rows; ++r) {
      const char* row = reinterpret_cast<const char*>(ahead + r * row_stride);
      for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
  }
  switch (rows) {
    case 4: return dot_rows_tiles<4>(x, x_stride, m, w, row_stride, n, out, x_step, row_step);
    case 3: return dot_rows_tiles<3>(x, x_stride, m, w, row_stride, n, out, x_step, row_step);
    case 2: return dot_rows_tiles<2>(x, x_stride, m, w, row_stride, n, out, x_step, row_step);
    default: return dot_rows_tiles<1>(x, x_stride, m, w, row_stride, n, out, x_step, row_step);
  }
}
#else
template <typename T>
void dot_block(const T*, int64_t, int64_t, const T*, int64_t, int64_t, int64_t, float*, int64_t, int64_t, const T*) {
  TORCH_CHECK(false, "this CPU has no AVX512_BF16 (the dot-product operators' requirement)");
}
#endif

void check_operands(const at::Tensor& x, const at::Tensor& w, int64_t dims, at::ScalarType dtype = at::kBFloat16,
                    const char* op = "gemv_bf16") {
  TORCH_CHECK(supported(), op, ": this CPU has no bfloat16 dot-product instruction (AVX512_BF16)");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == dtype && w.scalar_type() == dtype, op, ": x and w must be ",
              dtype == at::kFloat ? "float32" : "bfloat16", ", got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(w.dim() == dims, op, ": w must have ", dims, " dimensions, got ", w.sizes());
  TORCH_CHECK(w.stride(-1) == 1 && x.stride(-1) == 1, op, ": the last dimension of x and w must be contiguous");
  TORCH_CHECK(x.size(-1) == w.size(-1), op, ": x has ", x.size(-1), " inputs, w ", w.size(-1));
}

// One task: up to kRowsPerTask consecutive rows of one weight matrix against one x.
struct Task {
  const uint16_t* w;  // the task's first weight row
  const uint16_t* x;
  float* out;
  int64_t rows;
  const uint16_t* ahead;  // `rows` rows to prefetch (kPrefetchRows further on in the same matrix), or nullptr
};

// The rows kPrefetchRows after row `first` of a matrix of `out_rows` rows at `w`, when they are all in it.
template <typename T>
const T* rows_ahead(const T* w, int64_t first, int64_t rows, int64_t out_rows, int64_t row_stride) {
  const int64_t next = first + kPrefetchRows;
  return prefetch_on.load(std::memory_order_relaxed) && next + rows <= out_rows ? w + next * row_stride : nullptr;
}

// Runs `tasks` tasks over torch's intra-op threads; `task(t)` describes task t.
template <typename MakeTask>
void run_tasks(int64_t tasks, int64_t row_stride, int64_t n, MakeTask task) {
  // Grain: ~128 KB of weights per chunk at least, so a small projection is not split across threads.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, kRowsPerTask * n));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Task job = task(t);
      dot_block(job.x, 0, 1, job.w, row_stride, job.rows, n, job.out, 0, 1, job.ahead);  // one x row
    }
  });
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w) {
  check_operands(x, w, 2);
  TORCH_CHECK(x.dim() == 1, "gemv_bf16: x must be one row (in,), got ", x.sizes());
  const int64_t out_rows = w.size(0), n = w.size(1), row_stride = w.stride(0);
  at::Tensor out = at::empty({out_rows}, x.options().dtype(at::kFloat));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.const_data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t tasks = (out_rows + kRowsPerTask - 1) / kRowsPerTask;
  run_tasks(tasks, row_stride, n, [&](int64_t t) {
    const int64_t first = t * kRowsPerTask, rows = std::min(kRowsPerTask, out_rows - first);
    return Task{wp + first * row_stride, xp, op + first, rows, rows_ahead(wp, first, rows, out_rows, row_stride)};
  });
  return out;
}

at::Tensor gemv_bf16_gather(const at::Tensor& x, const at::Tensor& w, const at::Tensor& idx) {
  check_operands(x, w, 3);
  TORCH_CHECK(x.dim() == 2 && idx.dim() == 1 && idx.size(0) == x.size(0),
              "gemv_bf16_gather: x must be (k, in) and idx (k,), got ", x.sizes(), " and ", idx.sizes());
  TORCH_CHECK(idx.scalar_type() == at::kLong, "gemv_bf16_gather: idx must be int64, got ", idx.scalar_type());
  const int64_t k = x.size(0), experts = w.size(0), out_rows = w.size(1), n = w.size(2);
  const int64_t row_stride = w.stride(1), expert_stride = w.stride(0), x_stride = x.stride(0);
  const at::Tensor idx_c = idx.contiguous();
  const int64_t* ip = idx_c.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j) {
    TORCH_CHECK(ip[j] >= 0 && ip[j] < experts, "gemv_bf16_gather: expert index ", ip[j], " out of range [0, ",
                experts, ")");
  }
  at::Tensor out = at::empty({k, out_rows}, x.options().dtype(at::kFloat));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.const_data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t per_row = (out_rows + kRowsPerTask - 1) / kRowsPerTask;
  run_tasks(k * per_row, row_stride, n, [&](int64_t t) {
    const int64_t j = t / per_row, first = (t % per_row) * kRowsPerTask;
    const int64_t rows = std::min(kRowsPerTask, out_rows - first);
    const uint16_t* expert = wp + ip[j] * expert_stride;
    return Task{expert + first * row_stride, xp + j * x_stride, op + j * out_rows + first, rows,
                rows_ahead(expert, first, rows, out_rows, row_stride)};
  });
  return out;
}

// ---------------------------------------------------------------------------------------------- several rows
// x (m, in) by w (out, in) for m >= 2, on AMX where the CPU has it: C^T = W X^T with a 16-row block of W as the
// A tile, read straight from the weight (its rows are the tile's rows, 64 bytes = 32 inputs each), and x packed
// once per call as the B tile (pairs of inputs interleaved per row, as TDPBF16PS takes them). A weight is read
// once for up to 16 rows of x; 16 more rows read its block again from the cache. Weight rows past the last
// multiple of 32, inputs that are not a multiple of 32, and CPUs without AMX take the dot-product tiles above.

constexpr int64_t kAmxRows = 32;  // weight rows per AMX job: two A tiles of 16 rows
constexpr int64_t kAmxX = 16;     // x rows per B tile
std::atomic<bool> amx_on{true};

struct alignas(64) TileConfig {
  uint8_t palette_id = 0;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "AMX tile configuration is 64 bytes");

bool amx_supported() {
#ifdef STAR_ELASTIC_X86
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!supported() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
    // Linux hands out the tile registers' state only to processes that ask (ARCH_REQ_XCOMP_PERM, XTILEDATA).
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// x rows [start, start + count) (count <= 16) of one weight matrix; `pack` is their B tiles, n / 32 of them.
struct RowGroup {
  int64_t start, count, matrix;
  const uint16_t* pack;
};

#ifdef STAR_ELASTIC_X86
#define STAR_ELASTIC_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))

// Sets this thread's tiles for B tiles of `count` x rows and puts back what the thread had when it ends (the
// library GEMMs use the tiles too). Inactive (touches no tile state) where AMX is not used.
struct TileScope {
  TileConfig saved;
  int64_t count = -1;
  bool active;
  STAR_ELASTIC_AMX_TARGET explicit TileScope(bool use) : active(use) {
    if (active) {
      _tile_storeconfig(&saved);
      asm volatile("" ::: "memory");  // GCC 12 does not see the builtins touch memory: keep the stores, reloads
    }
  }
  STAR_ELASTIC_AMX_TARGET void set(int64_t x_rows) {
    if (x_rows == count) return;
    TileConfig cfg;
    cfg.palette_id = 1;
    const auto bytes = static_cast<uint16_t>(x_rows * 4);
    for (int t : {0, 1, 4}) cfg.colsb[t] = bytes, cfg.rows[t] = 16;  // C tiles (16 x count floats), B tile
    for (int t : {2, 3}) cfg.colsb[t] = 64, cfg.rows[t] = 16;        // A tiles: 16 weight rows x 32 inputs
    asm volatile("" ::: "memory");
    _tile_loadconfig(&cfg);
    count = x_rows;
  }
  STAR_ELASTIC_AMX_TARGET ~TileScope() {
    if (!active) return;
    asm volatile("" ::: "memory");
    if (saved.palette_id != 0) {
      _tile_loadconfig(&saved);
    } else {
      _tile_release();
    }
  }
};

// B tiles of x rows [0, count): for each 32 inputs, 16 rows of `count` pairs (pack[(kb * 16 + p) * count + j]
// holds inputs 2p, 2p + 1 of the block for x row j, as one 32-bit word).
void pack_x(const uint16_t* x, int64_t x_stride, int64_t count, int64_t n, uint32_t* pack) {
  for (int64_t kb = 0; kb < n / 32; ++kb) {
    for (int64_t p = 0; p < 16; ++p) {
      for (int64_t j = 0; j < count; ++j) {
        std::memcpy(pack + (kb * 16 + p) * count + j, x + j * x_stride + kb * 32 + 2 * p, 4);
      }
    }
  }
}

// 32 weight rows (row_stride apart) against one group's B tiles: out[j * out_stride + r] for x row j and weight
// row r. A C tile's rows are weight rows: each is stored to the stack and its columns written out as 16-float
// vectors, one 64-byte store per x row (writing them value by value puts 16 rows of a 49,152-wide output in
// one cache set: 2x slower at 16 rows; a transposed output and one transposing copy at the end cost as much).
STAR_ELASTIC_AMX_TARGET void amx_block(const uint32_t* pack, int64_t count, const uint16_t* w, int64_t row_stride,
                                       int64_t n, float* out, int64_t out_stride, const uint16_t* ahead) {
  _tile_zero(0);
  _tile_zero(1);
  const int64_t w_bytes = row_stride * 2, b_bytes = count * 4;
  for (int64_t kb = 0; kb < n / 32; ++kb) {
    if (ahead != nullptr) {  // the next job's rows, one 64-byte line of each per step
      for (int64_t r = 0; r < kAmxRows; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * row_stride + kb * 32), _MM_HINT_T0);
    }
    _tile_loadd(4, pack + kb * 16 * count, b_bytes);
    _tile_loadd(2, w + kb * 32, w_bytes);
    _tile_loadd(3, w + 16 * row_stride + kb * 32, w_bytes);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 4);
  }
  alignas(64) float c[kAmxRows * kAmxX];
  _tile_stored(0, c, b_bytes);
  _tile_stored(1, c + 16 * count, b_bytes);
  asm volatile("" ::: "memory");
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(count)));
  for (int64_t half = 0; half < 2; ++half) {
    for (int64_t j = 0; j < count; ++j) {
      _mm512_storeu_ps(out + j * out_stride + half * 16, _mm512_i32gather_ps(column, c + half * 16 * count + j, 4));
    }
  }
}
#else
struct TileScope {
  explicit TileScope(bool) {}
  void set(int64_t) {}
};
void pack_x(const uint16_t*, int64_t, int64_t, int64_t, uint32_t*) {}
void amx_block(const uint32_t*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t, const uint16_t*) {}
#endif

// Every group's rows by its matrix: out (x rows, out_rows) float32. Jobs are (group, 32-row AMX block or 4-row
// dot-product block), ordered so that consecutive jobs of one thread read one weight block. T is uint16_t
// (bfloat16: AMX where it runs) or float (the float32 dot-product tiles only).
template <typename T>
void rows_by_groups(const T* xp, int64_t x_stride, std::vector<RowGroup>& groups, const T* wp,
                    int64_t matrix_stride, int64_t row_stride, int64_t out_rows, int64_t n, float* op) {
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  const bool amx = kBf16 && amx_on.load(std::memory_order_relaxed) && amx_supported() && n % 32 == 0;
  std::vector<uint32_t> packs;
  if constexpr (kBf16) {
   if (amx) {
    int64_t words = 0;
    for (const RowGroup& g : groups) words += g.count * (n / 2);
    packs.resize(words);
    int64_t at = 0;
    for (RowGroup& g : groups) {
      pack_x(xp + g.start * x_stride, x_stride, g.count, n, packs.data() + at);
      g.pack = reinterpret_cast<const uint16_t*>(packs.data() + at);
      at += g.count * (n / 2);
    }
   }
  }
  struct Job {
    int64_t group, first, rows;
  };
  std::vector<Job> jobs;
  const int64_t amx_rows = amx ? out_rows / kAmxRows * kAmxRows : 0;
  // Groups of one matrix are consecutive; a matrix's jobs go block by block, its groups within a block.
  for (size_t g0 = 0; g0 < groups.size();) {
    size_t g1 = g0;
    while (g1 < groups.size() && groups[g1].matrix == groups[g0].matrix) ++g1;
    for (int64_t first = 0; first < amx_rows; first += kAmxRows) {
      for (size_t g = g0; g < g1; ++g) jobs.push_back({static_cast<int64_t>(g), first, kAmxRows});
    }
    for (int64_t first = amx_rows; first < out_rows; first += kRowsPerTask) {
      for (size_t g = g0; g < g1; ++g) {
        jobs.push_back({static_cast<int64_t>(g), first, std::min(kRowsPerTask, out_rows - first)});
      }
    }
    g0 = g1;
  }
  const bool prefetch = prefetch_on.load(std::memory_order_relaxed);
  const int64_t job_bytes = (amx ? kAmxRows : kRowsPerTask) * n * static_cast<int64_t>(sizeof(T));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, job_bytes));
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), grain, [&](int64_t begin, int64_t end) {
    TileScope tiles(amx);
    for (int64_t i = begin; i < end; ++i) {
      const Job& job = jobs[i];
      const RowGroup& g = groups[job.group];
      const T* matrix = wp + g.matrix * matrix_stride;
      float* out = op + g.start * out_rows + job.first;
      if constexpr (kBf16) {
        if (job.rows == kAmxRows && amx) {
          const int64_t next = job.first + kAmxRows;
          const uint16_t* ahead = prefetch && next + kAmxRows <= amx_rows ? matrix + next * row_stride : nullptr;
          tiles.set(g.count);
          amx_block(reinterpret_cast<const uint32_t*>(g.pack), g.count, matrix + job.first * row_stride,
                    row_stride, n, out, out_rows, ahead);
          continue;
        }
      }
      {
        dot_block(xp + g.start * x_stride, x_stride, g.count, matrix + job.first * row_stride, row_stride, job.rows,
                  n, out, out_rows, 1, rows_ahead(matrix, job.first, job.rows, out_rows, row_stride));
      }
    }
  });
}

// Several rows: x (m, in) by w (out, in) -> (m, out) float32; T is uint16_t (bfloat16) or float.
template <typename T>
at::Tensor gemm_rows(const at::Tensor& x, const at::Tensor& w, at::ScalarType dtype, const char* op) {
  check_operands(x, w, 2, dtype, op);
  TORCH_CHECK(x.dim() == 2, op, ": x must be (rows, in), got ", x.sizes());
  const int64_t m = x.size(0), out_rows = w.size(0), n = w.size(1);
  at::Tensor out = at::empty({m, out_rows}, x.options().dtype(at::kFloat));
  if (m > 0 && out_rows > 0) {
    std::vector<RowGroup> groups;
    for (int64_t s = 0; s < m; s += kAmxX) groups.push_back({s, std::min(kAmxX, m - s), 0, nullptr});
    rows_by_groups(reinterpret_cast<const T*>(x.const_data_ptr()), x.stride(0), groups,
                   reinterpret_cast<const T*>(w.const_data_ptr()), 0, w.stride(0), out_rows, n,
                   out.data_ptr<float>());
  }
  return out;
}

// Rows grouped by expert, as F.grouped_mm takes them: x (T, in), w (E, out, in), offs (E,) int32 cumulative row
// counts (expert e takes rows offs[e-1] .. offs[e]) -> (T, out) float32; rows past offs[E-1] are zeros.
// Experts with no rows are not read.
template <typename T>
at::Tensor gemm_rows_grouped(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, at::ScalarType dtype,
                             const char* op) {
  check_operands(x, w, 3, dtype, op);
  TORCH_CHECK(x.dim() == 2, op, ": x must be (rows, in), got ", x.sizes());
  TORCH_CHECK(offs.dim() == 1 && offs.size(0) == w.size(0), op, ": offs must be (E,) = (", w.size(0), ",), got ",
              offs.sizes());
  TORCH_CHECK(offs.scalar_type() == at::kInt, op, ": offs must be int32, got ", offs.scalar_type());
  const int64_t t_rows = x.size(0), experts = w.size(0), out_rows = w.size(1), n = w.size(2);
  const at::Tensor offs_c = offs.contiguous();
  const int32_t* ends = offs_c.const_data_ptr<int32_t>();
  std::vector<RowGroup> groups;
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK(ends[e] >= start && ends[e] <= t_rows, op, ": offs must rise from 0 to at most ", t_rows,
                " rows, got ", ends[e], " after ", start, " at expert ", e);
    for (int64_t s = start; s < ends[e]; s += kAmxX) {
      groups.push_back({s, std::min<int64_t>(kAmxX, ends[e] - s), e, nullptr});
    }
    start = ends[e];
  }
  at::Tensor out = at::empty({t_rows, out_rows}, x.options().dtype(at::kFloat));
  if (start < t_rows) out.narrow(0, start, t_rows - start).zero_();
  if (!groups.empty() && out_rows > 0) {
    rows_by_groups(reinterpret_cast<const T*>(x.const_data_ptr()), x.stride(0), groups,
                   reinterpret_cast<const T*>(w.const_data_ptr()), w.stride(0), w.stride(1), out_rows, n,
                   out.data_ptr<float>());
  }
  return out;
}

at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& w) {
  return gemm_rows<uint16_t>(x, w, at::kBFloat16, "gemm_bf16");
}

at::Tensor gemm_bf16_grouped(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs) {
  return gemm_rows_grouped<uint16_t>(x, w, offs, at::kBFloat16, "gemm_bf16_grouped");
}

at::Tensor gemm_f32(const at::Tensor& x, const at::Tensor& w) { return gemm_rows<float>(x, w, at::kFloat, "gemm_f32"); }

at::Tensor gemm_f32_grouped(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs) {
  return gemm_rows_grouped<float>(x, w, offs, at::kFloat, "gemm_f32_grouped");
}

// ---------------------------------------------------------------------------------------------- greedy pick
// The argmax of every row of logits (rows, vocab), float32 or bfloat16, as torch.argmax picks it: the first
// largest value, a NaN counting as the largest (the first NaN). PyTorch's CPU argmax is a scalar loop (~0.1 ms
// per 49k float32 row, ~0.2 ms in bfloat16); this one keeps 16 running maxima and their first indices.
#ifdef STAR_ELASTIC_X86
template <bool BF16>
STAR_ELASTIC_BF16_TARGET __m512 load_logits(const void* row, int64_t k, __mmask16 mask) {
  if constexpr (BF16) {
    const __m256i half = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(row) + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  } else {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(row) + k);
  }
}

template <bool BF16>
STAR_ELASTIC_BF16_TARGET int64_t argmax_row(const void* row, int64_t n) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = lowest;
  __m512i best_at = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512i at = best_at;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 mask = n - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - k)) - 1);
    const __m512 v = _mm512_mask_mov_ps(lowest, mask, load_logits<BF16>(row, k, mask));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: each lane keeps its first
    best = _mm512_mask_mov_ps(best, greater, v);
    best_at = _mm512_mask_mov_epi32(best_at, greater, at);
    at = _mm512_add_epi32(at, step);
  }
  if (nan) {  // rare: the first NaN, as torch.argmax
    for (int64_t k = 0; k < n; ++k) {
      const float v = BF16 ? static_cast<float>(c10::BFloat16(static_cast<const uint16_t*>(row)[k], c10::BFloat16::from_bits()))
                           : static_cast<const float*>(row)[k];
      if (v != v) return k;
    }
  }
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 ties = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);  // the lowest index of them
  return _mm512_mask_reduce_min_epi32(ties, best_at);
}
#endif

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(supported(), "argmax_rows: this CPU has no AVX512_BF16");
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2, "argmax_rows: logits must be (rows, vocab) on the CPU, got ",
              logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "argmax_rows: logits must be float32 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK(logits.stride(1) == 1, "argmax_rows: the vocabulary dimension must be contiguous");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(n > 0 && n < (int64_t{1} << 31), "argmax_rows: vocab must be 1 .. 2^31 - 1, got ", n);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
#ifdef STAR_ELASTIC_X86
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const auto* base = static_cast<const char*>(logits.const_data_ptr());
  const int64_t row_bytes = stride * logits.element_size();
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 16) / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      op[r] = bf16 ? argmax_row<true>(base + r * row_bytes, n) : argmax_row<false>(base + r * row_bytes, n);
    }
  });
#endif
  return out;
}

bool dot_bf16_amx(bool on) { return amx_on.exchange(on); }

bool dot_bf16_amx_supported() { return amx_supported(); }

bool dot_bf16_supported() { return supported(); }

bool dot_bf16_prefetch(bool on) { return prefetch_on.exchange(on); }

}  // namespace

TORCH_LIBRARY(star_elastic, m) {
  m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("gemv_bf16_gather(Tensor x, Tensor w, Tensor idx) -> Tensor");
  m.def("gemm_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("gemm_bf16_grouped(Tensor x, Tensor w, Tensor offs) -> Tensor");
  m.def("gemm_f32(Tensor x, Tensor w) -> Tensor");
  m.def("gemm_f32_grouped(Tensor x, Tensor w, Tensor offs) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("dot_bf16_supported() -> bool", &dot_bf16_supported);
  m.def("dot_bf16_prefetch(bool on) -> bool", &dot_bf16_prefetch);
  m.def("dot_bf16_amx(bool on) -> bool", &dot_bf16_amx);
  m.def("dot_bf16_amx_supported() -> bool", &dot_bf16_amx_supported);
}

TORCH_LIBRARY_IMPL(star_elastic, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_bf16_gather", &gemv_bf16_gather);
  m.impl("gemm_bf16", &gemm_bf16);
  m.impl("gemm_bf16_grouped", &gemm_bf16_grouped);
  m.impl("gemm_f32", &gemm_f32);
  m.impl("gemm_f32_grouped", &gemm_f32_grouped);
  m.impl("argmax_rows", &argmax_rows);
}
