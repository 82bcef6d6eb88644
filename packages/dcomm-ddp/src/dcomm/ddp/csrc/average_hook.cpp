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
// views the bucket) and the bucket is on a GPU, the hook casts, sends and casts back into the
// bucket on a side stream, and DDP then copies nothing: no work at all on the backward stream.
#include <torch/extension.h>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>

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
  at::Tensor divisor_as_tensor;  // the same number, as Python passes a scalar divisor (a wrapped number)
  c10d::ReduceOp op;
  std::optional<at::ScalarType> wire;  // the dtype sent, when it differs from the bucket's
};

class AverageHook final : public c10d::CommHookInterface {
 public:
  AverageHook(c10::intrusive_ptr<c10d::ProcessGroup> group, py::object plan_for, py::object state,
              py::object python_hook)
      : group_(std::move(group)), plan_for_(std::move(plan_for)), python_(std::move(state), std::move(python_hook)) {}

  ~AverageHook() override {
    py::gil_scoped_acquire gil;
    plan_for_ = py::object();
  }

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    const at::Tensor& buffer = bucket.getBufferRef();
    if (buffer.is_sparse() || !buffer.is_floating_point()) {
      return python_.runHook(bucket);
    }
    return average(bucket, buffer);
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isPyObject()) {
      return python_.parseHookResult(result);
    }
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  // Launch the bucket's average.
  c10::intrusive_ptr<c10::ivalue::Future> average(c10d::GradBucket& bucket, const at::Tensor& buffer) {
    const Plan& plan = planFor(buffer);
    at::Tensor sent = buffer;
    if (plan.wire.has_value()) {
      sent = lowPrecisionCopy(bucket.getIndex(), buffer, *plan.wire);
      if (buffer.device().type() != at::kCPU && gradientsAreViewsOf(bucket, buffer)) {
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
    std::vector<at::Tensor> tensors{sent};
    c10d::AllreduceOptions options;
    options.reduceOp = plan.op;
    return group_->allreduce(tensors, options)->getFuture();
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
  c10d::PythonCommHook python_;
  std::mutex mutex_;
  std::map<std::tuple<at::ScalarType, at::DeviceType, at::DeviceIndex>, Plan> plans_;
  std::vector<at::Tensor> low_;
  std::vector<std::unique_ptr<c10::Event>> full_;  // per bucket: the backward stream has filled it
  std::map<at::DeviceIndex, c10::Stream> aside_;   // the side stream of averageAside, per device
};

void registerHook(const std::shared_ptr<c10d::Reducer>& reducer, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                  py::object plan_for, py::object state, py::object python_hook) {
  reducer->register_comm_hook(
      std::make_unique<AverageHook>(group, std::move(plan_for), std::move(state), std::move(python_hook)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_average_hook", &registerHook, py::arg("reducer"), py::arg("group"), py::arg("plan_for"),
        py::arg("state"), py::arg("python_hook"),
        "Register the C++ averaging hook on DDP's reducer (once, before the first backward).");
}
