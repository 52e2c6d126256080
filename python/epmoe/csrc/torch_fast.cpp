// epmoe.torch's eager fast path as a torch C++ extension (built on request by
// epmoe.torch.load_fast_path with torch.utils.cpp_extension; nothing else in the package needs a
// compiler). One call checks the three input tensors, allocates y with torch's caching allocator,
// fills epmoe_forward_args and calls epmoe_layer_forward_args of libepmoe_c.so, whose address the
// Python side passes in once (so this module links nothing of epmoe).
//
// Why: the same steps in Python (a chain of tensor attribute reads, torch.empty, a struct packed
// with struct.pack_into, a ctypes call) cost 3.4-5 us more per eager module call than this one
// pybind11 call (~14-15 against ~10-11 us on a quiet host; docs/BENCHMARKS.md, "Host time per
// eager call").
//
// What it checks is what _Bound.forward checks (python/epmoe/torch.py), on the same values. Any
// failed check returns None and does nothing (no allocation, no call): the caller then runs its
// own checks, which raise an error naming the argument. The library checks everything again
// before it launches.
#include <ATen/cuda/CUDAContext.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <cstdint>

namespace {

// include/epmoe/c_api.h's epmoe_forward_args, field for field (c_api.cpp static_asserts its
// offsets; the Python side checks this struct's size, ARGS_BYTES, against _lib.ForwardArgsC).
struct ForwardArgs {
  const void* x;
  const void* topk_idx;
  const float* topk_weights;
  void* y;
  int32_t* expert_counts;
  int64_t* expert_counts_total;
  void* stream;
  int64_t num_tokens;
  int32_t idx_type;
  int32_t path;
};
static_assert(sizeof(ForwardArgs) == 72, "epmoe_forward_args is 72 bytes");
static_assert(offsetof(ForwardArgs, stream) == 48 && offsetof(ForwardArgs, num_tokens) == 56 &&
                  offsetof(ForwardArgs, idx_type) == 64 && offsetof(ForwardArgs, path) == 68,
              "epmoe_forward_args layout");

using ForwardFn = int (*)(void* layer, const ForwardArgs* args);

// A plain strided 2-D tensor (nested and sparse ones are declined before any size is read).
bool plain_2d(const at::Tensor& v) { return !v.is_nested() && v.layout() == at::kStrided && v.dim() == 2; }

bool ok_2d(const at::Tensor& v, at::ScalarType dtype, int64_t dev, int64_t rows, int64_t cols) {
  return plain_2d(v) && v.scalar_type() == dtype && v.size(0) == rows && v.size(1) == cols && v.is_cuda() &&
         v.get_device() == dev && v.is_contiguous();
}

// A layer's constants, bound once (epmoe.torch._Bound); the layer handle comes with each call, so a
// closed layer (handle None on the Python side) never reaches this.
class FastForward {
 public:
  FastForward(int64_t fn, int64_t device, int64_t hidden, int64_t topk, int64_t t_max, int64_t idx_int32,
              int64_t idx_int64)
      : fn_(reinterpret_cast<ForwardFn>(static_cast<uintptr_t>(fn))),
        device_(device),
        hidden_(hidden),
        topk_(topk),
        t_max_(t_max),
        idx_int32_(int32_t(idx_int32)),
        idx_int64_(int32_t(idx_int64)) {
    TORCH_CHECK(fn != 0, "epmoe fast path: null epmoe_layer_forward_args");
  }

  // (y, status): status is epmoe_layer_forward_args's (nonzero: the caller raises); or None when a
  // check failed (nothing was done). counts / totals: device addresses or 0 (checked by the caller).
  // The tensors come as Python objects: anything that is not a tensor is declined here, not by
  // pybind11's own TypeError, so that the caller's checks give their usual message.
  py::object call(int64_t layer, py::handle x_obj, py::handle idx_obj, py::handle w_obj, int64_t path, int64_t counts,
                  int64_t totals) const {
    if (layer == 0 || !THPVariable_Check(x_obj.ptr()) || !THPVariable_Check(idx_obj.ptr()) ||
        !THPVariable_Check(w_obj.ptr()))
      return py::none();
    const at::Tensor& x = THPVariable_Unpack(x_obj.ptr());
    const at::Tensor& topk_idx = THPVariable_Unpack(idx_obj.ptr());
    const at::Tensor& topk_weights = THPVariable_Unpack(w_obj.ptr());
    ForwardArgs a;
    at::Tensor y;
    try {
      // Any torch error on the way (a tensor without storage, out of memory in at::empty): nothing
      // was launched, and the caller's own path raises torch's own error for it.
      if (!plain_2d(x)) return py::none();
      const int64_t t = x.size(0);
      const bool wide = topk_idx.scalar_type() == at::kLong;
      if (t > t_max_ || !ok_2d(x, at::kBFloat16, device_, t, hidden_) ||
          !ok_2d(topk_idx, wide ? at::kLong : at::kInt, device_, t, topk_) ||
          !ok_2d(topk_weights, at::kFloat, device_, t, topk_))
        return py::none();
      a.x = x.data_ptr();
      if (reinterpret_cast<uintptr_t>(a.x) % 16 != 0) return py::none();
      y = at::empty({t, hidden_}, x.options());
      a.topk_idx = topk_idx.data_ptr();
      a.topk_weights = topk_weights.data_ptr<float>();
      a.num_tokens = t;
      a.idx_type = wide ? idx_int64_ : idx_int32_;
    } catch (const c10::Error&) {
      return py::none();
    }
    a.y = y.data_ptr();
    a.expert_counts = reinterpret_cast<int32_t*>(static_cast<uintptr_t>(counts));
    a.expert_counts_total = reinterpret_cast<int64_t*>(static_cast<uintptr_t>(totals));
    a.stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
    a.path = int32_t(path);
    int status;
    {
      // As ctypes does for the Python path: other Python threads run during the launches.
      py::gil_scoped_release unlocked;
      status = fn_(reinterpret_cast<void*>(static_cast<uintptr_t>(layer)), &a);
    }
    return py::make_tuple(y, status);
  }

 private:
  ForwardFn fn_;
  int64_t device_, hidden_, topk_, t_max_;
  int32_t idx_int32_, idx_int64_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("ARGS_BYTES") = py::int_(sizeof(ForwardArgs));
  py::class_<FastForward>(m, "FastForward")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>())
      .def("__call__", &FastForward::call);
}
