// A DDP communication hook in C++: average a bucket with one allreduce, optionally in a lower
// precision. DDP's reducer calls it without entering Python, as it does its built-in hooks.
//
// The arithmetic comes from Python, once per (dtype, device): a callable gives the divisor to
// apply before the sum, the reduce op, and the dtype to send in (None: in place). A bucket this
// hook does not handle (sparse gradients; DDP buckets complex ones as their real view) goes to the
// Python hook it stands for.
//
// A bucket sent in fp16/bf16 is cast, then divided in the sent dtype (torch's hooks' order, so the
// sum is bit-identical to theirs). Where DDP was built with gradient_as_bucket_view=True (.grad
// views the bucket) and the bucket is on a GPU, a plain hook sending fp16/bf16 casts, sends and
// casts back into the bucket on a side stream, and DDP then copies nothing: no work at all on the
// backward stream.
//
// A hook may also be registered switched off, with a callable for its last bucket: it then runs
// the Python hook for every bucket until Python switches it on. Switched on, it averages every
// bucket itself and, at the last one, waits for them all (a stream wait on CUDA: on the stream that
// Python names, so that DDP's own copies of the buckets into .grad still follow each bucket's
// collective on the backward stream) and hands their indices and averaged buffers to that
// callable: one Python call per backward pass instead of one per bucket (ZeRO overlap's fused step).
//
// A scatter hook (ZeRO overlap with reduce_scatter=True) is registered the same way, switched off.
// Python gives it, once DDP has settled its buckets, where each bucket's gradients go: runs of the
// bucket copied, divided by the group size, into the send buffers of the shards, and how many
// parameters complete each shard. Switched on, it fills the shards from every bucket, starts each
// shard's reduce-scatter (a SUM) once its last parameter has arrived, hands DDP its bucket back
// unchanged, and at the last bucket waits for every reduce-scatter (on Python's stream) and gives
// Python the shards in the order they were sent: one Python call per backward pass.
#include <torch/extension.h>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// The scatter hook's division into its send buffers, as dcomm.core.divide_into does it for ZeRO's
// Python path. Whether a division into another dtype can be one kernel: from fp32/fp64 the quotient
// is computed in the input's dtype, then cast. From fp16/bf16 it would be rounded to the input's
// precision first (a bf16 gradient sent in fp16 kept bf16's 8 bits), so there the division follows
// the cast, in the sent dtype, as torch's hooks and dcomm.core.divide_into do.
bool isWide(const at::Tensor& tensor) {
  return tensor.scalar_type() == at::kFloat || tensor.scalar_type() == at::kDouble;
}

// out = source / divisor in out's dtype (divisor: a wrapped-number tensor, as Python passes it).
void divideInto(at::Tensor& out, const at::Tensor& source, const at::Tensor& divisor) {
  if (isWide(source)) {
    at::div_out(out, source, divisor);  // cast and divide: one kernel
  } else {
    out.copy_(source).div_(divisor);  // torch's order (see isWide)
  }
}

struct Plan {
  double divisor;  // applied before the sum; 1 means none
  at::Tensor divisor_as_tensor;  // the same number, as Python passes it to an out= division
  c10d::ReduceOp op;
  std::optional<at::ScalarType> wire;  // the dtype sent, when it differs from the bucket's
};

// Whether a hook averages buckets itself (on) or passes them all to its Python hook (off), and
// the stream that waits for every bucket at the last one (none: the current stream).
// ``bytes_sent`` counts what the hook's allreduces sent while on, as a ring allreduce sends them
// (``2 (world - 1) / world`` of each tensor), for states that report their bytes.
struct Switch {
  std::atomic<bool> on{true};
  std::atomic<bool> hand_over{true};  // whether the last bucket calls Python (when there is a callable)
  std::optional<c10::Stream> waiting;
  std::atomic<int64_t> bytes_sent{0};
};

// Where one bucket's gradients go: ``runs`` of (bucket offset, send-buffer offset, elements) into
// the send buffer of shard ``shard``, which gets ``count`` of its parameters from this bucket.
struct Piece {
  int64_t shard;
  int64_t count;
  std::vector<std::tuple<int64_t, int64_t, int64_t>> runs;
};

struct Shard {
  at::Tensor send;  // the gradients divided by the group size, laid out as the shard's flat buffer
  at::Tensor recv;  // this rank's slice of their sum
  int64_t params;   // parameters that complete it
  int64_t seen = 0;
};

