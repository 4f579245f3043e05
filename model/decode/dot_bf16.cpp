// One-row bfloat16 projections on the CPU's bfloat16 dot-product instruction (AVX512_BF16 `vdpbf16ps`).
//
// Registered as operators of the `star_elastic` library so that a compiled decode step calls them from its
// C++ wrapper through the dispatcher, with no interpreter between them (model/decode/dot_bf16.py builds this
// file and says when it is used). Each output is a dot product of bfloat16 values accumulated in float32:
// the products of two bfloat16 values are exact in float32, so this differs from the generated loop's
// float32 multiply-and-add only in the order of the additions (and in flushing denormal inputs to zero).
//
//   gemv_bf16(x (in,), w (out, in)) -> (out,) float32
//   gemv_bf16_gather(x (k, in), w (E, out, in), idx (k,) int64) -> (k, out) float32, row j by w[idx[j]]
//
// Weights need a contiguous last dimension (any row stride); x's rows too (row stride 0 broadcasts one row).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
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
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

#ifdef STAR_ELASTIC_X86
#define STAR_ELASTIC_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

// Dot products of ROWS weight rows (row_stride apart) with x over n bfloat16 values; the accumulators are
// separate variables (an array indexed at run time would live in memory).
template <int ROWS>
STAR_ELASTIC_BF16_TARGET inline void dot_rows_fixed(const uint16_t* x, const uint16_t* w, int64_t row_stride,
                                                    int64_t n, float* out, const uint16_t* ahead) {
  if (ahead != nullptr) {  // ROWS rows from `ahead` on, one prefetch per 64-byte line
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      const char* row = reinterpret_cast<const char*>(ahead + r * row_stride);
      for (int64_t b = 0; b < n * 2; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
  }
  __m512 acc[ROWS];
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w + r * row_stride + k), xv);
    }
  }
  if (k < n) {  // the tail: masked loads read zeros past the end
    const __mmask32 mask = (__mmask32)((1ULL << (n - k)) - 1);
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + k);
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * row_stride + k), xv);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

STAR_ELASTIC_BF16_TARGET void dot_rows(const uint16_t* x, const uint16_t* w, int64_t row_stride, int64_t rows,
                                       int64_t n, float* out, const uint16_t* ahead) {
  switch (rows) {
    case 4: return dot_rows_fixed<4>(x, w, row_stride, n, out, ahead);
    case 3: return dot_rows_fixed<3>(x, w, row_stride, n, out, ahead);
    case 2: return dot_rows_fixed<2>(x, w, row_stride, n, out, ahead);
    default: return dot_rows_fixed<1>(x, w, row_stride, n, out, ahead);
  }
}
#else
void dot_rows(const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, float*, const uint16_t*) {
  TORCH_CHECK(false, "gemv_bf16: this CPU has no bfloat16 dot-product instruction (AVX512_BF16)");
}
#endif

void check_operands(const at::Tensor& x, const at::Tensor& w, int64_t dims) {
  TORCH_CHECK(supported(), "gemv_bf16: this CPU has no bfloat16 dot-product instruction (AVX512_BF16)");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv_bf16: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "gemv_bf16: x and w must be bfloat16, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(w.dim() == dims, "gemv_bf16: w must have ", dims, " dimensions, got ", w.sizes());
  TORCH_CHECK(w.stride(-1) == 1 && x.stride(-1) == 1, "gemv_bf16: the last dimension of x and w must be contiguous");
  TORCH_CHECK(x.size(-1) == w.size(-1), "gemv_bf16: x has ", x.size(-1), " inputs, w ", w.size(-1));
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
const uint16_t* rows_ahead(const uint16_t* w, int64_t first, int64_t rows, int64_t out_rows, int64_t row_stride) {
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
      dot_rows(job.x, job.w, row_stride, job.rows, n, job.out, job.ahead);
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

bool dot_bf16_supported() { return supported(); }

bool dot_bf16_prefetch(bool on) { return prefetch_on.exchange(on); }

}  // namespace

TORCH_LIBRARY(star_elastic, m) {
  m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("gemv_bf16_gather(Tensor x, Tensor w, Tensor idx) -> Tensor");
  m.def("dot_bf16_supported() -> bool", &dot_bf16_supported);
  m.def("dot_bf16_prefetch(bool on) -> bool", &dot_bf16_prefetch);
}

TORCH_LIBRARY_IMPL(star_elastic, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_bf16_gather", &gemv_bf16_gather);
}
