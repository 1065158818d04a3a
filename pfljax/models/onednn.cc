// oneDNN's primitives as XLA FFI handlers for pfljax.models.onednn, float32:
// - 2-D convolutions: the forward product, the input gradient and the kernel gradient,
//   input/output NHWC, kernel HWIO;
// - an LSTM layer from zero state (oneDNN's "vanilla LSTM", gates i, f, g, o): inference,
//   training forward (with oneDNN's workspace as a uint8 output) and backward.
//
// Each convolution handler takes the window as one int64 attribute, "window" = (stride_h, stride_w,
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
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
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

// The plan of `kind` for geometry `g`, made by `make(kind, g)` once per process and kept.
template <typename Kind_, typename Geometry_, typename Make>
auto CachedPlan(Kind_ kind, const Geometry_& g, Make make) -> decltype(make(kind, g)) {
  static std::mutex mutex;
  static auto* plans = new std::unordered_map<std::string, decltype(make(kind, g))>();
  std::string key = g.Key(kind);
  std::lock_guard<std::mutex> lock(mutex);
  auto found = plans->find(key);
  if (found != plans->end()) return found->second;
  auto plan = make(kind, g);
  plans->emplace(key, plan);
  return plan;
}

std::shared_ptr<Plan> GetPlan(Kind kind, const Geometry& g) { return CachedPlan(kind, g, MakePlan); }

// Per-thread memory of at least `desc`'s size (index 0: the reordered kernel or input weights,
// 1: the scratchpad; the LSTM's 2: reordered recurrent weights, 3: zero state, 4 and 5: the
// state gradients at the start, which are not returned).
memory Buffer(int index, const memory::desc& desc) {
  thread_local std::vector<char> buffers[6];
  auto& buffer = buffers[index];
  if (buffer.size() < desc.get_size()) buffer.resize(desc.get_size());
  return memory(desc, Engine(), buffer.data());
}

// The calling thread's OpenMP threads: this call's share of the cores.
void ShareCores() {
  int threads = threads_per_call.load();
  if (threads > 0 && omp_get_max_threads() != threads) omp_set_num_threads(threads);
}

// Runs one convolution product. `input`, `kernel` and `output` are the NHWC input (or its
// gradient), the HWIO kernel (or its gradient) and the NHWC output (or its gradient).
ffi::Error Run(Kind kind, const Geometry& g, float* input, float* kernel, float* output) {
  try {
    ShareCores();
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


// ---------------------------------------------------------------- LSTM

// A thread of this library's own that runs oneDNN calls for XLA's threads. An LSTM call is
// thousands of short OpenMP regions (a few per time step); called from whichever XLA thread runs
// the custom call, every new calling thread starts a team of its own while the last caller's team
// still spins, and the cores are oversubscribed (a layer's gradient took 10-33 ms instead of 7).
// Run on one of these threads, the same team serves every call. A caller takes the first idle
// worker (one per concurrent caller: several CPU devices run their clients at the same time);
// with one thread a call there is no team, and the call runs on the caller's thread.
class Worker {
 public:
  Worker() : thread_([this] { Loop(); }) { thread_.detach(); }

  bool TryAcquire() { return !busy_.exchange(true); }

  void Run(const std::function<void()>& job) {
    std::unique_lock<std::mutex> lock(mutex_);
    job_ = &job;
    done_ = false;
    wake_.notify_one();
    finished_.wait(lock, [this] { return done_; });
    job_ = nullptr;
    busy_.store(false);
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return job_ != nullptr && !done_; });
      lock.unlock();
      (*job_)();
      lock.lock();
      done_ = true;
      finished_.notify_one();
    }
  }

  std::atomic<bool> busy_{false};
  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  const std::function<void()>* job_ = nullptr;
  bool done_ = true;
  std::thread thread_;
};

void RunOnWorker(const std::function<void()>& job) {
  if (threads_per_call.load() == 1) {  // no team to keep: run on the caller's thread
    job();
    return;
  }
  static std::mutex mutex;
  static auto* workers = new std::vector<std::unique_ptr<Worker>>();
  Worker* worker = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& candidate : *workers) {
      if (candidate->TryAcquire()) {
        worker = candidate.get();
        break;
      }
    }
    if (worker == nullptr) {
      workers->push_back(std::make_unique<Worker>());
      worker = workers->back().get();
      worker->TryAcquire();
    }
  }
  worker->Run(job);
}

