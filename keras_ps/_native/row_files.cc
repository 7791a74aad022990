// keras_ps' row-file writer, built with row_updates.cc into one library by
// keras_ps/_native/__init__.py. Its reader is row_restore.cc.
//
// KerasPsWriteTensors: writes a backup's row file (keras_ps.backups._row_files)
// in one copy of its bytes. The file is the concatenation of each tensor
// serialized as tf.io.serialize_tensor serializes it (a TensorProto with its
// dtype, shape and raw content), byte for byte; the op returns its length,
// its farmhash fingerprint (what tf.fingerprint gives for the file's bytes)
// and the size of each part. Made of TF's ops the same file takes
// serialize_tensor (a copy of each tensor), strings.join (a copy of them all)
// and write_file: about 150 ms for a 62 MB file here against 30-60 ms.
//
// On a filesystem of a local disk (ext4, XFS, Btrfs), a file may be
// written with O_DIRECT: its bytes go from the op's buffer to the disk, not
// through the page cache. A buffered write copies them into the cache, and
// the kernel spends CPU again writing them back and dropping them when an
// old backup is deleted: at a delta every 100 steps that is hundreds of MB
// a second on the cores that train. But a restore then reads those files
// from the disk instead of the cache, so it is opt-in, with
// KERAS_PS_DIRECT_IO: 1 writes every file so; "deltas" the files whose
// caller says so (attr direct_by_default: a delta's, written often and
// small next to the table, not a full backup's, which a restore reads most
// of); unset or 0, none. Elsewhere (NFS, tmpfs, overlay, FUSE), or when the
// filesystem refuses O_DIRECT, the file is written through TF's Env. The
// bytes are the same.

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/env.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/platform/path.h"

// FarmHash's Fingerprint64, which tf.fingerprint computes: exported by
// libtensorflow_framework under this name (farmhash::Fingerprint64 is
// farmhashna::Hash64).
namespace farmhashna {
uint64_t Hash64(const char* s, size_t len);
}  // namespace farmhashna

namespace keras_ps {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

void PutVarint(std::string* out, uint64_t value) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>(value | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

void PutField(std::string* out, int field, const std::string& message) {
  out->push_back(static_cast<char>(field << 3 | 2));  // length-delimited
  PutVarint(out, message.size());
  out->append(message);
}

// What precedes a tensor's raw bytes in its serialized TensorProto: dtype
// (field 1), tensor_shape (field 2: a Dim, field 2, per dimension, with its
// size, field 1, left out when 0 as proto3 does), then the tag and length of
// tensor_content (field 4), left out with the field when the tensor is
// empty. version_number (field 3) is 0: not written.
std::string TensorProtoHeader(const Tensor& tensor, uint64_t content_bytes) {
  std::string shape;
  for (int64_t size : tensor.shape().dim_sizes()) {
    std::string dim;
    if (size != 0) {
      dim.push_back(1 << 3);  // field 1, varint
      PutVarint(&dim, static_cast<uint64_t>(size));
    }
    PutField(&shape, 2, dim);
  }
  std::string header;
  header.push_back(1 << 3);
  PutVarint(&header, static_cast<uint64_t>(tensor.dtype()));
  PutField(&header, 2, shape);
  if (content_bytes > 0) {
    header.push_back(static_cast<char>(4 << 3 | 2));
    PutVarint(&header, content_bytes);
  }
  return header;
}

// O_DIRECT needs the buffer, the file offsets and the lengths aligned.
constexpr size_t kDirectAlign = 4096;

size_t RoundUp(size_t bytes) {
  return (bytes + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
}

// A buffer aligned for O_DIRECT, with room for a file rounded up.
struct AlignedBuffer {
  char* data = nullptr;
  size_t capacity = 0;

  ~AlignedBuffer() { std::free(data); }

  bool Reserve(size_t bytes) {
    bytes = RoundUp(bytes == 0 ? 1 : bytes);
    if (bytes <= capacity) return true;
    Release();
    void* memory = nullptr;
    if (posix_memalign(&memory, kDirectAlign, bytes) != 0) return false;
    data = static_cast<char*>(memory);
    capacity = bytes;
    return true;
  }

  void Release() {
    std::free(data);
    data = nullptr;
    capacity = 0;
  }
};

// Whether a file at `path`, in `folder`, is written with O_DIRECT: every
// file with KERAS_PS_DIRECT_IO=1, those the caller marks (`by_default`)
// with "deltas", none otherwise; only on a local disk's filesystem.
bool DirectIoAllowed(const std::string& path, const std::string& folder,
                     bool by_default) {
  const char* raw = std::getenv("KERAS_PS_DIRECT_IO");
  const std::string setting = raw == nullptr ? "" : raw;
  if (!(setting == "1" || (setting == "deltas" && by_default))) return false;
  if (path.find("://") != std::string::npos) return false;  // not a local path
  struct statfs fs;
  if (statfs(folder.empty() ? "." : folder.c_str(), &fs) != 0) return false;
  constexpr long kExt4 = 0xEF53, kXfs = 0x58465342, kBtrfs = 0x9123683E;
  return fs.f_type == kExt4 || fs.f_type == kXfs || fs.f_type == kBtrfs;
}

// Writes `bytes` bytes of `data` (aligned, with room up to the next
// alignment) into `path` with O_DIRECT. *written false and an OK status:
// the filesystem took no O_DIRECT write, nothing was written; the caller
// writes the file another way.
absl::Status WriteDirect(const std::string& path, char* data, size_t bytes,
                         bool* written) {
  *written = false;
  const int fd = open(path.c_str(),
                      O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0666);
  if (fd < 0) {
    if (errno == EINVAL) return absl::OkStatus();
    return tensorflow::errors::IOError(path, errno);
  }
  const size_t padded = RoundUp(bytes);
  std::memset(data + bytes, 0, padded - bytes);
  size_t done = 0;
  while (done < padded) {
    const ssize_t count = write(fd, data + done, padded - done);
    if (count < 0 && errno == EINTR) continue;
    if (count <= 0) {
      const int error = count < 0 ? errno : EIO;
      close(fd);
      if (error == EINVAL && done == 0) return absl::OkStatus();
      return tensorflow::errors::IOError(path, error);
    }
    done += static_cast<size_t>(count);
  }
  // The padding off: the file holds exactly its bytes.
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int error = errno;
    close(fd);
    return tensorflow::errors::IOError(path, error);
  }
  if (close(fd) != 0) return tensorflow::errors::IOError(path, errno);
  *written = true;
  return absl::OkStatus();
}

REGISTER_OP("KerasPsWriteTensors")
    .Input("filename: string")
    .Input("tensors: T")
    .Attr("T: list({float, double, int32, int64, half, bfloat16, int8, "
          "uint8, int16, uint16, uint32, uint64, bool})")
    .Attr("direct_by_default: bool = false")
    .Output("length: int64")
    .Output("fingerprint: int64")
    .Output("sizes: int64")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Scalar());
      c->set_output(2, c->Vector(c->num_inputs() - 1));
      return absl::OkStatus();
    });

