// keras_ps' C++ kernels, built once per machine by keras_ps/_native/__init__.py.
//
// KerasPsLazyAdamRows: LazyAdam's update of the rows a gradient names, in one
// pass over each row (see keras_ps.tables._rowwise.lazy_adam for the formula).
// The same update in TF's ops takes three gathers, sixteen elementwise ops and
// four scatters, each a pass over all the rows with a buffer of its own.
//
// KerasPsAdagradRows: Keras' Adagrad on the rows a gradient names, in one pass
// over each row (see keras_ps.tables._rowwise.adagrad). In TF's ops it is a
// scatter-add into the accumulator, a gather of its new rows, five
// elementwise ops and a scatter-sub into the table; TF's scatters update one
// row at a time through an Eigen expression each.
//
// KerasPsSumRows: the rows of a gradient added up by the row each came from
// (a lookup's ids repeat within a batch; their rows' gradients are summed
// into one row per distinct id on the worker). TF's UnsortedSegmentSum does
// the same through one Eigen expression per row, about ten times slower for
// a batch's 64-float rows; the sums here are the same floats in the same
// order, so the results are bit for bit TF's.
//
// KerasPsNativeVersion: the library's version; a coordinator runs it on every
// task to learn whether that task has loaded this library.

#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tensorflow/core/util/work_sharder.h"

namespace keras_ps {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::Var;
using CPUDevice = Eigen::ThreadPoolDevice;

constexpr int kVersion = 8;

// The checks both row kernels make before writing a row: `grad` holds one
// row of `dim` values per index, and every index names a row of the table.
// No row is written when one fails.
absl::Status CheckRows(const Tensor& grad, const Tensor& indices,
                       int64_t rows, int64_t dim) {
  const int64_t n = indices.NumElements();
  if (grad.NumElements() != n * dim) {
    return tensorflow::errors::InvalidArgument(
        "grad must hold ", n, " rows of ", dim, " values. Received: ",
        grad.shape().DebugString());
  }
  const auto ids = indices.flat<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (ids(i) < 0 || ids(i) >= rows) {
      return tensorflow::errors::InvalidArgument(
          "row index ", ids(i), " is not in [0, ", rows, ")");
    }
  }
  return absl::OkStatus();
}

// The rows a gradient names are scattered over the table, so each row's
// first read is a cache miss in every array it touches (a random row of a
// large table is in no cache). ForEachRow calls `row(i)` for i in [begin,
// end) and asks the CPU, kAhead rows in advance, for the rows the later
// calls will touch: their misses overlap the arithmetic at hand instead of
// stalling it one after the other.
constexpr int64_t kAhead = 4;
constexpr int64_t kFloatsPerLine = 64 / sizeof(float);

// One cache line into the caches (L2 and below). On x86 it is written as the
// instruction itself: GCC 12 at -O3 dropped __builtin_prefetch from these
// loops (the built library held no prefetch at all).
inline void Prefetch(const void* address) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(address)));
#else
  __builtin_prefetch(address, /*rw=*/0, /*locality=*/1);
#endif
}

inline void PrefetchRow(const float* row, int64_t dim) {
  for (int64_t j = 0; j < dim; j += kFloatsPerLine) Prefetch(row + j);
}

// `prefetch(r)` asks for the arrays' row r; `row(i)` updates the row of the
// gradient's i-th index.
template <typename PrefetchFn, typename RowFn>
void ForEachRow(const int64_t* ids, int64_t begin, int64_t end,
                PrefetchFn prefetch, RowFn row) {
  for (int64_t i = begin; i < std::min(begin + kAhead, end); ++i) {
    prefetch(ids[i]);
  }
  for (int64_t i = begin; i < end; ++i) {
    if (i + kAhead < end) prefetch(ids[i + kAhead]);
    row(i);
  }
}

// The buffers a kernel writes row by row: the loops below read and write
// them through restrict pointers (so the compiler keeps them in vector
// registers), which holds only for distinct variables.
struct NamedBuffer {
  const char* input;  // the op's input name
  const void* data;
};