enum class LstmKind : char { kInference = 'i', kTraining = 't', kBackward = 'b' };

// Sizes of one LSTM layer: inputs [t, n, i] (time-major), hidden states [t, n, h].
struct LstmGeometry {
  int64_t t, n, i, h;

  std::string Key(LstmKind kind) const {
    std::string key(1, static_cast<char>(kind));
    for (int64_t v : {t, n, i, h}) key += "," + std::to_string(v);
    return key;
  }
  memory::desc Input() const { return memory::desc({t, n, i}, memory::data_type::f32, Tag::tnc); }
  memory::desc Output() const { return memory::desc({t, n, h}, memory::data_type::f32, Tag::tnc); }
  // [in, 4H] as [layers, directions, in, gates, H]; `tag` any lets oneDNN pick its layout.
  memory::desc Weights(int64_t in, Tag tag = Tag::ldigo) const {
    return memory::desc({1, 1, in, 4, h}, memory::data_type::f32, tag);
  }
  memory::desc Bias() const { return memory::desc({1, 1, 4, h}, memory::data_type::f32, Tag::ldgo); }
  memory::desc State() const { return memory::desc({1, 1, n, h}, memory::data_type::f32, Tag::ldnc); }
};

// A primitive, its weight layouts, the reorders into them, and its workspace.
struct LstmPlan {
  dnnl::primitive primitive;
  memory::desc input_weights, recurrent_weights, scratchpad, workspace;
  bool reorder_input = false, reorder_recurrent = false;
  dnnl::reorder to_input, to_recurrent;
};

// The states at the end and their gradients are not used: zero memory descriptors. The states at
// the start are given as zeros (with oneDNN 2.6, a zero descriptor there made the backward pass
// read wrong previous states into the recurrent kernel's gradient).
const memory::desc kNone;

dnnl::lstm_forward::primitive_desc LstmForwardPd(const LstmGeometry& g, dnnl::prop_kind prop) {
#if DNNL_VERSION_MAJOR >= 3
  return dnnl::lstm_forward::primitive_desc(Engine(), prop, dnnl::rnn_direction::unidirectional_left2right,
                                            g.Input(), g.State(), g.State(), g.Weights(g.i, Tag::any),
                                            g.Weights(g.h, Tag::any), g.Bias(), g.Output(), kNone, kNone,
                                            UserScratchpad());
#else
  dnnl::lstm_forward::desc desc(prop, dnnl::rnn_direction::unidirectional_left2right, g.Input(), g.State(),
                                g.State(), g.Weights(g.i, Tag::any), g.Weights(g.h, Tag::any), g.Bias(),
                                g.Output(), kNone, kNone);
  return dnnl::lstm_forward::primitive_desc(desc, UserScratchpad(), Engine());
#endif
}

template <typename Pd>
void SetWeights(LstmPlan& plan, const LstmGeometry& g, const Pd& pd) {
  plan.input_weights = pd.weights_layer_desc();
  plan.recurrent_weights = pd.weights_iter_desc();
  plan.scratchpad = pd.scratchpad_desc();
  plan.reorder_input = plan.input_weights != g.Weights(g.i);
  plan.reorder_recurrent = plan.recurrent_weights != g.Weights(g.h);
  if (plan.reorder_input) {
    memory plain(g.Weights(g.i), Engine(), DNNL_MEMORY_NONE), own(plan.input_weights, Engine(), DNNL_MEMORY_NONE);
    plan.to_input = dnnl::reorder(plain, own);
  }
  if (plan.reorder_recurrent) {
    memory plain(g.Weights(g.h), Engine(), DNNL_MEMORY_NONE), own(plan.recurrent_weights, Engine(), DNNL_MEMORY_NONE);
    plan.to_recurrent = dnnl::reorder(plain, own);
  }
}

