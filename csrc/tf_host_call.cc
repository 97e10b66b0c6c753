// RingtrainHostCall: the asynchronous TensorFlow op behind ringtrain.tensorflow's collectives in graphs and
// tf.function.
//
// A collective must never hold one of TensorFlow's executor threads while it waits for the other ranks: TF runs
// independent ops in an order that differs between ranks, and ops that block their thread until every rank has
// arrived deadlock once each rank waits inside a different one. This kernel is an AsyncOpKernel (as Horovod's):
// ComputeAsync hands the inputs to the one Python function ringtrain registered (ringtrain_tf_set_start, through
// ctypes, which takes the GIL) and returns at once; Python runs the collective off TF's threads and later calls
// ringtrain_tf_output / ringtrain_tf_adopt_output for each result and ringtrain_tf_finish, which calls TF's `done`.
//
// Results: ringtrain_tf_output allocates a TF output (Python writes into it); ringtrain_tf_adopt_output hands TF a
// 64-byte-aligned host buffer Python already holds, without a copy (as tf.numpy_function does), and tells Python to
// drop its reference (ringtrain_tf_set_release) when TF frees the tensor.
//
// Built on first use by ringtrain/tensorflow/op_build.py against tf.sysconfig's headers.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

using namespace tensorflow;

// start(call, token, num_inputs, dtypes, ranks, dims (concatenated), data, error, error_size): 0 when Python took
// the call (it will finish the token), else nonzero (a TF error code) with a message in error; then the kernel
// finishes itself.
typedef int (*StartFunction)(int64_t call, void* token, int64_t num_inputs, const int32_t* dtypes,
                             const int32_t* ranks, const int64_t* dims, void* const* data, char* error,
                             int64_t error_size);
typedef void (*ReleaseFunction)(int64_t keep_id);

static StartFunction start_function = nullptr;
static ReleaseFunction release_function = nullptr;

extern "C" void ringtrain_tf_set_start(StartFunction function) { start_function = function; }
extern "C" void ringtrain_tf_set_release(ReleaseFunction function) { release_function = function; }

namespace {

struct Call {
  OpKernelContext* context;
  AsyncOpKernel::DoneCallback done;
};

// A host buffer Python owns, adopted as a tensor's storage; Python's reference is dropped when TF frees it.
class AdoptedBuffer : public TensorBuffer {
 public:
  AdoptedBuffer(void* data, size_t size, int64_t keep_id) : TensorBuffer(data), size_(size), keep_id_(keep_id) {}
  ~AdoptedBuffer() override {
    if (release_function != nullptr) release_function(keep_id_);
  }
  size_t size() const override { return size_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(AllocationDescription* proto) const override {}
  bool OwnsMemory() const override { return false; }

 private:
  size_t size_;
  int64_t keep_id_;
};

TensorShape shape_of(int64_t ndim, const int64_t* dims) {
  TensorShape shape;
  for (int64_t i = 0; i < ndim; ++i) shape.AddDim(dims[i]);
  return shape;
}

void copy_message(const std::string& message, char* error, int64_t error_size) {
  if (error_size <= 0) return;
  size_t n = std::min(message.size(), static_cast<size_t>(error_size - 1));
  std::memcpy(error, message.data(), n);
  error[n] = '\0';
}

}  // namespace

class RingtrainHostCallOp : public AsyncOpKernel {
 public:
  explicit RingtrainHostCallOp(OpKernelConstruction* context) : AsyncOpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("call", &call_));
  }

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    OP_REQUIRES_ASYNC(context, start_function != nullptr,
                      errors::Internal("ringtrain: no Python start function registered for RingtrainHostCall"),
                      done);
    const int n = context->num_inputs();
    std::vector<int32_t> dtypes(n), ranks(n);
    std::vector<int64_t> dims;
    std::vector<void*> data(n);
    for (int i = 0; i < n; ++i) {
      const Tensor& input = context->input(i);
      dtypes[i] = static_cast<int32_t>(input.dtype());
      ranks[i] = input.dims();
      for (int d = 0; d < input.dims(); ++d) dims.push_back(input.dim_size(d));
      data[i] = const_cast<char*>(input.tensor_data().data());
    }
    auto* call = new Call{context, std::move(done)};
    char error[4096];
    error[0] = '\0';
    int code = start_function(call_, call, n, dtypes.data(), ranks.data(), dims.data(), data.data(), error,
                              sizeof error);
    if (code != 0) {
      context->SetStatus(absl::Status(static_cast<absl::StatusCode>(code), error));
      auto finish = std::move(call->done);
      delete call;
      finish();
    }
  }

 private:
  int64_t call_;
};

// A fresh output of this shape; returns its data (nullptr and a message in error when TF refuses).
extern "C" void* ringtrain_tf_output(void* token, int64_t index, int64_t ndim, const int64_t* dims, char* error,
                                     int64_t error_size) {
  auto* call = static_cast<Call*>(token);
  Tensor* output = nullptr;
  absl::Status status = call->context->allocate_output(static_cast<int>(index), shape_of(ndim, dims), &output);
  if (!status.ok()) {
    copy_message(std::string(status.message()), error, error_size);
    return nullptr;
  }
  void* data = const_cast<char*>(output->tensor_data().data());
  return data != nullptr ? data : reinterpret_cast<void*>(output);   // empty tensors: any non-null pointer
}

// Output `index` is `data` (nbytes bytes, 64-byte aligned, of the output's dtype) without a copy; TF calls the
// release function with keep_id when it no longer needs it.
extern "C" void ringtrain_tf_adopt_output(void* token, int64_t index, int64_t ndim, const int64_t* dims, void* data,
                                          int64_t nbytes, int64_t keep_id) {
  auto* call = static_cast<Call*>(token);
  auto* buffer = new AdoptedBuffer(data, static_cast<size_t>(nbytes), keep_id);
  Tensor output(call->context->expected_output_dtype(static_cast<int>(index)), shape_of(ndim, dims), buffer);
  buffer->Unref();     // the tensor holds its own reference
  call->context->set_output(static_cast<int>(index), output);
}

// Ends the call: code 0 = success, else a TF error code with its message. The token is invalid afterwards.
extern "C" void ringtrain_tf_finish(void* token, int32_t code, const char* message) {
  auto* call = static_cast<Call*>(token);
  if (code != 0) call->context->SetStatus(absl::Status(static_cast<absl::StatusCode>(code), message));
  auto done = std::move(call->done);
  delete call;
  done();
}

REGISTER_OP("RingtrainHostCall")
    .Input("inputs: Tin")
    .Output("outputs: Tout")
    .Attr("Tin: list(type) >= 0")
    .Attr("Tout: list(type) >= 0")
    .Attr("call: int")
    .SetIsStateful()
    .SetShapeFn(shape_inference::UnknownShape);

REGISTER_KERNEL_BUILDER(Name("RingtrainHostCall").Device(DEVICE_CPU), RingtrainHostCallOp);