class WriteTensorsOp : public OpKernel {
 public:
  explicit WriteTensorsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("direct_by_default", &direct_by_default_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& filename = ctx->input(0);
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(filename.shape()),
                tensorflow::errors::InvalidArgument(
                    "filename must be a scalar. Received: ",
                    filename.shape().DebugString()));
    const std::string path(filename.scalar<tensorflow::tstring>()());
    tensorflow::OpInputList tensors;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));

    std::vector<std::string> headers;
    uint64_t total = 0;
    for (const Tensor& tensor : tensors) {
      const uint64_t bytes = tensor.tensor_data().size();
      headers.push_back(TensorProtoHeader(tensor, bytes));
      total += headers.back().size() + bytes;
    }
    // One contiguous copy: the fingerprint is of the whole file's bytes.
    // Kept for the next file of this thread: a fresh buffer of tens of MB
    // costs its page faults again.
    thread_local AlignedBuffer content;
    OP_REQUIRES(ctx, content.Reserve(total),
                tensorflow::errors::ResourceExhausted(
                    "no memory for a buffer of ", total, " bytes to write ",
                    path));
    char* out = content.data;
    Tensor* sizes = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            2, {static_cast<int64_t>(tensors.size())}, &sizes));
    for (int i = 0; i < tensors.size(); ++i) {
      const auto data = tensors[i].tensor_data();
      std::memcpy(out, headers[i].data(), headers[i].size());
      out += headers[i].size();
      if (!data.empty()) std::memcpy(out, data.data(), data.size());
      out += data.size();
      sizes->vec<int64_t>()(i) = headers[i].size() + data.size();
    }
    // Before the write: O_DIRECT's padding goes after the bytes.
    const uint64_t print = farmhashna::Hash64(content.data, total);

    tensorflow::Env* env = ctx->env();
    const std::string folder(tensorflow::io::Dirname(path));
    OP_REQUIRES_OK(ctx, env->RecursivelyCreateDir(folder));
    bool written = false;
    if (DirectIoAllowed(path, folder, direct_by_default_)) {
      OP_REQUIRES_OK(ctx, WriteDirect(path, content.data, total, &written));
    }
    if (!written) {
      std::unique_ptr<tensorflow::WritableFile> file;
      OP_REQUIRES_OK(ctx, env->NewWritableFile(path, &file));
      OP_REQUIRES_OK(ctx, file->Append(absl::string_view(content.data, total)));
      OP_REQUIRES_OK(ctx, file->Close());
    }

    Tensor* length = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {}, &length));
    length->scalar<int64_t>()() = static_cast<int64_t>(total);
    Tensor* fingerprint = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, {}, &fingerprint));
    fingerprint->scalar<int64_t>()() = static_cast<int64_t>(print);
    if (content.capacity > (size_t{128} << 20)) {
      content.Release();  // not more than two blocks' worth kept
    }
  }

 private:
  bool direct_by_default_ = false;
};
REGISTER_KERNEL_BUILDER(Name("KerasPsWriteTensors").Device(tensorflow::DEVICE_CPU),
                        WriteTensorsOp);

}  // namespace keras_ps
