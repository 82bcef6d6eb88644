// A DDP communication hook in C++: average a bucket with one allreduce, optionally in a lower
// precision. DDP's reducer calls it without entering Python, as it does its built-in hooks.
//
// The arithmetic comes from Python, once per (dtype, device): a callable gives the divisor to
// apply before the sum, the reduce op, and the dtype to send in (None: in place). A bucket this
// hook does not handle (sparse gradients; DDP buckets complex ones as their real view) goes to the
// Python hook it stands for.
//
// A hook may also be registered switched off, with a callable for its last bucket: it then runs
// the Python hook for every bucket until Python switches it on. Switched on, it averages every
// bucket itself and, at the last one, waits for them all (a stream wait on CUDA: on the stream that
// Python names, so that DDP's own copies of the buckets into .grad still follow each bucket's
// collective on the backward stream) and hands their indices and averaged buffers to that
// callable: one Python call per backward pass instead of one per bucket (ZeRO overlap's fused step).
#include <torch/extension.h>

#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

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

struct Plan {
  double divisor;  // applied before the sum; 1 means none
  at::Tensor divisor_as_tensor;  // the same number, as Python passes it to an out= division
  c10d::ReduceOp op;
  std::optional<at::ScalarType> wire;  // the dtype sent, when it differs from the bucket's
};

// Whether a hook averages buckets itself (on) or passes them all to its Python hook (off), and
// the stream that waits for every bucket at the last one (none: the current stream).
struct Switch {
  std::atomic<bool> on{true};
  std::optional<c10::Stream> waiting;
};

struct Launched {
  int64_t index;
  at::Tensor averaged;
  c10::intrusive_ptr<c10::ivalue::Future> future;
};

class AverageHook final : public c10d::CommHookInterface {
 public:
  AverageHook(c10::intrusive_ptr<c10d::ProcessGroup> group, py::object plan_for, py::object state,
              py::object python_hook, py::object at_last, std::shared_ptr<Switch> native)
      : group_(std::move(group)),
        plan_for_(std::move(plan_for)),
        at_last_(std::move(at_last)),
        native_(std::move(native)),
        python_(std::move(state), std::move(python_hook)) {}

  ~AverageHook() override {
    py::gil_scoped_acquire gil;
    plan_for_ = py::object();
    at_last_ = py::object();
  }

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    const at::Tensor& buffer = bucket.getBufferRef();
    if (!native_->on.load() || buffer.is_sparse() || !buffer.is_floating_point()) {
      return python_.runHook(bucket);
    }
    at::Tensor sent;
    auto future = average(bucket, buffer, sent);
    if (!at_last_.is_none()) {
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

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isPyObject()) {
      return python_.parseHookResult(result);
    }
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  // Launch the bucket's average; ``sent`` is the tensor the collective writes.
  c10::intrusive_ptr<c10::ivalue::Future> average(c10d::GradBucket& bucket, const at::Tensor& buffer,
                                                  at::Tensor& sent) {
    const Plan& plan = planFor(buffer);
    sent = buffer;
    if (plan.wire.has_value()) {
      sent = lowPrecisionCopy(bucket.getIndex(), buffer, *plan.wire);
      if (plan.divisor == 1.0) {
        sent.copy_(buffer);
      } else {
        at::div_out(sent, buffer, plan.divisor_as_tensor);  // cast and divide: one kernel
      }
    } else if (plan.divisor != 1.0) {
      sent.div_(plan.divisor);
    }
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
    {
      std::optional<c10::StreamGuard> on_waiting;
      if (native_->waiting.has_value()) {
        on_waiting.emplace(*native_->waiting);
      }
      for (auto& item : launched) {
        item.future->wait();
      }
    }
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

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  py::object plan_for_;
  py::object at_last_;  // None for a plain averaging hook
  std::shared_ptr<Switch> native_;
  std::vector<Launched> launched_;  // this backward pass's buckets so far (with at_last_ only)
  c10d::PythonCommHook python_;
  std::mutex mutex_;
  std::map<std::tuple<at::ScalarType, at::DeviceType, at::DeviceIndex>, Plan> plans_;
  std::vector<at::Tensor> low_;
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Switch, std::shared_ptr<Switch>>(m, "Switch")
      .def("set", [](Switch& self, bool on) { self.on.store(on); }, py::arg("on"))
      .def(
          "wait_on",
          [](Switch& self, int64_t stream_id, int64_t device_index, int64_t device_type) {
            self.waiting = c10::Stream::unpack3(stream_id, static_cast<c10::DeviceIndex>(device_index),
                                                static_cast<c10::DeviceType>(device_type));
          },
          py::arg("stream_id"), py::arg("device_index"), py::arg("device_type"),
          "Wait for every bucket on this stream (torch.cuda.Stream's three numbers) instead of the current one.")
      .def_property_readonly("on", [](const Switch& self) { return self.on.load(); });
  m.def("register_average_hook", &registerHook, py::arg("reducer"), py::arg("group"), py::arg("plan_for"),
        py::arg("state"), py::arg("python_hook"), py::arg("at_last") = py::none(),
        "Register the C++ averaging hook on DDP's reducer (once, before the first backward); return its switch.");
}
