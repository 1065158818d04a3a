// oneDNN's 2-D convolutions as XLA FFI handlers for pfljax.models.onednn: the forward product,
// the input gradient and the kernel gradient, float32, input/output NHWC, kernel HWIO.
//
// Each handler takes the window as one int64 attribute, "window" = (stride_h, stride_w,
// pad_top, pad_bottom, pad_left, pad_right), and reads every size from its buffers. A primitive
// is created once per (kind, sizes, window) and kept; oneDNN picks its kernel layout (blocked
// on AVX-512), into or out of which the HWIO kernel is reordered at each call. Scratchpads and
// reordered kernels live in per-thread buffers, so calls from several XLA threads never share
// memory. With several XLA CPU devices in one process (each running its clients at the same
// time), PfljaxOnednnSetThreads gives each call its share of the cores: without it every call
// would start a team of as many OpenMP threads as there are cores. Builds against oneDNN 2.x
// and 3.x (OpenMP threading, as Debian's libdnnl).
#include <omp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using Tag = dnnl::memory::format_tag;

namespace {

enum class Kind : char { kForward = 'f', kInputGrad = 'd', kKernelGrad = 'w' };

// OpenMP threads per oneDNN call (0: OpenMP's default).
std::atomic<int> threads_per_call{0};

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// Sizes of one convolution: input [n, h, w, ci], kernel [kh, kw, ci, co], output [n, oh, ow, co].
struct Geometry {
  int64_t n, h, w, ci, kh, kw, co, oh, ow, sh, sw, pt, pb, pl, pr;

  std::string Key(Kind kind) const {
    std::string key(1, static_cast<char>(kind));
    for (int64_t v : {n, h, w, ci, kh, kw, co, oh, ow, sh, sw, pt, pb, pl, pr}) key += "," + std::to_string(v);
    return key;
  }
  memory::desc Input() const { return memory::desc({n, ci, h, w}, memory::data_type::f32, Tag::nhwc); }
  memory::desc Output() const { return memory::desc({n, co, oh, ow}, memory::data_type::f32, Tag::nhwc); }
  memory::desc Kernel(Tag tag = Tag::hwio) const {
    return memory::desc({co, ci, kh, kw}, memory::data_type::f32, tag);
  }
  memory::dims Strides() const { return {sh, sw}; }
  memory::dims PadBefore() const { return {pt, pl}; }
  memory::dims PadAfter() const { return {pb, pr}; }
};

// A primitive, its kernel layout, and the reorder between that layout and HWIO.
struct Plan {
  dnnl::primitive primitive;
  memory::desc kernel;
  memory::desc scratchpad;
  bool reorder = false;
  dnnl::reorder to_primitive, from_primitive;
};

dnnl::primitive_attr UserScratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

dnnl::convolution_forward::primitive_desc ForwardPd(const Geometry& g) {
#if DNNL_VERSION_MAJOR >= 3
  return dnnl::convolution_forward::primitive_desc(
      Engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, g.Input(),
      g.Kernel(Tag::any), g.Output(), g.Strides(), g.PadBefore(), g.PadAfter(), UserScratchpad());
#else
  dnnl::convolution_forward::desc desc(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
                                       g.Input(), g.Kernel(Tag::any), g.Output(), g.Strides(), g.PadBefore(),
                                       g.PadAfter());
  return dnnl::convolution_forward::primitive_desc(desc, UserScratchpad(), Engine());
#endif
}

std::shared_ptr<Plan> MakePlan(Kind kind, const Geometry& g) {
  auto plan = std::make_shared<Plan>();
  auto forward = ForwardPd(g);
  if (kind == Kind::kForward) {
    plan->primitive = dnnl::convolution_forward(forward);
    plan->kernel = forward.weights_desc();
    plan->scratchpad = forward.scratchpad_desc();
  } else if (kind == Kind::kInputGrad) {
#if DNNL_VERSION_MAJOR >= 3
    dnnl::convolution_backward_data::primitive_desc pd(Engine(), dnnl::algorithm::convolution_direct, g.Input(),
                                                       g.Kernel(Tag::any), g.Output(), g.Strides(),
                                                       g.PadBefore(), g.PadAfter(), forward, UserScratchpad());
#else
    dnnl::convolution_backward_data::desc desc(dnnl::algorithm::convolution_direct, g.Input(), g.Kernel(Tag::any),
                                               g.Output(), g.Strides(), g.PadBefore(), g.PadAfter());
    dnnl::convolution_backward_data::primitive_desc pd(desc, UserScratchpad(), Engine(), forward);
#endif
    plan->primitive = dnnl::convolution_backward_data(pd);
    plan->kernel = pd.weights_desc();
    plan->scratchpad = pd.scratchpad_desc();
  } else {
#if DNNL_VERSION_MAJOR >= 3
    dnnl::convolution_backward_weights::primitive_desc pd(
        Engine(), dnnl::algorithm::convolution_direct, g.Input(), g.Kernel(Tag::any), g.Output(), g.Strides(),
        g.PadBefore(), g.PadAfter(), forward, UserScratchpad());
#else
    dnnl::convolution_backward_weights::desc desc(dnnl::algorithm::convolution_direct, g.Input(),
                                                  g.Kernel(Tag::any), g.Output(), g.Strides(), g.PadBefore(),
                                                  g.PadAfter());
    dnnl::convolution_backward_weights::primitive_desc pd(desc, UserScratchpad(), Engine(), forward);
#endif
    plan->primitive = dnnl::convolution_backward_weights(pd);
    plan->kernel = pd.diff_weights_desc();
    plan->scratchpad = pd.scratchpad_desc();
  }
  plan->reorder = plan->kernel != g.Kernel();
  if (plan->reorder) {
    memory hwio(g.Kernel(), Engine(), DNNL_MEMORY_NONE), blocked(plan->kernel, Engine(), DNNL_MEMORY_NONE);
    plan->to_primitive = dnnl::reorder(hwio, blocked);
    plan->from_primitive = dnnl::reorder(blocked, hwio);
  }
  return plan;
}

std::shared_ptr<Plan> GetPlan(Kind kind, const Geometry& g) {
  static std::mutex mutex;
  static auto* plans = new std::unordered_map<std::string, std::shared_ptr<Plan>>();
  std::string key = g.Key(kind);
  std::lock_guard<std::mutex> lock(mutex);
  auto found = plans->find(key);
  if (found != plans->end()) return found->second;
  auto plan = MakePlan(kind, g);
  plans->emplace(key, plan);
  return plan;
}

// Per-thread memory of at least `desc`'s size (index 0: the reordered kernel, 1: the scratchpad).
memory Buffer(int index, const memory::desc& desc) {
  thread_local std::vector<char> buffers[2];
  auto& buffer = buffers[index];
  if (buffer.size() < desc.get_size()) buffer.resize(desc.get_size());
  return memory(desc, Engine(), buffer.data());
}

// Runs one convolution product. `input`, `kernel` and `output` are the NHWC input (or its
// gradient), the HWIO kernel (or its gradient) and the NHWC output (or its gradient).
ffi::Error Run(Kind kind, const Geometry& g, float* input, float* kernel, float* output) {
  try {
    int threads = threads_per_call.load();
    if (threads > 0 && omp_get_max_threads() != threads) omp_set_num_threads(threads);
    auto plan = GetPlan(kind, g);
    thread_local dnnl::stream stream(Engine());
    memory x(g.Input(), Engine(), input), y(g.Output(), Engine(), output), hwio(g.Kernel(), Engine(), kernel);
    memory k = plan->reorder ? Buffer(0, plan->kernel) : hwio;
    memory scratchpad = Buffer(1, plan->scratchpad);
    if (kind == Kind::kForward) {
      if (plan->reorder) plan->to_primitive.execute(stream, hwio, k);
      plan->primitive.execute(stream, {{DNNL_ARG_SRC, x},
                                       {DNNL_ARG_WEIGHTS, k},
                                       {DNNL_ARG_DST, y},
                                       {DNNL_ARG_SCRATCHPAD, scratchpad}});
    } else if (kind == Kind::kInputGrad) {
      if (plan->reorder) plan->to_primitive.execute(stream, hwio, k);
      plan->primitive.execute(stream, {{DNNL_ARG_DIFF_SRC, x},
                                       {DNNL_ARG_WEIGHTS, k},
                                       {DNNL_ARG_DIFF_DST, y},
                                       {DNNL_ARG_SCRATCHPAD, scratchpad}});
    } else {
      plan->primitive.execute(stream, {{DNNL_ARG_SRC, x},
                                       {DNNL_ARG_DIFF_WEIGHTS, k},
                                       {DNNL_ARG_DIFF_DST, y},
                                       {DNNL_ARG_SCRATCHPAD, scratchpad}});
      if (plan->reorder) plan->from_primitive.execute(stream, k, hwio);
    }
    stream.wait();
  } catch (const dnnl::error& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("oneDNN convolution: ") + e.what());
  }
  return ffi::Error::Success();
}