// A scatter hook's switch, with the layout Python sets once DDP has settled its buckets.
struct ScatterSwitch : Switch {
  int64_t world = 1;
  std::vector<Shard> shards;
  std::vector<std::vector<Piece>> buckets;  // by bucket index
};

struct Launched {
  int64_t index;
  at::Tensor averaged;
  c10::intrusive_ptr<c10::ivalue::Future> future;
};

// One reduce-scatter of a flat tensor into this rank's slice: ``reduce_scatter_single`` where torch
// has it (2.13 on), else ``_reduce_scatter_base``, which 2.13 deprecates (the int argument prefers
// the first overload where both compile).
template <typename Group>
auto reduceScatterSingle(Group& group, at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& options,
                         int) -> decltype(group.reduce_scatter_single(output, input, options)) {
  return group.reduce_scatter_single(output, input, options);
}

template <typename Group>
c10::intrusive_ptr<c10d::Work> reduceScatterSingle(Group& group, at::Tensor& output, at::Tensor& input,
                                                   const c10d::ReduceScatterOptions& options, long) {
  return group._reduce_scatter_base(output, input, options);
}

// What both hooks share: the process group, the Python hook they run while switched off (and for
// buckets they do not handle), and the Python callable they hand the last bucket to.
class SwitchedHook : public c10d::CommHookInterface {
 public:
  SwitchedHook(c10::intrusive_ptr<c10d::ProcessGroup> group, py::object state, py::object python_hook,
               py::object at_last)
      : group_(std::move(group)), at_last_(std::move(at_last)), python_(std::move(state), std::move(python_hook)) {}

  ~SwitchedHook() override {
    py::gil_scoped_acquire gil;
    at_last_ = py::object();
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isPyObject()) {
      return python_.parseHookResult(result);
    }
    return c10d::detail::parseCppCommHookResult(result);
  }

 protected:
  // Run ``wait`` with the switch's waiting stream current (CUDA), where Python named one: what it
  // waits for orders that stream, not the backward pass's.
  template <typename Wait>
  static void onWaitingStream(const Switch& native, Wait&& wait) {
    std::optional<c10::StreamGuard> on_waiting;
    if (native.waiting.has_value()) {
      on_waiting.emplace(*native.waiting);
    }
    wait();
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  py::object at_last_;  // None for a plain averaging hook
  c10d::PythonCommHook python_;
};

class AverageHook final : public SwitchedHook {
 public:
  AverageHook(c10::intrusive_ptr<c10d::ProcessGroup> group, py::object plan_for, py::object state,
              py::object python_hook, py::object at_last, std::shared_ptr<Switch> native)
      : SwitchedHook(std::move(group), std::move(state), std::move(python_hook), std::move(at_last)),
        plan_for_(std::move(plan_for)),
        native_(std::move(native)) {}