absl::Status CheckDistinct(std::initializer_list<NamedBuffer> buffers) {
  for (auto a = buffers.begin(); a != buffers.end(); ++a) {
    for (auto b = a + 1; b != buffers.end(); ++b) {
      if (a->data == b->data) {
        return tensorflow::errors::InvalidArgument(
            "inputs ", a->input, " and ", b->input, " are one variable: the "
            "variable and its slots must be distinct variables");
      }
    }
  }
  return absl::OkStatus();
}

// The row functions below are compiled three times on x86-64, for AVX-512,
// AVX2 and the baseline (SSE2); the loader picks the widest this CPU has.
// Their square roots and divisions are most of a row's work: with AVX-512's
// 16 lanes, one thread updates a batch's 2,600 distinct rows of 64 floats on
// a 5M-row shard in 0.47-0.49 ms (Adagrad) and 0.65-0.70 ms (LazyAdam),
// against 0.66-0.68 and 0.93-0.95 ms with SSE2's 4.
// Every lane computes the same IEEE operations in the same order (the build
// turns off fused multiply-adds, -ffp-contract=off), so each version gives
// the baseline's bits. (-DKERAS_PS_VECTOR_VERSIONS=inline builds the
// baseline alone: the test of those bits compares the two builds.)
#ifndef KERAS_PS_VECTOR_VERSIONS
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define KERAS_PS_VECTOR_VERSIONS \
  __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#endif
#ifndef KERAS_PS_VECTOR_VERSIONS
#define KERAS_PS_VECTOR_VERSIONS inline
#endif

// One row of LazyAdam, k >= 1 steps after the row's last update: the
// skipped steps' drift (drift_scale * m0 / (sqrt(v0) + eps); none for
// drift_scale == 0, which saves a square root and a division), then the
// step's own update. Every value is computed in the order of the update made
// of TF's ops (keras_ps.tables._rowwise.lazy_adam).
KERAS_PS_VECTOR_VERSIONS void LazyAdamRow(
    float* __restrict w, float* __restrict mr, float* __restrict vr,
    const float* __restrict g, int64_t dim, float drift_scale, float b1k,
    float b2k, float one_minus_b1, float one_minus_b2, float alpha,
    float eps) {
  if (drift_scale == 0) {
    for (int64_t j = 0; j < dim; ++j) {
      const float m1 = b1k * mr[j] + one_minus_b1 * g[j];
      const float v1 = b2k * vr[j] + one_minus_b2 * (g[j] * g[j]);
      mr[j] = m1;
      vr[j] = v1;
      w[j] -= alpha * m1 / (std::sqrt(v1) + eps);
    }
    return;
  }
  for (int64_t j = 0; j < dim; ++j) {
    const float m0 = mr[j];
    const float v0 = vr[j];
    const float drift = drift_scale * m0 / (std::sqrt(v0) + eps);
    const float m1 = b1k * m0 + one_minus_b1 * g[j];
    const float v1 = b2k * v0 + one_minus_b2 * (g[j] * g[j]);
    mr[j] = m1;
    vr[j] = v1;
    w[j] -= drift + alpha * m1 / (std::sqrt(v1) + eps);
  }
}

// One row of Keras' Adagrad: a = accumulator + g * g;
// var -= (lr * g) / sqrt(a + epsilon).
KERAS_PS_VECTOR_VERSIONS void AdagradRow(float* __restrict w,
                                         float* __restrict a,
                                         const float* __restrict g,
                                         int64_t dim, float lr, float eps) {
  for (int64_t j = 0; j < dim; ++j) {
    const float a1 = a[j] + g[j] * g[j];
    a[j] = a1;
    w[j] -= (lr * g[j]) / std::sqrt(a1 + eps);
  }
}

REGISTER_OP("KerasPsNativeVersion")
    .Output("version: int32")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);

class NativeVersionOp : public OpKernel {
 public:
  explicit NativeVersionOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {}, &out));
    out->scalar<int32_t>()() = kVersion;
  }
};
REGISTER_KERNEL_BUILDER(Name("KerasPsNativeVersion").Device(tensorflow::DEVICE_CPU),
                        NativeVersionOp);

