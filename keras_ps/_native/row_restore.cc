// keras_ps' row-file restore, built with row_updates.cc into one library by
// keras_ps/_native/__init__.py.
//
// KerasPsApplyRowFile: reads one of a backup's row files
// (keras_ps.backups._row_files), checks its length and farmhash fingerprint,
// and copies each row straight from the file's bytes into the variables that
// hold it now. Made of TF's ops the same restore reads the file into a
// string, cuts each part out of it (a copy), parses it as a TensorProto (two
// more: the proto's bytes, then the tensor's) and scatters the rows (the
// last copy); here a file's bytes are copied twice, once from the page cache
// and once into the variables, and the copy into a variable is one memcpy
// per run of consecutive rows (a full backup's file is one run).
//
// A part of the file is a serialized TensorProto: dtype (field 1), shape
// (field 2), version_number (field 3, ignored) and tensor_content (field 4,
// left out when the tensor is empty), as both keras_ps' writer and
// tf.io.serialize_tensor write it. Any other field (a proto written with
// typed value fields) is refused with an error naming the file: nothing
// keras_ps writes has one.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/env.h"
#include "tensorflow/core/platform/errors.h"

// FarmHash's Fingerprint64, what tf.fingerprint gives (see row_files.cc).
namespace farmhashna {
uint64_t Hash64(const char* s, size_t len);
}  // namespace farmhashna

namespace keras_ps {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::Var;

// Reads the local file `path` into the page cache on a thread of its own
// (nothing is waited for; a file that cannot be opened is left to its own
// read to report), so that the disk reads the next file of a restore while
// this one is applied. A thread reads it: posix_fadvise(WILLNEED) and
// readahead(2) left a cold file as slow to read as before on the VMs
// measured.
void Prefetch(tensorflow::Env* env, const std::string& path) {
  env->SchedClosure([path]() {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    constexpr size_t kBlock = size_t{1} << 20;
    std::unique_ptr<char[]> block(new char[kBlock]);
    off_t offset = 0;
    while (true) {
      const ssize_t count = pread(fd, block.get(), kBlock, offset);
      if (count < 0 && errno == EINTR) continue;
      if (count <= 0) break;
      offset += count;
    }
    close(fd);
  });
}

// What keras_ps.backups._apply matches to name a damaged file.
constexpr char kMismatch[] = "backup file length or fingerprint mismatch";

absl::Status ReadWhole(const std::string& path, std::vector<char>* bytes) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return tensorflow::errors::IOError(path, errno);
  struct stat info;
  if (fstat(fd, &info) != 0) {
    const int error = errno;
    close(fd);
    return tensorflow::errors::IOError(path, error);
  }
  const size_t size = static_cast<size_t>(info.st_size);
  bytes->resize(size);
  size_t done = 0;
  while (done < size) {
    const ssize_t count = pread(fd, bytes->data() + done, size - done,
                                static_cast<off_t>(done));
    if (count < 0 && errno == EINTR) continue;
    if (count <= 0) {
      const int error = count < 0 ? errno : 0;
      close(fd);
      if (error != 0) return tensorflow::errors::IOError(path, error);
      return tensorflow::errors::DataLoss(path, ": read ", done, " of ", size,
                                          " bytes");
    }
    done += static_cast<size_t>(count);
  }
  close(fd);
  return absl::OkStatus();
}

// A cursor over protobuf wire format.
struct Wire {
  const uint8_t* at;
  const uint8_t* end;

  bool Varint(uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64 && at < end; shift += 7) {
      const uint8_t byte = *at++;
      *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if (!(byte & 0x80)) return true;
    }
    return false;
  }

  // A length-delimited field's bytes.
  bool Bytes(Wire* inner) {
    uint64_t size;
    if (!Varint(&size) || size > static_cast<uint64_t>(end - at)) return false;
    *inner = {at, at + size};
    at += size;
    return true;
  }
};

// One part of a row file: a TensorProto's dtype, shape and raw content.
struct Part {
  int dtype = 0;
  std::vector<int64_t> shape;
  const char* content = nullptr;
  uint64_t bytes = 0;
};

bool ParseShape(Wire shape, std::vector<int64_t>* dims) {
  while (shape.at < shape.end) {
    uint64_t tag;
    if (!shape.Varint(&tag)) return false;
    if (tag == (2 << 3 | 2)) {  // dim
      Wire dim;
      if (!shape.Bytes(&dim)) return false;
      int64_t size = 0;
      while (dim.at < dim.end) {
        uint64_t dim_tag, value;
        if (!dim.Varint(&dim_tag)) return false;
        if (dim_tag == (1 << 3 | 0)) {  // size
          if (!dim.Varint(&value)) return false;
          size = static_cast<int64_t>(value);
        } else if (dim_tag == (2 << 3 | 2)) {  // name
          Wire name;
          if (!dim.Bytes(&name)) return false;
        } else {
          return false;
        }
      }
      dims->push_back(size);
    } else if (tag == (3 << 3 | 0)) {  // unknown_rank
      uint64_t unknown;
      if (!shape.Varint(&unknown) || unknown != 0) return false;
    } else {
      return false;
    }
  }
  return true;
}