std::shared_ptr<LstmPlan> MakeLstmPlan(LstmKind kind, const LstmGeometry& g) {
  auto plan = std::make_shared<LstmPlan>();
  if (kind == LstmKind::kInference) {
    auto pd = LstmForwardPd(g, dnnl::prop_kind::forward_inference);
    plan->primitive = dnnl::lstm_forward(pd);
    SetWeights(*plan, g, pd);
    return plan;
  }
  auto forward = LstmForwardPd(g, dnnl::prop_kind::forward_training);
  plan->workspace = forward.workspace_desc();
  if (kind == LstmKind::kTraining) {
    plan->primitive = dnnl::lstm_forward(forward);
    SetWeights(*plan, g, forward);
    return plan;
  }
  // The weight gradients in the plain layouts of the weights (oneDNN adds into them).
#if DNNL_VERSION_MAJOR >= 3
  dnnl::lstm_backward::primitive_desc pd(
      Engine(), dnnl::prop_kind::backward, dnnl::rnn_direction::unidirectional_left2right, g.Input(), g.State(),
      g.State(), g.Weights(g.i, Tag::any), g.Weights(g.h, Tag::any), g.Bias(), g.Output(), kNone, kNone,
      g.Input(), g.State(), g.State(), g.Weights(g.i), g.Weights(g.h), g.Bias(), g.Output(), kNone, kNone,
      forward, UserScratchpad());
#else
  dnnl::lstm_backward::desc desc(dnnl::prop_kind::backward, dnnl::rnn_direction::unidirectional_left2right,
                                 g.Input(), g.State(), g.State(), g.Weights(g.i, Tag::any),
                                 g.Weights(g.h, Tag::any), g.Bias(), g.Output(), kNone, kNone, g.Input(), g.State(),
                                 g.State(), g.Weights(g.i), g.Weights(g.h), g.Bias(), g.Output(), kNone, kNone);
  dnnl::lstm_backward::primitive_desc pd(desc, UserScratchpad(), Engine(), forward);
#endif
  plan->primitive = dnnl::lstm_backward(pd);
  SetWeights(*plan, g, pd);
  return plan;
}

std::shared_ptr<LstmPlan> GetLstmPlan(LstmKind kind, const LstmGeometry& g) {
  return CachedPlan(kind, g, MakeLstmPlan);
}

using U8 = ffi::Buffer<ffi::U8>;
using U8Result = ffi::ResultBuffer<ffi::U8>;

LstmGeometry MakeLstmGeometry(ffi::Span<const int64_t> x, ffi::Span<const int64_t> wh) {
  return LstmGeometry{x[0], x[1], x[2], wh[0]};
}

// The user's weights in the plan's layouts (per-thread copies where they differ).
std::unordered_map<int, memory> WeightArgs(const LstmPlan& plan, const LstmGeometry& g, dnnl::stream& stream,
                                           float* wi, float* wh) {
  memory input(g.Weights(g.i), Engine(), wi), recurrent(g.Weights(g.h), Engine(), wh);
  memory own_input = plan.reorder_input ? Buffer(0, plan.input_weights) : input;
  memory own_recurrent = plan.reorder_recurrent ? Buffer(2, plan.recurrent_weights) : recurrent;
  if (plan.reorder_input) plan.to_input.execute(stream, input, own_input);
  if (plan.reorder_recurrent) plan.to_recurrent.execute(stream, recurrent, own_recurrent);
  return {{DNNL_ARG_WEIGHTS_LAYER, own_input},
          {DNNL_ARG_WEIGHTS_ITER, own_recurrent},
          {DNNL_ARG_SCRATCHPAD, Buffer(1, plan.scratchpad)}};
}

