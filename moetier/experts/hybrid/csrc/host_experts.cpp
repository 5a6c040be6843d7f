// The compiled host expert kernel (moetier/experts/hybrid/host_ext.py builds and loads it; cpu_experts.py's "compiled"
// HostKernel calls it). Plain C ABI, no torch or Python headers: it compiles in a few seconds, called by ctypes.
//
// For P (token, expert) pairs it computes each pair's SwiGLU expert output, unweighted, in fp32:
//     h[p, j] = silu(gate_j . x[tok[p]]) * (up_j . x[tok[p]])     j < I    (gate_up rows j and I + j)
//     y[p, r] = down_r . h[p]                                      r < H
// (under a SwiGLU limit L > 0 the gate dot is first clamped to <= L and the up dot to [-L, L], in fp32)
// straight from the host store's rows (shape.RowLayout): bf16 / fp32 rows [gate_up 2I x H | down H x I],
// FP8 rows (e4m3 bytes, then float32 128 x 128 block scales at byte offsets s13 / s2 of the row), or 4-bit
// rows (NVFP4, INT4: codes two per byte, then one group scale per row and group at s13 / s2; NVFP4's three
// float32 tensor scales after them). host_decode.h turns each kind's bytes into fp32 weights.
//
// Memory-bandwidth design (decode: 1..8 tokens per expert): the pairs are grouped by expert; each
// expert's gate_up row pairs are cut into blocks of about 64 KB of weights, every block of every
// expert of the call is one work item, and the threads of ONE OpenMP region take items in turn
// (dynamic schedule); after the loop's barrier the same for the down rows. So every weight byte is
// read once per call, by one core, streaming 64 KB at a time; all tokens of an expert are applied to
// a chunk of the weight row while it is in registers (M accumulators per row). Dynamic, not static:
// a thread that loses its core (the hybrid backend's main thread, the copy engine's driver thread, a
// busy machine) delays only its current block, not a whole 1/n of the call.
//
// Invariant (HostKernel's contract): each output element is one dot product computed by ONE thread in
// a fixed order: VW-lane accumulators over k = 0, VW, 2VW, ... (explicit FMA intrinsics, no compiler
// reassociation: built with -ffp-contract=off), the lanes summed in lane order, then the K % VW tail
// in k order. Nothing depends on the thread count, the call's other pairs or the tiling: 1 thread and 16 agree.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
#include <omp.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#define MT 8  // tokens per tile: 2 rows x 8 tokens = 16 zmm accumulators of 32
#elif defined(__AVX__)
#define VW 8
#define MT 4  // 16 ymm registers: 2 x 4 accumulators + weights + x
#else
#define VW 4
#define MT 4
#endif

#ifndef PF_FP8
#define PF_FP8 4096  // bytes; -DPF_FP8=0 turns the FP8 prefetch off
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));
typedef uint16_t vu16 __attribute__((vector_size(VW * 2)));
typedef uint8_t vu8 __attribute__((vector_size(VW)));

static inline vf fmadd(vf a, vf b, vf c) {  // a * b + c, one rounding where the hardware has FMA
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;  // -ffp-contract=off: two roundings, but always the same two
#endif
}

template <class T> static inline T loadu(const void* p) { T v; std::memcpy(&v, p, sizeof(T)); return v; }

#include "host_decode.h"