bool ParsePart(const char* data, uint64_t size, Part* part) {
  Wire wire{reinterpret_cast<const uint8_t*>(data),
            reinterpret_cast<const uint8_t*>(data) + size};
  while (wire.at < wire.end) {
    uint64_t tag, value;
    if (!wire.Varint(&tag)) return false;
    if (tag == (1 << 3 | 0)) {  // dtype
      if (!wire.Varint(&value)) return false;
      part->dtype = static_cast<int>(value);
    } else if (tag == (2 << 3 | 2)) {  // tensor_shape
      Wire shape;
      if (!wire.Bytes(&shape) || !ParseShape(shape, &part->shape)) return false;
    } else if (tag == (3 << 3 | 0)) {  // version_number
      if (!wire.Varint(&value)) return false;
    } else if (tag == (4 << 3 | 2)) {  // tensor_content
      Wire content;
      if (!wire.Bytes(&content)) return false;
      part->content = reinterpret_cast<const char*>(content.at);
      part->bytes = static_cast<uint64_t>(content.end - content.at);
    } else {
      return false;
    }
  }
  return true;
}

// Makes `var`'s buffer its own before rows are written into it in place (a
// read in flight may share it), and has later reads copy, as TF's sparse
// updates do. Under the variable's exclusive lock.
absl::Status OwnBuffer(OpKernelContext* ctx, Var* var) {
  var->copy_on_read_mode.store(true);
  Tensor* tensor = var->tensor();
  if (tensor->RefCountIsOne()) return absl::OkStatus();
  Tensor copy;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tensor->dtype(), tensor->shape(), &copy));
  const auto from = tensor->tensor_data();
  std::memcpy(const_cast<char*>(copy.tensor_data().data()), from.data(),
              from.size());
  *tensor = copy;
  return absl::OkStatus();
}

REGISTER_OP("KerasPsApplyRowFile")
    .Input("filename: string")
    .Input("next: string")
    .Input("length: int64")
    .Input("fingerprint: int64")
    .Input("sizes: int64")
    .Input("components: int32")
    .Input("offsets: int64")
    .Input("variables: N * resource")
    .Attr("N: int >= 1")
    .Output("rows: int64")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);

