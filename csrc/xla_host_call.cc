// The XLA FFI handler behind ringtrain.jax's collectives inside jax.jit on CPU.
//
// XLA calls it with its own input and output buffers. It hands their addresses to the one host function ringtrain
// registered (ringtrain_set_host_function: a Python function, through ctypes, which takes the GIL), and that
// function runs the collective reading the inputs where XLA keeps them and writing the results straight into XLA's
// output buffers. Compared with JAX's Python host callback this saves XLA's copy of every result out of the
// callback's arrays and JAX's per-call wrapping of inputs and results.
//
// The collectives themselves stay in ringtrain's engine (Python), so this file only decodes the call frame: which
// collective (the "call" attribute, an index into ringtrain.jax.ffi_target's table of lowered calls) and where
// its buffers are. Operands and results of type TOKEN are the ordering token that JAX threads through every
// ringtrain collective of a computation (so XLA runs them in program order); they carry no data and are skipped.
//
// Built on first use by ringtrain/jax/ffi_build.py against jax.ffi.include_dir(); if it cannot be built, the
// collectives fall back to JAX's Python host callback (with a warning).
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Returns 0 on success; otherwise writes a NUL-terminated message of at most error_size bytes into error.
typedef int (*HostFunction)(int64_t call, int64_t num_inputs, void* const* inputs, int64_t num_outputs,
                            void* const* outputs, char* error, int64_t error_size);

static HostFunction host_function = nullptr;

extern "C" void ringtrain_set_host_function(HostFunction function) { host_function = function; }

static ffi::Error HostCall(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t call) {
  if (host_function == nullptr) {
    return ffi::Error::Internal("ringtrain: no host function registered for the XLA FFI handler");
  }
  std::vector<void*> inputs, outputs;
  inputs.reserve(args.size());
  outputs.reserve(rets.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    if (buffer->element_type() != ffi::DataType::TOKEN) inputs.push_back(buffer->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    if ((*buffer)->element_type() != ffi::DataType::TOKEN) outputs.push_back((*buffer)->untyped_data());
  }
  char error[4096];
  error[0] = '\0';
  if (host_function(call, static_cast<int64_t>(inputs.size()), inputs.data(), static_cast<int64_t>(outputs.size()),
                    outputs.data(), error, sizeof error) != 0) {
    return ffi::Error::Internal(std::string(error));
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ringtrain_host_call, HostCall,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<int64_t>("call"));