REGISTER_OP("KerasPsSumRows")
    .Input("data: float")
    .Input("segment_ids: int32")
    .Input("num_segments: int32")
    .Output("output: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      tensorflow::shape_inference::ShapeHandle data, inner;
      tensorflow::shape_inference::DimensionHandle rows;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &data));
      TF_RETURN_IF_ERROR(c->Subshape(data, 1, &inner));
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(2, &rows));
      tensorflow::shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(rows), inner, &out));
      c->set_output(0, out);
      return absl::OkStatus();
    });

// data: [n, ...]; segment_ids: [n], each in [0, num_segments); output:
// [num_segments, ...], row j the sum of the rows i of data whose id is j,
// added in ascending i onto 0.0f (an id no row has: zeros), as TF's
// UnsortedSegmentSum on a CPU adds them.
class SumRowsOp : public OpKernel {
 public:
  explicit SumRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& data = ctx->input(0);
    const Tensor& segment_ids = ctx->input(1);
    const Tensor& num_segments = ctx->input(2);
    OP_REQUIRES(ctx, data.dims() >= 1,
                tensorflow::errors::InvalidArgument(
                    "data must have rank 1 or more. Received: ",
                    data.shape().DebugString()));
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsVector(segment_ids.shape()) &&
                         segment_ids.dim_size(0) == data.dim_size(0),
                tensorflow::errors::InvalidArgument(
                    "segment_ids must hold one id per row of data (",
                    data.dim_size(0), "). Received: ",
                    segment_ids.shape().DebugString()));
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(num_segments.shape()),
                tensorflow::errors::InvalidArgument(
                    "num_segments must be a scalar. Received: ",
                    num_segments.shape().DebugString()));
    const int64_t segments = num_segments.scalar<int32_t>()();
    OP_REQUIRES(ctx, segments >= 0,
                tensorflow::errors::InvalidArgument(
                    "num_segments must be 0 or more. Received: ", segments));
    const int64_t n = data.dim_size(0);
    const int64_t dim = n ? data.NumElements() / n : 0;
    const auto ids = segment_ids.flat<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, ids(i) >= 0 && ids(i) < segments,
                  tensorflow::errors::InvalidArgument(
                      "segment_ids[", i, "] = ", ids(i), " is not in [0, ",
                      segments, ")"));
    }
    tensorflow::TensorShape shape = data.shape();
    shape.set_dim(0, segments);
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &output));
    float* out = output->flat<float>().data();
    std::fill(out, out + output->NumElements(), 0.0f);
    const float* in = data.flat<float>().data();
    for (int64_t i = 0; i < n; ++i) {
      AddRow(out + ids(i) * dim, in + i * dim, dim);
    }
  }

 private:
  static void AddRow(float* __restrict sum, const float* __restrict row,
                     int64_t dim) {
    for (int64_t j = 0; j < dim; ++j) sum[j] += row[j];
  }
};
REGISTER_KERNEL_BUILDER(Name("KerasPsSumRows").Device(tensorflow::DEVICE_CPU),
                        SumRowsOp);

REGISTER_OP("KerasPsLazyAdamRows")
    .Input("var: resource")
    .Input("m: resource")
    .Input("v: resource")
    .Input("last_step: resource")
    .Input("grad: float")
    .Input("indices: int64")
    .Input("step: int64")
    .Input("lr: float")
    .Input("beta_1: float")
    .Input("beta_2: float")
    .Input("epsilon: float")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::NoOutputs);