// out[r][m] = row r . xs[m] over K, for R rows (gate and up, or two down rows) and M tokens at once.
// w[r]: the row's first weight; s[r]: its scales along K (quantized rows: scale_at), else null; t[r]: its
// tensor scale (NVFP4); z[r]: its zero codes along K (asymmetric INT4: zero_at), else null.
template <int KIND, int R, int M>
static void dots(const uint8_t* const* w, const uint8_t* const* s, const float* t, const uint8_t* const* z,
                 const float* const* xs, int64_t K, float (*out)[MT]) {
  vf acc[R][M];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) acc[r][m] = (vf){};
  const int64_t kv = K / VW * VW;
  constexpr int64_t HB = half_bytes(KIND);
  for (int64_t k = 0; k < kv; k += VW) {
    // FP8: a software prefetch PF_FP8 bytes ahead in each row's stream, once per cache line. Decoding
    // costs more instructions per byte than bf16's shift, which left fewer loads in flight: from DRAM,
    // one core streamed 2.4 GB/s of FP8 rows without it and 5.2 with it (bf16: no gain, not used; 4-bit
    // rows decode at more instructions per byte still: prefetched as FP8's).
    if (KIND >= FP8 && PF_FP8 > 0 && (k * HB / 2) % 64 == 0)
      for (int r = 0; r < R; r++) __builtin_prefetch(w[r] + k * HB / 2 + PF_FP8, 0, 0);
    vf wv[R];
    for (int r = 0; r < R; r++) wv[r] = load_w<KIND>(w[r], k, scale_at<KIND>(s[r], k, t[r]), zero_at<KIND>(z[r], k));
    for (int m = 0; m < M; m++) {
      vf xv = loadu<vf>(xs[m] + k);
      for (int r = 0; r < R; r++) acc[r][m] = fmadd(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) {
      float sum = 0.0f;
      for (int l = 0; l < VW; l++) sum += acc[r][m][l];  // lane order
      for (int64_t k = kv; k < K; k++)
        sum = std::fma(load_w1<KIND>(w[r], k, scale_at<KIND>(s[r], k, t[r]), zero_at<KIND>(z[r], k)), xs[m][k], sum);
      out[r][m] = sum;
    }
}

template <int KIND, int R>
static void dots_m(int m, const uint8_t* const* w, const uint8_t* const* s, const float* t, const uint8_t* const* z,
                   const float* const* xs, int64_t K, float (*out)[MT]) {
  switch (m) {  // compile-time M: the accumulators stay in registers
    case 1: return dots<KIND, R, 1>(w, s, t, z, xs, K, out);
    case 2: return dots<KIND, R, 2>(w, s, t, z, xs, K, out);
    case 3: return dots<KIND, R, 3>(w, s, t, z, xs, K, out);
#if MT > 4
    case 4: return dots<KIND, R, 4>(w, s, t, z, xs, K, out);
    case 5: return dots<KIND, R, 5>(w, s, t, z, xs, K, out);
    case 6: return dots<KIND, R, 6>(w, s, t, z, xs, K, out);
    case 7: return dots<KIND, R, 7>(w, s, t, z, xs, K, out);
#endif
    default: return dots<KIND, R, MT>(w, s, t, z, xs, K, out);
  }
}

struct Call {
  const uint8_t* rows; int64_t row_bytes, H, I, s13, s2, hb;  // hb: half-bytes per weight (half_bytes)
  bool round_h;  // h rounded to bf16 (a bf16 model: the GPU kernel's down dot reads h as bf16)
  float limit;  // the SwiGLU clamp (activation.silu_mul's order); not above 0 (or NaN): none
  const float* x; const int64_t* tok;
  float *h, *y;
  std::vector<int64_t> expert, begin, order;  // per group: its expert and first index into `order` (pairs by expert)
};

// Rows per work item: about `block` bytes of weights (rows of `row_bytes`), an even count (down pairs rows).
static inline int64_t block_rows(int64_t block, int64_t row_bytes) { return std::max<int64_t>(2, (block / row_bytes) & ~1); }

// Bytes per group scale of a 4-bit kind's rows, and a K's groups
constexpr int64_t scale_bytes(int k) { return k <= NV4R ? 1 : 2; }
template <int KIND> static inline int64_t groups(int64_t K) { return (K + group_of(KIND) - 1) / group_of(KIND); }

// gate_up row pairs [lo, hi) of group g (gate rows j and up rows I + j of its expert)
template <int KIND> static void gate_up(const Call& c, int64_t g, int64_t lo, int64_t hi) {
  const int64_t H = c.H, I = c.I, nH = (H + 127) / 128, nI = (I + 127) / 128;
  for (int64_t j = lo; j < hi; j++) {
    const uint8_t* row = c.rows + c.expert[g] * c.row_bytes;
    const uint8_t* w[2] = {row + j * H * c.hb / 2, row + (I + j) * H * c.hb / 2};
    const uint8_t* s[2] = {nullptr, nullptr};
    const uint8_t* z[2] = {nullptr, nullptr};
    float t[2] = {1.0f, 1.0f};
    if (asym(KIND)) {  // zero codes [2I, groups(H)] at zeros13: gate's rows, then up's
      const int64_t z13 = zeros13<KIND>(c.s2, H, I);
      z[0] = row + z13 + j * groups<KIND>(H); z[1] = row + z13 + (I + j) * groups<KIND>(H);
    }
    if (KIND == FP8 || KIND == FP8R) {  // s13 [2, nI, nH]: gate's grid, then up's
      const float* s13 = (const float*)(row + c.s13);
      s[0] = (const uint8_t*)(s13 + (j >> 7) * nH); s[1] = (const uint8_t*)(s13 + (nI + (j >> 7)) * nH);
    } else if (is4(KIND)) {  // s13 [2I, groups(H)]: gate's rows, then up's; NVFP4: tensor scales gate, up
      const int64_t gb = groups<KIND>(H) * scale_bytes(KIND);
      s[0] = row + c.s13 + j * gb; s[1] = row + c.s13 + (I + j) * gb;
      if (KIND <= NV4R) {
        const float* gl = (const float*)(row + nvfp4_globals(c.s2, H, I));
        t[0] = gl[0], t[1] = gl[1];
      }
    }
    for (int64_t b = c.begin[g]; b < c.begin[g + 1]; b += MT) {
      const int m = (int)std::min<int64_t>(MT, c.begin[g + 1] - b);
      const float* xs[MT]; float out[2][MT];
      for (int i = 0; i < m; i++) xs[i] = c.x + c.tok[c.order[b + i]] * H;
      dots_m<KIND, 2>(m, w, s, t, z, xs, H, out);
      for (int i = 0; i < m; i++) {
        float gv = out[0][i], uv = out[1][i];  // std::min / max keep a NaN first argument, as torch's clamp
        if (c.limit > 0) gv = std::min(gv, c.limit), uv = std::min(std::max(uv, -c.limit), c.limit);
        const float hv = gv / (1.0f + std::exp(-gv)) * uv;
        c.h[c.order[b + i] * I + j] = c.round_h ? round_bf16_1(hv) : hv;
      }
    }
  }
}

// down rows [lo, hi) of group g
template <int KIND> static void down(const Call& c, int64_t g, int64_t lo, int64_t hi) {
  const int64_t H = c.H, I = c.I, nI = (I + 127) / 128;
  for (int64_t r = lo; r < hi;) {
    const int R = r + 1 < hi ? 2 : 1;  // two rows at once (their results do not depend on it)
    const uint8_t* row = c.rows + c.expert[g] * c.row_bytes;
    const uint8_t* w[2];
    const uint8_t* s[2] = {nullptr, nullptr};
    const uint8_t* z[2] = {nullptr, nullptr};
    float t[2] = {1.0f, 1.0f};
    for (int q = 0; q < R; q++) {
      w[q] = row + (2 * I * H + (r + q) * I) * c.hb / 2;
      if (KIND == FP8 || KIND == FP8R) s[q] = (const uint8_t*)((const float*)(row + c.s2) + ((r + q) >> 7) * nI);
      if (is4(KIND)) s[q] = row + c.s2 + (r + q) * groups<KIND>(I) * scale_bytes(KIND);  // s2 [H, groups(I)]
      if (KIND == NV4 || KIND == NV4R) t[q] = ((const float*)(row + nvfp4_globals(c.s2, H, I)))[2];
      if (asym(KIND))  // down's zero codes [H, groups(I)], after gate_up's
        z[q] = row + zeros13<KIND>(c.s2, H, I) + 2 * I * groups<KIND>(H) + (r + q) * groups<KIND>(I);
    }
    for (int64_t b = c.begin[g]; b < c.begin[g + 1]; b += MT) {
      const int m = (int)std::min<int64_t>(MT, c.begin[g + 1] - b);
      const float* hs[MT]; float out[2][MT];
      for (int i = 0; i < m; i++) hs[i] = c.h + c.order[b + i] * I;
      if (R == 2) dots_m<KIND, 2>(m, w, s, t, z, hs, I, out); else dots_m<KIND, 1>(m, w, s, t, z, hs, I, out);
      for (int q = 0; q < R; q++)
        for (int i = 0; i < m; i++) c.y[c.order[b + i] * H + r + q] = out[q][i];
    }
    r += R;
  }
}

template <int KIND> static void run(const Call& c, int threads, int64_t block) {
  const int64_t G = (int64_t)c.expert.size();
#pragma omp parallel num_threads(threads)
  {
#if defined(__SSE__)
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr & ~0x8040u);  // clear FTZ (bit 15) and DAZ (bit 6): fp8 decode needs fp32 denormals
#endif
    const int64_t b1 = block_rows(block, c.H * c.hb), n1 = (c.I + b1 - 1) / b1;  // blocks per expert
    const int64_t b2 = block_rows(block, c.I * c.hb / 2), n2 = (c.H + b2 - 1) / b2;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < G * n1; it++) {
      const int64_t g = it / n1, lo = it % n1 * b1;
      gate_up<KIND>(c, g, lo, std::min(c.I, lo + b1));
    }  // the loop's implicit barrier: every h is written before any down row reads it
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < G * n2; it++) {
      const int64_t g = it / n2, lo = it % n2 * b2;
      down<KIND>(c, g, lo, std::min(c.H, lo + b2));
    }