  ~AverageHook() override {
    py::gil_scoped_acquire gil;
    plan_for_ = py::object();
  }

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    const at::Tensor& buffer = bucket.getBufferRef();
    if (!native_->on.load() || buffer.is_sparse() || !buffer.is_floating_point()) {
      return python_.runHook(bucket);
    }
    at::Tensor sent;
    auto future = average(bucket, buffer, sent);
    if (!at_last_.is_none() && native_->hand_over.load()) {
      if (bucket.getIndex() == 0) {
        launched_.clear();  // what an interrupted backward pass left
      }
      launched_.push_back({static_cast<int64_t>(bucket.getIndex()), sent, future});
      if (bucket.isLast()) {
        handOver();
      }
    }
    return future;
  }

 private:
  // Launch the bucket's average; ``sent`` is the tensor the collective writes.
  c10::intrusive_ptr<c10::ivalue::Future> average(c10d::GradBucket& bucket, const at::Tensor& buffer,
                                                  at::Tensor& sent) {
    const Plan& plan = planFor(buffer);
    sent = buffer;
    if (plan.wire.has_value()) {
      sent = lowPrecisionCopy(bucket.getIndex(), buffer, *plan.wire);
      if (at_last_.is_none() && buffer.device().type() != at::kCPU && gradientsAreViewsOf(bucket, buffer)) {
        return averageAside(bucket.getIndex(), buffer, sent, plan);
      }
      castInto(sent, buffer, plan);
    } else if (plan.divisor != 1.0) {
      sent.div_(plan.divisor);
    }
    return launch(sent, plan);
  }

  // DDP built with gradient_as_bucket_view=True: .grad is a view of the bucket, so when the hook
  // returns the bucket itself DDP copies nothing after it (a low-precision sum instead makes DDP
  // convert it into .grad parameter by parameter, on the backward stream, at the end of backward).
  static bool gradientsAreViewsOf(const c10d::GradBucket& bucket, const at::Tensor& buffer) {
    const auto parameters = bucket.getParameters();
    if (parameters.empty()) {
      return false;
    }
    const at::Tensor& grad = parameters.front().grad();
    return grad.defined() && grad.is_alias_of(buffer);
  }

  // The cast, the collective and the cast back into DDP's bucket, all ordered on a side stream:
  // the backward stream only records that the bucket is full and goes on. The returned future
  // completes on the side stream, so DDP's wait for it orders the backward stream after the cast
  // back. Why this path exists and what it was measured to give: docs/design/native-hooks.md.
  c10::intrusive_ptr<c10::ivalue::Future> averageAside(size_t index, const at::Tensor& buffer, at::Tensor& sent,
                                                       const Plan& plan) {
    c10::impl::VirtualGuardImpl device(buffer.device().type());
    c10::Event& full = bucketFull(index, buffer.device().type());
    full.record(device.getStream(buffer.device()));
    c10::Stream aside = asideStream(device, buffer.device());
    full.block(aside);
    c10::StreamGuard on_aside(aside);
    castInto(sent, buffer, plan);
    auto sum = launch(sent, plan);
    sum->wait();  // the side stream waits for the collective (a stream wait, not the host)
    buffer.copy_(sent);
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(),
                                                         std::vector<c10::Device>{buffer.device()});
    done->markCompleted(c10::IValue(buffer));  // records an event on the side stream
    return done;
  }

  // The cast, then the division in the sent dtype: torch's hooks' arithmetic, bit for bit.
  static void castInto(at::Tensor& sent, const at::Tensor& buffer, const Plan& plan) {
    sent.copy_(buffer);
    if (plan.divisor != 1.0) {
      sent.div_(plan.divisor_as_tensor);
    }
  }

  c10::Event& bucketFull(size_t index, at::DeviceType type) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (full_.size() <= index) {
      full_.push_back(std::make_unique<c10::Event>(type));
    }
    return *full_[index];
  }

  c10::Stream asideStream(const c10::impl::VirtualGuardImpl& device, const at::Device& where) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = aside_.find(where.index());
    if (found == aside_.end()) {
      found = aside_.emplace(where.index(), device.getStreamFromGlobalPool(where)).first;
    }
    return found->second;
  }

  c10::intrusive_ptr<c10::ivalue::Future> launch(at::Tensor& sent, const Plan& plan) {
    const int64_t world = group_->getSize();
    native_->bytes_sent.fetch_add(2 * (world - 1) * static_cast<int64_t>(sent.nbytes()) / world);
    std::vector<at::Tensor> tensors{sent};
    c10d::AllreduceOptions options;
    options.reduceOp = plan.op;
    return group_->allreduce(tensors, options)->getFuture();
  }

  // The last bucket: order the waiting stream (CUDA) or the host (gloo) after every bucket's
  // collective, then give Python the averaged buckets in one call.
  void handOver() {
    std::vector<Launched> launched;
    launched.swap(launched_);
    onWaitingStream(*native_, [&] {
      for (auto& item : launched) {
        item.future->wait();
      }
    });
    py::gil_scoped_acquire gil;
    py::list indices;
    py::list averaged;
    for (auto& item : launched) {
      indices.append(item.index);
      averaged.append(item.averaged);
    }
    at_last_(indices, averaged);
  }

  const Plan& planFor(const at::Tensor& buffer) {
    auto key = std::make_tuple(buffer.scalar_type(), buffer.device().type(), buffer.device().index());
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = plans_.find(key);
    if (found != plans_.end()) {
      return found->second;
    }
    py::gil_scoped_acquire gil;
    py::detail::loader_life_support keep_conversions;  // casts below may make temporaries
    auto answer = plan_for_(buffer.scalar_type(), buffer.device()).cast<py::tuple>();
    py::object op = answer[1];
    double divisor = answer[0].cast<double>();
    at::Tensor divisor_as_tensor = at::scalar_tensor(divisor, at::kDouble);
    divisor_as_tensor.unsafeGetTensorImpl()->set_wrapped_number(true);
    Plan plan{divisor, divisor_as_tensor,
              py::isinstance<c10d::ReduceOp>(op) ? op.cast<c10d::ReduceOp>()
                                                 : c10d::ReduceOp(op.cast<c10d::ReduceOp::RedOpType>()),
              answer[2].cast<std::optional<at::ScalarType>>()};
    return plans_.emplace(key, std::move(plan)).first->second;
  }

  // The bucket's low-precision copy, kept from one backward pass to the next: DDP waits for a
  // bucket's future, and on CUDA orders its stream after it, before it runs the hook on that
  // bucket again.
  at::Tensor& lowPrecisionCopy(size_t index, const at::Tensor& buffer, at::ScalarType dtype) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (low_.size() <= index) {
      low_.resize(index + 1);
    }
    at::Tensor& low = low_[index];
    if (!low.defined() || low.scalar_type() != dtype || low.sizes() != buffer.sizes() ||
        low.device() != buffer.device()) {
      low = at::empty(buffer.sizes(), buffer.options().dtype(dtype));
    }
    return low;
  }

  py::object plan_for_;
  std::shared_ptr<Switch> native_;
  std::vector<Launched> launched_;  // this backward pass's buckets so far (with at_last_ only)
  std::mutex mutex_;
  std::map<std::tuple<at::ScalarType, at::DeviceType, at::DeviceIndex>, Plan> plans_;
  std::vector<at::Tensor> low_;
  std::vector<std::unique_ptr<c10::Event>> full_;  // per bucket: the backward stream has filled it
  std::map<at::DeviceIndex, c10::Stream> aside_;   // the side stream of averageAside, per device
};