// var, m, v: float32 variables of one shape [rows, ...]; last_step: int64
// [rows]; grad: [n, ...] (the rows of the gradient, each index once);
// indices: [n]. Each row is updated under the exclusive locks of all four
// variables, like TF's sparse apply kernels: a row's update is atomic.
class LazyAdamRowsOp : public OpKernel {
 public:
  explicit LazyAdamRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    // The int64 step variable first, before the float ones are locked: its
    // switch to copy-on-read (which copies it if a read holds its buffer)
    // takes its own lock.
    tensorflow::core::RefCountPtr<Var> last_var;
    OP_REQUIRES_OK(ctx, tensorflow::LookupResource(
                            ctx, tensorflow::HandleFromInput(ctx, 3), &last_var));
    OP_REQUIRES_OK(ctx, tensorflow::EnsureSparseVariableAccess<CPUDevice, int64_t>(
                            ctx, last_var.get()));
    auto locks = tensorflow::MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(
        ctx, /*do_lock=*/true, /*sparse=*/true, {0, 1, 2});
    tensorflow::mutex_lock last_lock(*last_var->mu());
    Tensor var, m, v;
    OP_REQUIRES_OK(ctx, tensorflow::GetInputTensorFromVariable<CPUDevice, float>(
                            ctx, 0, true, true, &var));
    OP_REQUIRES_OK(ctx, tensorflow::GetInputTensorFromVariable<CPUDevice, float>(
                            ctx, 1, true, true, &m));
    OP_REQUIRES_OK(ctx, tensorflow::GetInputTensorFromVariable<CPUDevice, float>(
                            ctx, 2, true, true, &v));
    Tensor* last = last_var->tensor();
    const Tensor& grad = ctx->input(4);
    const Tensor& indices = ctx->input(5);

    OP_REQUIRES(ctx, var.dims() >= 1 && var.shape() == m.shape() &&
                         var.shape() == v.shape(),
                tensorflow::errors::InvalidArgument(
                    "var, m and v must have one shape of rank 1 or more. Received: ",
                    var.shape().DebugString(), ", ", m.shape().DebugString(), ", ",
                    v.shape().DebugString()));
    const int64_t rows = var.dim_size(0);
    OP_REQUIRES(ctx, last->dtype() == tensorflow::DT_INT64 && last->dims() == 1 &&
                         last->dim_size(0) == rows,
                tensorflow::errors::InvalidArgument(
                    "last_step must be int64 of shape [", rows, "]. Received: ",
                    last->shape().DebugString()));
    const int64_t n = indices.NumElements();
    const int64_t dim = rows ? var.NumElements() / rows : 0;
    OP_REQUIRES_OK(ctx, CheckRows(grad, indices, rows, dim));
    const auto ids = indices.flat<int64_t>();

    const int64_t step = ctx->input(6).scalar<int64_t>()();
    const float lr = ctx->input(7).scalar<float>()();
    const float b1 = ctx->input(8).scalar<float>()();
    const float b2 = ctx->input(9).scalar<float>()();
    const float eps = ctx->input(10).scalar<float>()();
    const float t = static_cast<float>(step);
    const float alpha = lr * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t));
    const float rho = b1 / std::sqrt(b2);

    float* table = var.flat<float>().data();
    float* first = m.flat<float>().data();
    float* second = v.flat<float>().data();
    int64_t* steps = last->flat<int64_t>().data();
    const float* g_all = grad.flat<float>().data();
    OP_REQUIRES_OK(ctx, CheckDistinct({{"var", table}, {"m", first}, {"v", second}}));
    const float one_minus_b1 = 1 - b1;
    const float one_minus_b2 = 1 - b2;

    // The per-row factors of k, the steps since the row was last updated:
    // drift_scale = alpha * (rho + ... + rho^(k-1)), beta_1^k, beta_2^k.
    // Computed once per call for gaps of up to kKnown steps (three pow calls
    // each, where a row would make them itself), by the same calls as for a
    // longer gap: a row gets the same bits either way.
    auto factors = [&](float k, float* drift_scale, float* b1k, float* b2k) {
      *drift_scale = alpha * (rho * (1 - std::pow(rho, k - 1)) / (1 - rho));
      *b1k = std::pow(b1, k);
      *b2k = std::pow(b2, k);
    };
    constexpr int64_t kKnown = 64;
    float known[kKnown + 1][3];
    for (int64_t k = 1; k <= kKnown; ++k) {
      factors(static_cast<float>(k), &known[k][0], &known[k][1], &known[k][2]);
    }

    auto prefetch = [&](int64_t r) {
      Prefetch(steps + r);
      PrefetchRow(table + r * dim, dim);
      PrefetchRow(first + r * dim, dim);
      PrefetchRow(second + r * dim, dim);
    };
    auto row = [&](int64_t i) {
      const int64_t r = ids(i);
      // Steps since the row was last updated; 1 for a second update at the
      // same step (another worker's).
      const int64_t k = std::max<int64_t>(step - steps[r], 1);
      float drift_scale, b1k, b2k;
      if (k <= kKnown) {
        drift_scale = known[k][0];
        b1k = known[k][1];
        b2k = known[k][2];
      } else {
        factors(static_cast<float>(k), &drift_scale, &b1k, &b2k);
      }
      LazyAdamRow(table + r * dim, first + r * dim, second + r * dim,
                  g_all + i * dim, dim, drift_scale, b1k, b2k, one_minus_b1,
                  one_minus_b2, alpha, eps);
      steps[r] = std::max(steps[r], step);
    };
    auto update = [&](int64_t begin, int64_t end) {
      ForEachRow(ids.data(), begin, end, prefetch, row);
    };
    auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(threads->num_threads, threads->workers, n,
                      /*cost_per_unit=*/dim * 40, update);
  }
};
REGISTER_KERNEL_BUILDER(Name("KerasPsLazyAdamRows").Device(tensorflow::DEVICE_CPU),
                        LazyAdamRowsOp);