ffi::Error RunLstm(LstmKind kind, F32 x, F32 wi, F32 wh, F32 bias, float* hs, uint8_t* workspace,
                   F32* dhs = nullptr, float* dx = nullptr, float* dwi = nullptr, float* dwh = nullptr,
                   float* dbias = nullptr) {
  std::string failure;
  RunOnWorker([&] {
  try {
    ShareCores();
    auto g = MakeLstmGeometry(x.dimensions(), wh.dimensions());
    auto plan = GetLstmPlan(kind, g);
    thread_local dnnl::stream stream(Engine());
    auto args = WeightArgs(*plan, g, stream, wi.typed_data(), wh.typed_data());
    args[DNNL_ARG_SRC_LAYER] = memory(g.Input(), Engine(), x.typed_data());
    args[DNNL_ARG_BIAS] = memory(g.Bias(), Engine(), bias.typed_data());
    args[DNNL_ARG_DST_LAYER] = memory(g.Output(), Engine(), hs);
    memory zero = Buffer(3, g.State());
    std::fill_n(static_cast<float*>(zero.get_data_handle()), g.n * g.h, 0.0f);
    args[DNNL_ARG_SRC_ITER] = zero;
    args[DNNL_ARG_SRC_ITER_C] = zero;
    if (kind != LstmKind::kInference) args[DNNL_ARG_WORKSPACE] = memory(plan->workspace, Engine(), workspace);
    if (kind == LstmKind::kBackward) {
      // oneDNN adds the weight gradients into their outputs.
      std::fill(dwi, dwi + g.i * 4 * g.h, 0.0f);
      std::fill(dwh, dwh + g.h * 4 * g.h, 0.0f);
      std::fill(dbias, dbias + 4 * g.h, 0.0f);
      args[DNNL_ARG_DIFF_DST_LAYER] = memory(g.Output(), Engine(), dhs->typed_data());
      args[DNNL_ARG_DIFF_SRC_LAYER] = memory(g.Input(), Engine(), dx);
      args[DNNL_ARG_DIFF_WEIGHTS_LAYER] = memory(g.Weights(g.i), Engine(), dwi);
      args[DNNL_ARG_DIFF_WEIGHTS_ITER] = memory(g.Weights(g.h), Engine(), dwh);
      args[DNNL_ARG_DIFF_BIAS] = memory(g.Bias(), Engine(), dbias);
      args[DNNL_ARG_DIFF_SRC_ITER] = Buffer(4, g.State());
      args[DNNL_ARG_DIFF_SRC_ITER_C] = Buffer(5, g.State());
    }
    plan->primitive.execute(stream, args);
    stream.wait();
  } catch (const std::exception& e) {  // oneDNN's errors, and allocation failures on the worker
    failure = e.what();
  }
  });
  if (!failure.empty()) return ffi::Error(ffi::ErrorCode::kInternal, "oneDNN LSTM: " + failure);
  return ffi::Error::Success();
}

ffi::Error LstmInference(F32 x, F32 wi, F32 wh, F32 bias, F32Result hs) {
  return RunLstm(LstmKind::kInference, x, wi, wh, bias, hs->typed_data(), nullptr);
}

ffi::Error LstmTraining(F32 x, F32 wi, F32 wh, F32 bias, F32Result hs, U8Result workspace) {
  return RunLstm(LstmKind::kTraining, x, wi, wh, bias, hs->typed_data(), workspace->typed_data());
}

ffi::Error LstmBackward(F32 x, F32 wi, F32 wh, F32 bias, F32 hs, U8 workspace, F32 dhs, F32Result dx,
                        F32Result dwi, F32Result dwh, F32Result dbias) {
  return RunLstm(LstmKind::kBackward, x, wi, wh, bias, hs.typed_data(), workspace.typed_data(), &dhs,
                 dx->typed_data(), dwi->typed_data(), dwh->typed_data(), dbias->typed_data());
}

}  // namespace

// The bytes of oneDNN's training workspace for one layer (-1 where oneDNN refuses the sizes).
extern "C" int64_t PfljaxLstmWorkspaceBytes(int64_t steps, int64_t batch, int64_t width, int64_t hidden) {
  try {
    ShareCores();  // oneDNN sizes a primitive's work for the calling thread's OpenMP threads
    return static_cast<int64_t>(
        GetLstmPlan(LstmKind::kTraining, LstmGeometry{steps, batch, width, hidden})->workspace.get_size());
  } catch (const dnnl::error&) {
    return -1;
  }
}

extern "C" void PfljaxOnednnSetThreads(int threads) { threads_per_call.store(threads); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(PfljaxConvForward, Forward,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Ret<F32>().Attr<Window>("window"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PfljaxConvInputGrad, InputGrad,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Ret<F32>().Attr<Window>("window"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PfljaxConvKernelGrad, KernelGrad,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Ret<F32>().Attr<Window>("window"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PfljaxLstmInference, LstmInference,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Ret<F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(PfljaxLstmTraining, LstmTraining,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Ret<F32>().Ret<U8>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(PfljaxLstmBackward, LstmBackward,
                              ffi::Ffi::Bind()
                                  .Arg<F32>()
                                  .Arg<F32>()
                                  .Arg<F32>()
                                  .Arg<F32>()
                                  .Arg<F32>()
                                  .Arg<U8>()
                                  .Arg<F32>()
                                  .Ret<F32>()
                                  .Ret<F32>()
                                  .Ret<F32>()
                                  .Ret<F32>());