#if defined(__SSE__)
    _mm_setcsr(csr);
#endif
  }
}

// Validates the arguments and groups the pairs by expert, experts ascending, pairs in call order within
// a group (a stable sort). Returns 0, or 1 with a one-line reason in err.
static int prepare(Call& c, const void* rows, int64_t num_rows, int64_t row_bytes, int kind, int64_t H, int64_t I,
                   int64_t s13, int64_t s2, int round_h, const float* x, int64_t T, const int64_t* tokens,
                   const int64_t* experts, int64_t P, float* h, float* y, int threads, float limit, char* err, int errlen) {
  if (kind < 0 || kind > LAST_KIND || H < 1 || I < 1 || threads < 1 || (is4(kind) && (H % 2 || I % 2))) {
    std::snprintf(err, errlen, "bad arguments: kind %d, hidden %lld, inter %lld, threads %d", kind, (long long)H,
                  (long long)I, threads);
    return 1;
  }
  for (int64_t p = 0; p < P; p++) {
    if (experts[p] < 0 || experts[p] >= num_rows || tokens[p] < 0 || tokens[p] >= T) {
      std::snprintf(err, errlen, "pair %lld: expert %lld of 0..%lld, token %lld of 0..%lld", (long long)p,
                    (long long)experts[p], (long long)num_rows - 1, (long long)tokens[p], (long long)T - 1);
      return 1;
    }
  }
  c = Call{(const uint8_t*)rows, row_bytes, H, I, s13, s2, half_bytes(kind), round_h != 0,
           limit, x, tokens, h, y, {}, {}, {}};
  c.order.resize(P);
  for (int64_t p = 0; p < P; p++) c.order[p] = p;
  std::stable_sort(c.order.begin(), c.order.end(), [&](int64_t a, int64_t b) { return experts[a] < experts[b]; });
  for (int64_t i = 0; i < P; i++) {
    if (i == 0 || experts[c.order[i]] != experts[c.order[i - 1]]) {
      c.expert.push_back(experts[c.order[i]]);
      c.begin.push_back(i);
    }
  }
  c.begin.push_back(P);
  return 0;
}