// filename: the row file; next: the file read after it ("" none), read into
// the page cache meanwhile; length, fingerprint: the manifest's; sizes: the
// byte size of each part (ids first); components[i]: the part holding the
// rows of variables[i], whose first row is global row offsets[i]. Writes the
// rows whose ids fall in each variable, under its exclusive lock; returns
// how many rows it wrote in all. A file that does not match, or whose parts
// do not fit the variables, writes nothing.
class ApplyRowFileOp : public OpKernel {
 public:
  explicit ApplyRowFileOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    for (int i = 0; i < 4; ++i) {
      OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(
                           ctx->input(i).shape()),
                  tensorflow::errors::InvalidArgument(
                      "filename, next, length and fingerprint must be "
                      "scalars. Received input ", i, " of shape ",
                      ctx->input(i).shape().DebugString()));
    }
    const std::string path(ctx->input(0).scalar<tensorflow::tstring>()());
    const std::string next(ctx->input(1).scalar<tensorflow::tstring>()());
    const int64_t length = ctx->input(2).scalar<int64_t>()();
    const int64_t expected_print = ctx->input(3).scalar<int64_t>()();
    const auto sizes = ctx->input(4).flat<int64_t>();
    const auto components = ctx->input(5).flat<int32_t>();
    const auto offsets = ctx->input(6).flat<int64_t>();
    const int count = ctx->num_inputs() - 7;
    OP_REQUIRES(ctx, components.size() == count && offsets.size() == count,
                tensorflow::errors::InvalidArgument(
                    "components and offsets need one value per variable (",
                    count, "). Received: ", components.size(), ", ",
                    offsets.size()));
    OP_REQUIRES(ctx, path.find("://") == std::string::npos,
                tensorflow::errors::InvalidArgument(
                    "KerasPsApplyRowFile reads local files only. Received: ",
                    path));
    if (!next.empty() && next.find("://") == std::string::npos) {
      Prefetch(ctx->env(), next);
    }

    // Kept for the next file of this thread: a fresh buffer of tens of MB
    // costs its page faults again. Not more than two files' worth is kept.
    thread_local std::vector<char> bytes;
    if (bytes.capacity() > (size_t{128} << 20)) std::vector<char>().swap(bytes);
    OP_REQUIRES_OK(ctx, ReadWhole(path, &bytes));
    const int64_t print = static_cast<int64_t>(
        farmhashna::Hash64(bytes.data(), bytes.size()));
    OP_REQUIRES(ctx, static_cast<int64_t>(bytes.size()) == length &&
                         print == expected_print,
                tensorflow::errors::DataLoss(kMismatch, " ", path));

    std::vector<Part> parts(sizes.size());
    int64_t start = 0;
    for (int i = 0; i < sizes.size(); ++i) {
      OP_REQUIRES(ctx, sizes(i) >= 0 && start + sizes(i) <= length &&
                           ParsePart(bytes.data() + start, sizes(i), &parts[i]),
                  tensorflow::errors::InvalidArgument(
                      "part ", i, " of ", path, " is not a serialized tensor "
                      "this restore reads"));
      start += sizes(i);
    }
    const Part& ids = parts[0];
    OP_REQUIRES(ctx, ids.dtype == tensorflow::DT_INT64 && ids.shape.size() == 1 &&
                         ids.bytes == static_cast<uint64_t>(ids.shape[0]) * 8,
                tensorflow::errors::InvalidArgument(
                    "the ids of ", path, " are not an int64 vector"));
    const int64_t n = ids.shape[0];
    std::vector<int64_t> global(n);
    if (n > 0) std::memcpy(global.data(), ids.content, n * 8);

    // Every variable locked, in a fixed order, before any row is written.
    std::vector<tensorflow::core::RefCountPtr<Var>> vars(count);
    std::vector<int> order(count);
    for (int i = 0; i < count; ++i) {
      OP_REQUIRES_OK(ctx, tensorflow::LookupResource(
                              ctx, tensorflow::HandleFromInput(ctx, 7 + i),
                              &vars[i]));
      order[i] = i;
    }
    std::sort(order.begin(), order.end(), [&](int a, int b) {
      return vars[a].get() < vars[b].get();
    });
    std::vector<tensorflow::mutex_lock> locks;
    locks.reserve(count);
    for (int i = 0; i < count; ++i) {
      if (i > 0 && vars[order[i]].get() == vars[order[i - 1]].get()) continue;
      locks.emplace_back(*vars[order[i]]->mu());
    }

    std::vector<int64_t> row_bytes(count);
    for (int i = 0; i < count; ++i) {
      Var* var = vars[i].get();
      const Tensor& value = *var->tensor();
      const int c = components(i);
      OP_REQUIRES(ctx, c > 0 && c < static_cast<int>(parts.size()),
                  tensorflow::errors::InvalidArgument(
                      "component ", c, " is not a part of ", path));
      const Part& rows = parts[c];
      OP_REQUIRES(ctx, var->is_initialized && value.dims() >= 1 &&
                           tensorflow::DataTypeCanUseMemcpy(value.dtype()),
                  tensorflow::errors::InvalidArgument(
                      "variable ", i, " cannot take rows of ", path, ": ",
                      value.DebugString()));
      bool fits = rows.dtype == value.dtype() &&
                  static_cast<int>(rows.shape.size()) == value.dims() &&
                  rows.shape[0] == n;
      for (int d = 1; fits && d < value.dims(); ++d) {
        fits = rows.shape[d] == value.dim_size(d);
      }
      const int64_t dim = value.dim_size(0) ? value.NumElements() / value.dim_size(0)
                                            : 0;
      row_bytes[i] = dim * tensorflow::DataTypeSize(value.dtype());
      OP_REQUIRES(ctx, fits && rows.bytes == static_cast<uint64_t>(n * row_bytes[i]),
                  tensorflow::errors::InvalidArgument(
                      "part ", c, " of ", path, " does not hold rows of ",
                      value.DebugString()));
    }
    for (int i = 0; i < count; ++i) {
      OP_REQUIRES_OK(ctx, OwnBuffer(ctx, vars[i].get()));
    }

    int64_t written = 0;
    for (int i = 0; i < count; ++i) {
      const Tensor& value = *vars[i]->tensor();
      char* out = const_cast<char*>(value.tensor_data().data());
      const char* in = parts[components(i)].content;
      const int64_t first = offsets(i), rows = value.dim_size(0);
      const int64_t width = row_bytes[i];
      // Runs of consecutive ids inside the variable: one copy each.
      int64_t r = 0;
      while (r < n) {
        const int64_t id = global[r] - first;
        if (id < 0 || id >= rows) {
          ++r;
          continue;
        }
        int64_t run = 1;
        while (r + run < n && global[r + run] - first == id + run &&
               id + run < rows) {
          ++run;
        }
        std::memcpy(out + id * width, in + r * width, run * width);
        written += run;
        r += run;
      }
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {}, &out));
    out->scalar<int64_t>()() = written;
  }
};
REGISTER_KERNEL_BUILDER(Name("KerasPsApplyRowFile").Device(tensorflow::DEVICE_CPU),
                        ApplyRowFileOp);

}  // namespace keras_ps