REGISTER_OP("KerasPsAdagradRows")
    .Input("var: resource")
    .Input("accumulator: resource")
    .Input("grad: float")
    .Input("indices: int64")
    .Input("lr: float")
    .Input("epsilon: float")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::NoOutputs);

// var, accumulator: float32 variables of one shape [rows, ...]; grad: [n, ...]
// (the rows of the gradient, each index once); indices: [n]. Under the
// exclusive locks of both variables, so a row's update is atomic. The
// arithmetic is in the order of the update made of TF's ops:
// a = accumulator + g * g; var -= (lr * g) / sqrt(a + epsilon).
class AdagradRowsOp : public OpKernel {
 public:
  explicit AdagradRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    auto locks = tensorflow::MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(
        ctx, /*do_lock=*/true, /*sparse=*/true, {0, 1});
    Tensor var, accum;
    OP_REQUIRES_OK(ctx, tensorflow::GetInputTensorFromVariable<CPUDevice, float>(
                            ctx, 0, true, true, &var));
    OP_REQUIRES_OK(ctx, tensorflow::GetInputTensorFromVariable<CPUDevice, float>(
                            ctx, 1, true, true, &accum));
    const Tensor& grad = ctx->input(2);
    const Tensor& indices = ctx->input(3);
    OP_REQUIRES(ctx, var.dims() >= 1 && var.shape() == accum.shape(),
                tensorflow::errors::InvalidArgument(
                    "var and accumulator must have one shape of rank 1 or more. "
                    "Received: ", var.shape().DebugString(), ", ",
                    accum.shape().DebugString()));
    const int64_t rows = var.dim_size(0);
    const int64_t n = indices.NumElements();
    const int64_t dim = rows ? var.NumElements() / rows : 0;
    OP_REQUIRES_OK(ctx, CheckRows(grad, indices, rows, dim));
    const auto ids = indices.flat<int64_t>();
    const float lr = ctx->input(4).scalar<float>()();
    const float eps = ctx->input(5).scalar<float>()();
    float* table = var.flat<float>().data();
    float* sums = accum.flat<float>().data();
    const float* g_all = grad.flat<float>().data();
    OP_REQUIRES_OK(ctx, CheckDistinct({{"var", table}, {"accumulator", sums}}));

    auto prefetch = [&](int64_t r) {
      PrefetchRow(table + r * dim, dim);
      PrefetchRow(sums + r * dim, dim);
    };
    auto row = [&](int64_t i) {
      const int64_t r = ids(i);
      AdagradRow(table + r * dim, sums + r * dim, g_all + i * dim, dim, lr, eps);
    };
    auto update = [&](int64_t begin, int64_t end) {
      ForEachRow(ids.data(), begin, end, prefetch, row);
    };
    auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(threads->num_threads, threads->workers, n,
                      /*cost_per_unit=*/dim * 10, update);
  }
};
REGISTER_KERNEL_BUILDER(Name("KerasPsAdagradRows").Device(tensorflow::DEVICE_CPU),
                        AdagradRowsOp);

}  // namespace keras_ps
