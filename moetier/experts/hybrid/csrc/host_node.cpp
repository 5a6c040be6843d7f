// The host-function node of the hybrid backend's `nodes` mode (moetier/experts/hybrid/nodes.py): the
// function a CUDA graph calls (cuLaunchHostFunc captured as a host node), or the CPU path calls through
// ctypes, once per MoE layer and step. Built into the same library as host_experts.cpp (host_ext.py).
//
// It reads everything from one job struct (allocated by Python, kept alive by the backend for the
// graph's life: the graph stores the pointer) whose pointers name pinned host buffers the graph's own
// copies fill before the node runs (the plan, the hidden state) and drain after it (the outputs):
//     plan  int64 [1 + 2 * max_pairs]: n, tokens [max_pairs], experts [max_pairs] (the first n valid)
//     x     fp32 [T, H]: the step's hidden states (rows >= the step's T stale, never read: tokens < T)
//     y     fp32 [max_pairs, H]: the n host pairs' unweighted outputs, compacted (row i: host pair i)
//     h     fp32 [max_pairs, I]: scratch (the SwiGLU)
// and runs the compiled kernel synchronously, on the calling thread (the driver's callback thread under
// a graph) as the OpenMP master. NOTE: a host node must not call any CUDA API, and it cannot report an
// error to the stream: a bad job sets `status` (and `err`), which the backend checks between steps.
#include <cstdint>
#include <cstdio>
#include <time.h>

extern "C" int moetier_host_experts(const void* rows, int64_t num_rows, int64_t row_bytes, int kind, int64_t H,
                                    int64_t I, int64_t s13, int64_t s2, int round_h, const float* x, int64_t T,
                                    const int64_t* tokens, const int64_t* experts, int64_t P, float* h, float* y,
                                    int threads, int64_t block, float limit, char* err, int errlen);

// Every field 8 bytes (no padding to agree on with ctypes): hybrid_nodes.NodeJob mirrors it.
struct MoetierNodeJob {
  const void* rows; int64_t num_rows, row_bytes, kind, H, I, s13, s2, round_h;
  double limit;  // the SwiGLU clamp; not above 0: none
  const float* x; int64_t T;
  const int64_t* plan; int64_t max_pairs;
  float* h; float* y;
  int64_t threads, block;
  int64_t status, calls, pairs;  // status: 0, or nonzero after a failed call (sticky until reset)
  double seconds;  // wall time of the calls, summed
  char err[256];
};

static double node_now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

extern "C" {

void moetier_host_node(void* p) {
  MoetierNodeJob* j = (MoetierNodeJob*)p;
  const int64_t n = j->plan[0];
  if (n < 0 || n > j->max_pairs) {
    j->status = 2;
    std::snprintf(j->err, sizeof j->err, "host node: %lld host pairs, buffers hold %lld", (long long)n,
                  (long long)j->max_pairs);
    return;
  }
  const double t0 = node_now();
  const int rc = moetier_host_experts(j->rows, j->num_rows, j->row_bytes, (int)j->kind, j->H, j->I, j->s13, j->s2,
                                      (int)j->round_h, j->x, j->T, j->plan + 1, j->plan + 1 + j->max_pairs, n, j->h,
                                      j->y, (int)j->threads, j->block, (float)j->limit, j->err, (int)sizeof j->err);
  j->seconds += node_now() - t0;
  if (rc != 0) j->status = 1;
  j->calls += 1;
  j->pairs += n;
}

int64_t moetier_host_node_job_size(void) { return (int64_t)sizeof(MoetierNodeJob); }

}  // extern "C"
