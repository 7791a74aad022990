// A ps' preemption notice, passed between the ps' own process and the
// coordinator. TF's server gives a task's process no channel to its clients,
// and an op a client runs on the task sees that process' memory: so the
// task's SIGTERM handler (Python, `python -m keras_ps.server`, through
// ctypes) records the notice here, and the coordinator, which runs
// KerasPsPreemptionNotice on each ps about once a second while it watches,
// reads it. Once its backup is written it runs KerasPsReleasePreempted on
// that ps, and the ps stops.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace keras_ps {
namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// When a coordinator last asked (steady clock, ms; 0: none watches).
std::atomic<int64_t> watched_at_ms{0};
// When the ps will stop, noticed or not (steady clock, ms; 0: no notice).
std::atomic<int64_t> stops_at_ms{0};
std::atomic<bool> released{false};

}  // namespace

REGISTER_OP("KerasPsPreemptionNotice")
    .Input("watch: bool")
    .Output("seconds_left: float")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);

// watch: true while the coordinator watches (each question renews it),
// false when it stops watching. seconds_left: -1 without a notice, else the
// seconds the ps serves on at most (0 once past).
class PreemptionNoticeOp : public OpKernel {
 public:
  explicit PreemptionNoticeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    const int64_t now = NowMs();
    watched_at_ms.store(ctx->input(0).scalar<bool>()() ? now : 0);
    const int64_t stops_at = stops_at_ms.load();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {}, &out));
    out->scalar<float>()() =
        stops_at == 0 ? -1.0f
                      : static_cast<float>(std::max<int64_t>(stops_at - now, 0)) /
                            1000.0f;
  }
};
REGISTER_KERNEL_BUILDER(
    Name("KerasPsPreemptionNotice").Device(tensorflow::DEVICE_CPU),
    PreemptionNoticeOp);

REGISTER_OP("KerasPsReleasePreempted")
    .Output("had_notice: bool")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);

// The coordinator's backup is written: the ps may stop now.
class ReleasePreemptedOp : public OpKernel {
 public:
  explicit ReleasePreemptedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    const bool had_notice = stops_at_ms.load() != 0;
    if (had_notice) released.store(true);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {}, &out));
    out->scalar<bool>()() = had_notice;
  }
};
REGISTER_KERNEL_BUILDER(
    Name("KerasPsReleasePreempted").Device(tensorflow::DEVICE_CPU),
    ReleasePreemptedOp);

}  // namespace keras_ps

// The ps process' side, called through ctypes.
extern "C" {

// Seconds since a coordinator last asked for notices, or -1 if none watches.
double KerasPsNoticeWatchedAgo() {
  const int64_t at = keras_ps::watched_at_ms.load();
  return at == 0 ? -1.0 : (keras_ps::NowMs() - at) / 1000.0;
}

// Records a notice: the ps stops within `grace_s` seconds.
void KerasPsNoticeGiven(double grace_s) {
  keras_ps::stops_at_ms.store(keras_ps::NowMs() +
                              static_cast<int64_t>(grace_s * 1000.0));
}

// 1 once the coordinator released the noticed ps, else 0.
int KerasPsNoticeReleased() { return keras_ps::released.load() ? 1 : 0; }

}  // extern "C"