class ScatterHook final : public SwitchedHook {
 public:
  ScatterHook(c10::intrusive_ptr<c10d::ProcessGroup> group, py::object state, py::object python_hook,
              py::object at_last, std::shared_ptr<ScatterSwitch> native)
      : SwitchedHook(std::move(group), std::move(state), std::move(python_hook), std::move(at_last)),
        native_(std::move(native)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    auto index = static_cast<size_t>(bucket.getIndex());
    if (!native_->on.load() || index >= native_->buckets.size()) {
      return python_.runHook(bucket);
    }
    if (index == 0) {
      launched_.clear();  // what an interrupted backward pass left
      for (auto& shard : native_->shards) {
        shard.seen = 0;
      }
    }
    const at::Tensor& buffer = bucket.getBufferRef();
    for (const Piece& piece : native_->buckets[index]) {
      Shard& shard = native_->shards[piece.shard];
      fillSend(shard.send, buffer, piece);
      shard.seen += piece.count;
      if (shard.seen == shard.params) {
        shard.seen = 0;
        launched_.push_back({piece.shard, reduceScatter(shard)});
      }
    }
    // DDP gets its bucket back unchanged: .grad keeps this rank's own gradient.
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    future->markCompleted(c10::IValue(buffer));
    if (bucket.isLast()) {
      handOver();
    }
    return future;
  }

 private:
  // send[dst : dst + n] = bucket[src : src + n] / world for each run: the arithmetic of the Python
  // hook (one division into the send buffer for a single run; a copy, then the division in place,
  // for several runs of one dtype).
  void fillSend(at::Tensor& send, const at::Tensor& buffer, const Piece& piece) {
    if (!world_.defined()) {
      world_ = at::scalar_tensor(native_->world, at::kLong);
      world_.unsafeGetTensorImpl()->set_wrapped_number(true);
    }
    if (piece.runs.size() == 1 || buffer.scalar_type() != send.scalar_type()) {
      for (const auto& [src, dst, numel] : piece.runs) {
        at::Tensor target = send.narrow(0, dst, numel);
        divideInto(target, buffer.narrow(0, src, numel), world_);
      }
      return;
    }
    std::vector<at::Tensor> sources;
    std::vector<at::Tensor> targets;
    sources.reserve(piece.runs.size());
    targets.reserve(piece.runs.size());
    for (const auto& [src, dst, numel] : piece.runs) {
      sources.push_back(buffer.narrow(0, src, numel));
      targets.push_back(send.narrow(0, dst, numel));
    }
    at::_foreach_copy_(targets, sources);
    at::_foreach_div_(targets, c10::Scalar(native_->world));
  }

  c10::intrusive_ptr<c10d::Work> reduceScatter(Shard& shard) {
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    return reduceScatterSingle(*group_, shard.recv, shard.send, options, 0);
  }

  // The last bucket: order the waiting stream (CUDA) or the host (gloo) after every shard's
  // reduce-scatter, then give Python the shards in the order they were sent.
  void handOver() {
    std::vector<std::pair<int64_t, c10::intrusive_ptr<c10d::Work>>> launched;
    launched.swap(launched_);
    onWaitingStream(*native_, [&] {
      for (auto& item : launched) {
        item.second->wait();  // a stream wait on CUDA, a host wait on gloo (whose works have no future)
      }
    });
    py::gil_scoped_acquire gil;
    py::list shards;
    for (auto& item : launched) {
      shards.append(item.first);
    }
    at_last_(shards);
  }