static void dispatch(const Call& c, int kind, int threads, int64_t block) {
  if (c.expert.empty()) return;
  if (block <= 0) block = 65536;
  switch (kind) {
    case BF16: return run<BF16>(c, threads, block);
    case F32: return run<F32>(c, threads, block);
    case FP8: return run<FP8>(c, threads, block);
    case FP8R: return run<FP8R>(c, threads, block);
    case NV4: return run<NV4>(c, threads, block);
    case NV4R: return run<NV4R>(c, threads, block);
    case I4: return run<I4>(c, threads, block);
    case I4R: return run<I4R>(c, threads, block);
    case I4S: return run<I4S>(c, threads, block);
    case I4SR: return run<I4SR>(c, threads, block);
    case I4Z: return run<I4Z>(c, threads, block);
    case I4ZR: return run<I4ZR>(c, threads, block);
    case I4ZS: return run<I4ZS>(c, threads, block);
    default: return run<I4ZSR>(c, threads, block);
  }
}

static double now_s() {  // CLOCK_MONOTONIC: the clock of Python's time.perf_counter on Linux
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// One native thread that runs started calls, one at a time (the hybrid backend's host path): a call
// starts without the caller's Python thread, or any other, having to take the GIL again, so the caller
// goes on launching device work while the call runs. The thread is the OpenMP master of the calls it
// runs (its team persists between calls). Never destroyed: it waits on its condition variable at exit.
struct Async {
  std::mutex m;
  std::condition_variable cv;
  bool pending = false, busy = false;  // pending: a job is handed over and not yet waited for
  Call call;
  int kind = 0, threads = 1;
  int64_t block = 0;
  double t0 = 0, t1 = 0;  // the last job's start and end (now_s)
  void loop() {
    std::unique_lock<std::mutex> lk(m);
    for (;;) {
      cv.wait(lk, [&] { return busy; });
      lk.unlock();
      double a = now_s();
      dispatch(call, kind, threads, block);
      double b = now_s();
      lk.lock();
      t0 = a, t1 = b, busy = false;
      cv.notify_all();
    }
  }
};
static Async* async_state() {
  static Async* a = [] {
    Async* s = new Async();
    std::thread(&Async::loop, s).detach();
    return s;
  }();
  return a;
}

extern "C" {

// Returns 0, or 1 with a one-line reason in err. kind: 0 bf16, 1 fp32, 2 fp8 rows (3: fp8 with weights
// rounded to bf16), 4 NVFP4, 6 INT4 in groups of 128, 8 INT4 in groups of 32, 10 and 12 the same with zero
// codes (5, 7, 9, 11, 13: rounded). round_h: the SwiGLU rounded to bf16 before the down projection (a bf16 model).
// x [T, H] fp32, tokens / experts [P] int64, h [P, I] fp32 scratch, y [P, H] fp32 out. Offsets in bytes.
// block: weight bytes per work item (0: 64 KB; tests cut finer); limit: the SwiGLU clamp (<= 0 or NaN: none).
int moetier_host_experts(const void* rows, int64_t num_rows, int64_t row_bytes, int kind, int64_t H, int64_t I,
                         int64_t s13, int64_t s2, int round_h, const float* x, int64_t T, const int64_t* tokens,
                         const int64_t* experts, int64_t P, float* h, float* y, int threads, int64_t block,
                         float limit, char* err, int errlen) {
  Call c;
  if (prepare(c, rows, num_rows, row_bytes, kind, H, I, s13, s2, round_h, x, T, tokens, experts, P, h, y, threads,
              limit, err, errlen))
    return 1;
  dispatch(c, kind, threads, block);
  return 0;
}

// The same call, run by the native thread (Async): returns once the call is handed over. Every pointer
// must stay valid until moetier_host_experts_wait returns. One call at a time: starting a second before
// waiting for the first is refused.
int moetier_host_experts_start(const void* rows, int64_t num_rows, int64_t row_bytes, int kind, int64_t H, int64_t I,
                               int64_t s13, int64_t s2, int round_h, const float* x, int64_t T, const int64_t* tokens,
                               const int64_t* experts, int64_t P, float* h, float* y, int threads, int64_t block,
                               float limit, char* err, int errlen) {
  Async* a = async_state();
  std::unique_lock<std::mutex> lk(a->m);
  if (a->pending) {
    std::snprintf(err, errlen, "a started call has not been waited for");
    return 1;
  }
  if (prepare(a->call, rows, num_rows, row_bytes, kind, H, I, s13, s2, round_h, x, T, tokens, experts, P, h, y,
              threads, limit, err, errlen))
    return 1;
  a->kind = kind, a->threads = threads, a->block = block;
  a->pending = a->busy = true;
  lk.unlock();  // notify after unlocking: the woken thread does not block at once on the caller's lock
  a->cv.notify_all();
  return 0;
}

// Blocks until the started call is done (0), or returns 1 when none was started. times, when not null:
// [2] doubles, the call's start and end on CLOCK_MONOTONIC (seconds; Python's time.perf_counter clock).
int moetier_host_experts_wait(double* times) {
  Async* a = async_state();
  std::unique_lock<std::mutex> lk(a->m);
  if (!a->pending) return 1;
  a->cv.wait(lk, [&] { return !a->busy; });
  a->pending = false;
  if (times) times[0] = a->t0, times[1] = a->t1;
  return 0;
}

int moetier_host_experts_simd_width(void) { return VW; }

}  // extern "C"