using F32 = ffi::Buffer<ffi::F32>;
using F32Result = ffi::ResultBuffer<ffi::F32>;
using Window = ffi::Span<const int64_t>;

Geometry MakeGeometry(ffi::Span<const int64_t> x, ffi::Span<const int64_t> k, ffi::Span<const int64_t> y,
                      Window window) {
  return Geometry{x[0],      x[1],      x[2],      x[3],      k[0],      k[1],      k[3],     y[1],
                  y[2],      window[0], window[1], window[2], window[3], window[4], window[5]};
}

ffi::Error Forward(F32 x, F32 k, F32Result y, Window window) {
  auto g = MakeGeometry(x.dimensions(), k.dimensions(), y->dimensions(), window);
  return Run(Kind::kForward, g, x.typed_data(), k.typed_data(), y->typed_data());
}

ffi::Error InputGrad(F32 dy, F32 k, F32Result dx, Window window) {
  auto g = MakeGeometry(dx->dimensions(), k.dimensions(), dy.dimensions(), window);
  return Run(Kind::kInputGrad, g, dx->typed_data(), k.typed_data(), dy.typed_data());
}

ffi::Error KernelGrad(F32 x, F32 dy, F32Result dk, Window window) {
  auto g = MakeGeometry(x.dimensions(), dk->dimensions(), dy.dimensions(), window);
  return Run(Kind::kKernelGrad, g, x.typed_data(), dk->typed_data(), dy.typed_data());
}

}  // namespace

extern "C" void PfljaxOnednnSetThreads(int threads) { threads_per_call.store(threads); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(PfljaxConvForward, Forward,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Ret<F32>().Attr<Window>("window"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PfljaxConvInputGrad, InputGrad,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Ret<F32>().Attr<Window>("window"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PfljaxConvKernelGrad, KernelGrad,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Ret<F32>().Attr<Window>("window"));