  std::shared_ptr<ScatterSwitch> native_;
  std::vector<std::pair<int64_t, c10::intrusive_ptr<c10d::Work>>> launched_;  // (shard, its reduce-scatter)
  at::Tensor world_;  // the group size as Python passes it to an out= division
};

std::shared_ptr<Switch> registerHook(const std::shared_ptr<c10d::Reducer>& reducer,
                                     const c10::intrusive_ptr<c10d::ProcessGroup>& group, py::object plan_for,
                                     py::object state, py::object python_hook, py::object at_last) {
  auto native = std::make_shared<Switch>();
  native->on.store(at_last.is_none());  // with a last-bucket callable, Python switches it on
  reducer->register_comm_hook(std::make_unique<AverageHook>(group, std::move(plan_for), std::move(state),
                                                            std::move(python_hook), std::move(at_last), native));
  return native;
}

std::shared_ptr<ScatterSwitch> registerScatterHook(const std::shared_ptr<c10d::Reducer>& reducer,
                                                  const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                  py::object state, py::object python_hook, py::object at_last) {
  auto native = std::make_shared<ScatterSwitch>();
  native->on.store(false);  // Python switches it on once it has set the layout
  native->world = group->getSize();
  reducer->register_comm_hook(
      std::make_unique<ScatterHook>(group, std::move(state), std::move(python_hook), std::move(at_last), native));
  return native;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Switch, std::shared_ptr<Switch>>(m, "Switch")
      .def("set", [](Switch& self, bool on) { self.on.store(on); }, py::arg("on"))
      .def(
          "set_hand_over", [](Switch& self, bool on) { self.hand_over.store(on); }, py::arg("on"),
          "Whether the last bucket of a pass calls the Python callable (switch off between passes).")
      .def(
          "wait_on",
          [](Switch& self, int64_t stream_id, int64_t device_index, int64_t device_type) {
            self.waiting = c10::Stream::unpack3(stream_id, static_cast<c10::DeviceIndex>(device_index),
                                                static_cast<c10::DeviceType>(device_type));
          },
          py::arg("stream_id"), py::arg("device_index"), py::arg("device_type"),
          "Wait for every bucket on this stream (torch.cuda.Stream's three numbers) instead of the current one.")
      .def_property_readonly("on", [](const Switch& self) { return self.on.load(); })
      .def_property_readonly("hand_over", [](const Switch& self) { return self.hand_over.load(); })
      .def_property_readonly(
          "bytes_sent", [](const Switch& self) { return self.bytes_sent.load(); },
          "Bytes the hook's allreduces sent while on, counted as a ring allreduce sends them.");
  py::class_<ScatterSwitch, Switch, std::shared_ptr<ScatterSwitch>>(m, "ScatterSwitch")
      .def(
          "set_layout",
          [](ScatterSwitch& self, std::vector<std::tuple<at::Tensor, at::Tensor, int64_t>> shards,
             std::vector<std::vector<std::tuple<int64_t, int64_t, std::vector<std::tuple<int64_t, int64_t, int64_t>>>>>
                 buckets) {
            if (self.on.load()) {
              throw std::runtime_error("set_layout: switch the hook off first");
            }
            self.shards.clear();
            for (auto& [send, recv, params] : shards) {
              self.shards.push_back({send, recv, params, 0});
            }
            self.buckets.clear();
            for (auto& pieces : buckets) {
              std::vector<Piece> converted;
              for (auto& [shard, count, runs] : pieces) {
                converted.push_back({shard, count, runs});
              }
              self.buckets.push_back(std::move(converted));
            }
          },
          py::arg("shards"), py::arg("buckets"),
          "The shards (send buffer, receive buffer, parameters) and, per bucket, its pieces "
          "(shard, parameters, [(bucket offset, send offset, elements)]).");
  m.def("register_average_hook", &registerHook, py::arg("reducer"), py::arg("group"), py::arg("plan_for"),
        py::arg("state"), py::arg("python_hook"), py::arg("at_last") = py::none(),
        "Register the C++ averaging hook on DDP's reducer (once, before the first backward); return its switch.");
  m.def("register_scatter_hook", &registerScatterHook, py::arg("reducer"), py::arg("group"), py::arg("state"),
        py::arg("python_hook"), py::arg("at_last"),
        "Register the C++ reduce-scatter hook on DDP's reducer, switched off (set its layout, then switch it on).");
}
