// The collectives of ProcessGroupACCL.  Each entry point is one shape: its argument checks (helpers written once),
// one Call (header words; staging; small data riding whole in the header exchange; the engine calls, segment by
// segment through forSegments; the copy-back), then enqueue.
#include "accl.hpp"

#include <torch/csrc/distributed/c10d/Utils.hpp>

#include <algorithm>
#include <cstring>
#include <numeric>

namespace torchhpc::accl {
namespace {

constexpr int64_t kPay = wire::kPayloadBytes;  // all_to_all's block in the exchange: its byte matrix row and sends

std::string shape(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) s += std::to_string(t.size(i)) + (t.dim() == 1 ? "," : i + 1 < t.dim() ? ", " : "");
  return s + ")";
}

}  // namespace

bool ProcessGroupACCL::ride(Call& c, const Engine* eng, Carry carry, std::function<bool()> carried, bool capped) {
  const int64_t bytes = carry.ride == Ride::kGather ? carry.bytes * size_ : carry.bytes;
  const int64_t cap = capped && opts_.maxSegmentBytes ? *opts_.maxSegmentBytes : wire::kCarryBytes;
  if (!onMpi(eng) || !c.header || bytes > std::min(wire::kCarryBytes, cap)) return false;
  c.carry = std::move(carry);
  c.carried = std::move(carried);
  return true;
}

template <typename F>
c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::inOrder(size_t n, F one) {
  c10::intrusive_ptr<c10d::Work> last;
  for (size_t i = 0; i < n; ++i) last = one(i);
  return last;
}

// ============================================================================================== all_reduce

std::unique_ptr<Call> ProcessGroupACCL::allreduceCall(std::vector<at::Tensor> ts, const Reduction& red,
                                                      wire::Kind kind, c10d::OpType type) {
  int64_t numel = 0;
  for (const auto& x : ts) numel += x.numel();
  auto c = newCall(kind, red.dtype, &red, 0, numel * static_cast<int64_t>(red.esz), numel, ts, type);
  Engine* eng = engineFor(Coll::kAllreduce, red.dtype, red.op);
  auto buf = std::make_shared<at::Tensor>();
  c->stage = [ts, buf] { *buf = flatHost(ts); };
  ride(*c, eng, {Ride::kReduce, buf, c->head.nbytes, &red});
  c->data = [this, buf, numel, &red, eng] {
    if (usesRing(eng, Coll::kAllreduce, numel * static_cast<int64_t>(red.esz))) {
      return ring(red, numel, ptr(*buf), nullptr, nullptr);
    }
    forSegments(Coll::kAllreduce, numel, red.esz,
                [&](int64_t off, int64_t cnt) { eng->allreduce(seg(*buf, off, cnt), red); });
  };
  c->finish = [ts, buf, &red, p = size_] {
    if (red.avg) buf->div_(p);
    deliverEach(*buf, ts);
  };
  return c;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].is_sparse()) return allreduce_sparse(tensors, opts);
  const at::Tensor& t = one(tensors, "all_reduce");
  const Reduction& red = reductionFor(t.scalar_type(), opts.reduceOp.op_, "all_reduce");
  checkOpen();
  return enqueue(allreduceCall(tensors, red, wire::kAllReduce, c10d::OpType::ALLREDUCE), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  if (tensors.empty()) valueError("accl: all_reduce_coalesced needs at least one tensor");
  for (const auto& t : tensors) {
    if (t.scalar_type() != tensors[0].scalar_type())
      typeError("accl: all_reduce_coalesced needs tensors of one dtype, got " +
                wire::torchName(tensors[0].scalar_type()) + " and " + wire::torchName(t.scalar_type()));
    if (t.device() != tensors[0].device()) valueError("accl: all_reduce_coalesced needs tensors on one device");
  }
  const Reduction& red = reductionFor(tensors[0].scalar_type(), opts.reduceOp.op_, "all_reduce_coalesced");
  checkOpen();
  return enqueue(allreduceCall(tensors, red, wire::kAllReduceCoalesced, c10d::OpType::ALLREDUCE_COALESCED),
                 opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                  const c10d::AllreduceOptions& opts) {
  if (tensors.size() != 1)
    valueError("accl: all_reduce takes exactly one tensor per call, got " + std::to_string(tensors.size()));
  const at::Tensor& t = tensors[0];
  if (t.layout() != at::kSparse) typeError("accl: sparse all_reduce needs a sparse COO tensor");
  if (opts.reduceOp.op_ != RedOpType::SUM)
    valueError("accl: sparse all_reduce supports ReduceOp.SUM only (as gloo), got ReduceOp." +
               opName(opts.reduceOp.op_));
  checkOpen();
  return enqueue(sparseCall(t, opts.reduceOp), opts.asyncOp);
}

std::unique_ptr<Call> ProcessGroupACCL::sparseCall(const at::Tensor& t, const c10d::ReduceOp& op) {
  // every rank's (indices, values) all-gathered, then summed by coalescing (gloo's algorithm): the header checks
  // dtype and dense size; the nnz counts travel first
  const int p = size_;
  engineFor(Coll::kAllreduce);  // MPI's, where the engine may sidestep
  auto c = newCall(wire::kAllReduce, t.scalar_type(), nullptr, 0, 0, t.numel(), {t}, c10d::OpType::_ALLREDUCE_SPARSE);
  c->head.op = wire::opCode(op.op_);
  c->head.extra = t.sparse_dim();
  c->header = true;
  auto result = std::make_shared<at::Tensor>();
  c->data = [this, t, result, p] {
    at::Tensor mine = t.cpu().coalesce();
    at::Tensor indices = mine.indices().t().contiguous(), values = mine.values().contiguous();
    at::Tensor mineNnz = at::full({1}, indices.size(0), at::kLong), nnz = at::empty({p}, at::kLong);
    mpi_->allgather(seg(mineNnz, 0, 1), seg(nnz, 0, 1, p, 1));
    const std::vector<int64_t> counts(nnz.data_ptr<int64_t>(), nnz.data_ptr<int64_t>() + p);
    const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    std::vector<int64_t> valueShape = values.sizes().vec();
    valueShape[0] = total;
    at::Tensor allIndices = at::empty({total, t.sparse_dim()}, indices.options());
    at::Tensor allValues = at::empty(valueShape, values.options());
    for (auto [part, all] : {std::pair{indices, allIndices}, std::pair{values, allValues}}) {
      const int64_t rowBytes = total ? static_cast<int64_t>(all.nbytes()) / total : 0;
      std::vector<int> bytes(p), displs(p);
      for (int r = 0; r < p; ++r) {
        bytes[r] = static_cast<int>(counts[r] * rowBytes);
        displs[r] = r ? displs[r - 1] + bytes[r - 1] : 0;
      }
      stats_.count(static_cast<int64_t>(all.nbytes()));
      mpi_->allgatherv(ptr(part), bytes[rank_], ptr(all), bytes.data(), displs.data());
    }
    *result = at::sparse_coo_tensor(allIndices.t(), allValues, t.sizes()).coalesce();
  };
  c->finish = [t, result] { at::Tensor(t).copy_(result->to(t.device())); };
  return c;
}

// ============================================================================================== broadcast, reduce

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = one(tensors, "broadcast");
  if (opts.rootTensor != 0) valueError("accl: broadcast rootTensor must be 0, got " + std::to_string(opts.rootTensor));
  checkRoot(opts.rootRank, "broadcast");
  checkOpen();
  const int root = static_cast<int>(opts.rootRank);
  const bool isRoot = rank_ == root;
  auto c = newCall(wire::kBroadcast, t.scalar_type(), nullptr, root, t.nbytes(), t.numel(), {t},
                   c10d::OpType::BROADCAST);
  Engine* eng = engineFor(Coll::kBroadcast, t.scalar_type());
  auto buf = std::make_shared<at::Tensor>();
  c->stage = [t, buf, isRoot] { *buf = host(t, isRoot); };
  ride(*c, eng, {Ride::kBroadcast, buf, c->head.nbytes, nullptr, root});
  c->data = [this, buf, root, eng] {
    forSegments(Coll::kBroadcast, buf->numel(), buf->element_size(),
                [&](int64_t off, int64_t cnt) { eng->broadcast(seg(*buf, off, cnt), root); });
  };
  c->finish = [t, buf, isRoot] {
    if (!isRoot) deliver(*buf, t);
  };
  return enqueue(std::move(c), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  const at::Tensor& t = one(tensors, "reduce");
  checkRoot(opts.rootRank, "reduce");
  const Reduction& red = reductionFor(t.scalar_type(), opts.reduceOp.op_, "reduce");
  checkOpen();
  const int root = static_cast<int>(opts.rootRank);
  const int64_t numel = t.numel();
  auto c = newCall(wire::kReduce, red.dtype, &red, root, numel * static_cast<int64_t>(red.esz), numel, {t},
                   c10d::OpType::REDUCE);
  Engine* eng = engineFor(Coll::kReduce, red.dtype, red.op);
  auto buf = std::make_shared<at::Tensor>();
  c->stage = [t, buf] { *buf = host(t, true); };
  c->data = [this, buf, numel, &red, root, eng] {
    forSegments(Coll::kReduce, numel, red.esz,
                [&](int64_t off, int64_t cnt) { eng->reduce(seg(*buf, off, cnt), red, root); });
  };
  c->finish = [t, buf, &red, isRoot = rank_ == root, p = size_] {
    if (!isRoot) return;  // the others' tensors are left as they were
    if (red.avg) buf->div_(p);
    deliver(*buf, t);
  };
  return enqueue(std::move(c), opts.asyncOp);
}

// ============================================================================================== all_gather

std::unique_ptr<Call> ProcessGroupACCL::allgatherCall(const at::Tensor& input, at::Tensor output,
                                                      std::vector<at::Tensor> outputs, c10d::OpType type) {
  // `output`: the p x n tensor (all_gather_into_tensor), or undefined: the rows go to `outputs` in order
  const int p = size_;
  const int64_t n = input.numel(), esz = input.element_size();
  auto c = newCall(wire::kAllGather, input.scalar_type(), nullptr, 0, n * esz, n, outputs, type, {input});
  c->header = needsHeader(n * esz * p);
  Engine* eng = engineFor(Coll::kAllgather, input.scalar_type());
  auto src = std::make_shared<at::Tensor>(), dst = std::make_shared<at::Tensor>();
  const bool rides = ride(*c, eng, {Ride::kGather, dst, n * esz});
  c->stage = [input, output, src, dst, p, rides, mine = ptrdiff_t(rank_ * n * esz)] {
    *src = host(input, true);
    *dst = output.defined() ? host(output, false) : at::empty({p * input.numel()}, src->options());
    if (rides && ptr(*src) != ptr(*dst) + mine) std::memcpy(ptr(*dst) + mine, ptr(*src), src->nbytes());
  };
  c->data = [this, src, dst, n, esz, p, eng] {
    forSegments(Coll::kAllgather, n, esz * p, [&](int64_t off, int64_t cnt) {
      eng->allgather(seg(*src, off, cnt), seg(*dst, off, cnt, p, n));
    });
  };
  c->finish = [output, outputs, dst] {
    if (output.defined()) deliver(*dst, output);
    else deliverEach(*dst, outputs);
  };
  return c;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions& opts) {
  checkSameDtype(output, input, "all_gather_into_tensor");
  checkWhole(output, input, "all_gather_into_tensor", "output", "input");
  checkOpen();
  return enqueue(allgatherCall(input, output, {output}, c10d::OpType::_ALLGATHER_BASE), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  const at::Tensor& input = one(inputs, "all_gather");
  if (outputs.size() != 1)
    valueError("accl: all_gather takes one output list, got " + std::to_string(outputs.size()));
  checkList(outputs[0], input, "all_gather", "output_tensor_list");
  checkOpen();
  return enqueue(allgatherCall(input, at::Tensor(), outputs[0], c10d::OpType::ALLGATHER), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                 std::vector<at::Tensor>& inputs,
                                                                                 const c10d::AllgatherOptions& opts) {
  checkPairs(outputs.size(), inputs.size(), "all_gather_into_tensor");
  return inOrder(inputs.size(), [&](size_t i) { return _allgather_base(outputs[i], inputs[i], opts); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                                     std::vector<at::Tensor>& inputs,
                                                                     const c10d::AllgatherOptions& opts) {
  // outputLists[r][j] receives rank r's inputs[j] (torch's layout: one list per rank)
  bool shaped = !inputs.empty() && static_cast<int>(outputLists.size()) == size_;
  for (const auto& l : outputLists) shaped = shaped && l.size() == inputs.size();
  if (!shaped)
    valueError("accl: all_gather_coalesced needs at least one input tensor and " + std::to_string(size_) +
               " output lists (one per rank), each with one tensor per input tensor (" +
               std::to_string(inputs.size()) + ")");
  return inOrder(inputs.size(), [&](size_t j) {
    std::vector<std::vector<at::Tensor>> outs(1);
    for (const auto& l : outputLists) outs[0].push_back(l[j]);
    std::vector<at::Tensor> in{inputs[j]};
    return allgather(outs, in, opts);
  });
}

// ============================================================================================== reduce_scatter

std::unique_ptr<Call> ProcessGroupACCL::reduceScatterCall(std::vector<at::Tensor> inputs, const at::Tensor& output,
                                                          const Reduction& red, c10d::OpType type) {
  const int p = size_;
  const int64_t n = output.numel(), esz = static_cast<int64_t>(red.esz);
  auto c = newCall(wire::kReduceScatter, red.dtype, &red, 0, n * esz, n, {output}, type, inputs);
  c->header = needsHeader(n * esz * p);
  Engine* eng = engineFor(Coll::kReduceScatter, red.dtype, red.op);
  auto src = std::make_shared<at::Tensor>(), dst = std::make_shared<at::Tensor>();
  // small: every rank's input reduced whole in the exchange, which sends p times what a reduce-scatter needs;
  // across nodes only while one message's latency outweighs that (else the ring sends its 1/p)
  auto whole = std::make_shared<at::Tensor>();
  const bool rides = (!spansNodes_ || n * esz * p <= wire::kInlineBytes) &&
                     ride(*c, eng, {Ride::kReduce, whole, n * esz * p, &red}, [dst, whole, n, esz, me = rank_] {
                       std::memcpy(ptr(*dst), ptr(*whole) + me * n * esz, n * esz);
                       return true;
                     });
  c->stage = [this, inputs, output, src, dst, whole, rides, bytes = n * esz * p] {
    *src = flatHost(inputs);
    *dst = host(output, false);
    if (!rides) return;
    // reduced in place in the exchange: into a buffer the group keeps (calls run one at a time), the input as given
    if (!rsWhole_.defined()) rsWhole_ = at::empty({wire::kCarryBytes}, at::kByte);
    *whole = rsWhole_;
    std::memcpy(ptr(*whole), ptr(*src), bytes);
  };
  c->data = [this, src, dst, n, esz, p, &red, eng] {
    if (usesRing(eng, Coll::kReduceScatter, n * esz * p)) {
      return ring(red, n * p, nullptr, ptr(*src), ptr(*dst));
    }
    forSegments(Coll::kReduceScatter, n, esz * p, [&](int64_t off, int64_t cnt) {
      eng->reduceScatter(seg(*src, off, cnt, p, n), seg(*dst, off, cnt), red);
    });
  };
  c->finish = [output, dst, &red, p] {
    if (red.avg) dst->div_(p);
    deliver(*dst, output);
  };
  return c;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  checkSameDtype(output, input, "reduce_scatter_tensor");
  checkWhole(input, output, "reduce_scatter_tensor", "input", "output");
  const Reduction& red = reductionFor(output.scalar_type(), opts.reduceOp.op_, "reduce_scatter");
  checkOpen();
  return enqueue(reduceScatterCall({input}, output, red, c10d::OpType::_REDUCE_SCATTER_BASE), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& output = one(outputs, "reduce_scatter");
  if (inputs.size() != 1) valueError("accl: reduce_scatter takes one input list");
  checkList(inputs[0], output, "reduce_scatter", "input_list");
  const Reduction& red = reductionFor(output.scalar_type(), opts.reduceOp.op_, "reduce_scatter");
  checkOpen();
  return enqueue(reduceScatterCall(inputs[0], output, red, c10d::OpType::REDUCE_SCATTER), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  checkPairs(outputs.size(), inputs.size(), "reduce_scatter_tensor");
  return inOrder(inputs.size(), [&](size_t i) { return _reduce_scatter_base(outputs[i], inputs[i], opts); });
}

// ============================================================================================== gather, scatter

std::unique_ptr<Call> ProcessGroupACCL::rootedCall(wire::Kind kind, const std::vector<at::Tensor>& mineList,
                                                   const std::vector<std::vector<at::Tensor>>& lists, int64_t rootRank) {
  const bool toRoot = kind == wire::kGather;
  const char* what = toRoot ? "gather" : "scatter";
  const at::Tensor& mine = one(mineList, what);
  checkRoot(rootRank, what);
  std::vector<at::Tensor> rows = rootList(lists, mine, rootRank, what, toRoot ? "gather_list" : "scatter_list");
  checkOpen();
  const int root = static_cast<int>(rootRank);
  const bool isRoot = rank_ == root;
  const int p = size_;
  const int64_t n = mine.numel(), esz = mine.element_size();
  auto c = newCall(kind, mine.scalar_type(), nullptr, root, n * esz, n, toRoot ? rows : std::vector{mine},
                   toRoot ? c10d::OpType::GATHER : c10d::OpType::SCATTER, toRoot ? std::vector{mine} : rows);
  if (!c->stream) c->stream = callerStream({mine});  // a gather's input off the root
  c->header = needsHeader(n * esz * p);
  Engine* eng = engineFor(toRoot ? Coll::kGather : Coll::kScatter, mine.scalar_type());
  auto one = std::make_shared<at::Tensor>(), all = std::make_shared<at::Tensor>();
  c->stage = [mine, rows, one, all, toRoot, isRoot, n, p] {
    *one = host(mine, toRoot);
    if (isRoot) *all = toRoot ? at::empty({p * n}, one->options()) : flatHost(rows);
  };
  c->data = [this, one, all, n, esz, p, root, toRoot, eng] {
    forSegments(toRoot ? Coll::kGather : Coll::kScatter, n, esz * p, [&](int64_t off, int64_t cnt) {  // same pieces
      const Seg part = seg(*one, off, cnt), block = seg(*all, off, cnt, p, n);
      if (toRoot) eng->gather(part, block, root);
      else eng->scatter(block, part, root);
    });
  };
  c->finish = [mine, rows, one, all, toRoot] {
    if (!toRoot) deliver(*one, mine);
    else if (all->defined()) deliverEach(*all, rows);
  };
  return c;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::GatherOptions& opts) {
  return enqueue(rootedCall(wire::kGather, inputs, outputs, opts.rootRank), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ScatterOptions& opts) {
  return enqueue(rootedCall(wire::kScatter, outputs, inputs, opts.rootRank), opts.asyncOp);
}

// ============================================================================================== all_to_all

void ProcessGroupACCL::checkSplits(const std::vector<int64_t>& sizes, const at::Tensor& t, const char* name) const {
  const int64_t p = size_, rows = t.dim() ? t.size(0) : 1;
  auto fail = [name](const std::string& what) { valueError(std::string("accl: all_to_all_single ") + name + what); };
  if (sizes.empty()) {
    if (t.dim() == 0 || t.size(0) % p)
      fail(" dim 0 (" + shape(t) + ") is not divisible by world_size " + std::to_string(p) + "; pass split sizes");
    return;
  }
  if (static_cast<int64_t>(sizes.size()) != p)
    fail("_split_sizes has " + std::to_string(sizes.size()) + " entries, world_size is " + std::to_string(p));
  if (std::any_of(sizes.begin(), sizes.end(), [](int64_t s) { return s < 0; })) fail("_split_sizes must be >= 0");
  const int64_t sum = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  if (sum != rows)
    fail("_split_sizes sum to " + std::to_string(sum) + " but " + name + " has " + std::to_string(rows) + " rows");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                               std::vector<int64_t>& outputSplits,
                                                               std::vector<int64_t>& inputSplits,
                                                               const c10d::AllToAllOptions& opts) {
  checkSameDtype(output, input, "all_to_all_single");
  checkSplits(inputSplits, input, "input");
  checkSplits(outputSplits, output, "output");
  checkOpen();
  std::vector<int64_t> sb(size_), rb(size_), offsets(size_);
  c10d::computeLengthsAndOffsets(inputSplits, input, &sb, &offsets);  // elements, to bytes below
  c10d::computeLengthsAndOffsets(outputSplits, output, &rb, &offsets);
  for (auto* v : {&sb, &rb})
    for (auto& x : *v) x *= input.element_size();
  return enqueue(alltoallCall({input}, {output}, std::move(sb), std::move(rb), c10d::OpType::ALLTOALL_BASE),
                 opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions& opts) {
  const size_t p = static_cast<size_t>(size_);
  if (outputs.size() != p || inputs.size() != p)
    valueError("accl: all_to_all needs " + std::to_string(p) + " input and " + std::to_string(p) +
               " output tensors, got " + std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()));
  for (const auto* list : {&inputs, &outputs})
    for (const auto& t : *list)
      if (t.scalar_type() != inputs[0].scalar_type()) typeError("accl: all_to_all needs every tensor of one dtype");
  checkOpen();
  std::vector<int64_t> sb, rb;
  for (const auto& t : inputs) sb.push_back(static_cast<int64_t>(t.nbytes()));
  for (const auto& t : outputs) rb.push_back(static_cast<int64_t>(t.nbytes()));
  return enqueue(alltoallCall(inputs, outputs, std::move(sb), std::move(rb), c10d::OpType::ALLTOALL), opts.asyncOp);
}

namespace {

// the agreed byte matrix: rows[i * stride + j] is what rank i sends to rank j, rows[j * stride + p + i] what j
// expects from i; a mismatch names the first pair. Returns the largest send, which fixes the segment rounds;
// `even`: every rank sends every rank the same bytes (then MPI's all-to-all without counts serves)
int64_t checkAlltoallMatrix(const int64_t* rows, int64_t stride, int p, bool* even) {
  int64_t bad = 0, bi = 0, bj = 0, most = 0, least = rows[0];
  for (int i = 0; i < p; ++i)
    for (int j = 0; j < p; ++j) {
      const int64_t s = rows[i * stride + j], r = rows[j * stride + p + i];
      if (s != r && bad++ == 0) std::tie(bi, bj) = std::pair{i, j};
      most = std::max(most, s);
      least = std::min(least, s);
    }
  *even = least == most;
  if (bad)
    throw MismatchError("accl: all_to_all split sizes do not match across ranks: rank " + std::to_string(bi) +
                        " sends " + std::to_string(rows[bi * stride + bj]) + " bytes to rank " + std::to_string(bj) +
                        ", which expects " + std::to_string(rows[bj * stride + p + bi]) + " bytes from it (" +
                        std::to_string(bad) + " mismatched pairs)");
  return most;
}

// bytes [done, done + per) of every rank's block of `bytes`: their counts and displacements for MPI_Alltoallv
void alltoallSegment(const std::vector<int64_t>& bytes, int64_t done, int64_t per, std::vector<int>& count,
                     std::vector<int>& displ) {
  int64_t at = 0;
  for (size_t j = 0; j < bytes.size(); at += bytes[j], ++j) {
    count[j] = static_cast<int>(std::clamp<int64_t>(bytes[j] - done, 0, per));
    displ[j] = static_cast<int>(at + std::min(done, bytes[j]));
  }
}

// one all_to_all's byte counts, shared by its steps
struct AlltoallPlan {
  std::vector<int64_t> sb, rb;  // bytes to and from each rank
  int64_t most = 0;             // the largest send of any rank, from the agreed matrix
  bool even = false;            // ... and whether every send is that size
  int64_t block = 0, fits = 0;  // the exchange's block per rank, and the sends that fit it (set when the call runs)
};

// the sends that rode in the exchange's blocks (`block` bytes a rank: its matrix row, then its sends) into `dst` in
// rank order; false (nothing taken) unless every rank's sends fit `fits` bytes
bool alltoallFromBlocks(const char* all, int p, int me, char* dst, int64_t block, int64_t fits) {
  const int64_t stride = block / 8;
  const auto* rows = reinterpret_cast<const int64_t*>(all);
  for (int i = 0; i < p; ++i)
    if (std::accumulate(rows + i * stride, rows + i * stride + p, int64_t{0}) > fits) return false;
  for (int r = 0; r < p; ++r) {
    const int64_t* row = rows + r * stride;
    const int64_t off = 16 * p + std::accumulate(row, row + me, int64_t{0});
    std::memcpy(dst, all + r * block + off, row[me]);
    dst += row[me];
  }
  return true;
}

// this rank's block: its matrix row (bytes to each rank, then from each), then its sends when they fit
void alltoallFillBlock(char* mine, const AlltoallPlan& a, int p, const char* src, int64_t sent) {
  std::memcpy(mine, a.sb.data(), 8 * p);
  std::memcpy(mine + 8 * p, a.rb.data(), 8 * p);
  if (sent <= a.fits) std::memcpy(mine + 16 * p, src, sent);
}

// the largest block a rank may carry through the exchange (p of them fill at most kCarryBytes)
int64_t alltoallBlockMax(int p) { return std::max<int64_t>(kPay, wire::kCarryBytes / p / 64 * 64); }

// the block the next all_to_all carries: what held the largest sends of this one (the matrix every rank agreed on,
// so every rank picks the same size), or the matrix row alone when they cannot ride; a call whose sends outgrow
// its block sends them after the exchange
int64_t alltoallBlockFor(int64_t most, int p) {
  const int64_t need = (16 * p + most * p + 1023) / 1024 * 1024;
  return need <= alltoallBlockMax(p) ? std::max<int64_t>(need, kPay) : kPay;
}

}  // namespace

std::unique_ptr<Call> ProcessGroupACCL::alltoallCall(std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                                                     std::vector<int64_t> sb, std::vector<int64_t> rb,
                                                     c10d::OpType type) {
  const int p = size_;
  engineFor(Coll::kAlltoall);  // no engine has it: MPI's, if the engine may sidestep
  auto c = newCall(wire::kAllToAll, inputs[0].scalar_type(), nullptr, 0, 0, 0, outputs, type, inputs);
  c->head.extra = p;
  c->compare = wire::kCompareCall;  // sizes are checked on the byte matrix
  c->header = true;                 // always: the matrix fixes the rounds and checks sends against receives
  const int64_t sent = std::accumulate(sb.begin(), sb.end(), int64_t{0});
  int64_t received = 0;
  for (const auto& t : outputs) received += t.numel();
  auto src = std::make_shared<at::Tensor>(), dst = std::make_shared<at::Tensor>();
  auto a = std::make_shared<AlltoallPlan>(AlltoallPlan{std::move(sb), std::move(rb)});
  // up to 64 ranks, every rank's matrix row rides with the header, and its sends after it when every rank's fit the
  // block the group's previous all_to_all chose (a2aBlock_, read when the call runs: calls run in issue order)
  auto blocks = std::make_shared<at::Tensor>();
  Call* self = c.get();  // the stage sets the block's size when the call runs
  const bool rides = ride(
      *c, mpi_.get(), {Ride::kGather, blocks, alltoallBlockMax(p)},
      [this, blocks, dst, a, p] {
        a->most = checkAlltoallMatrix(reinterpret_cast<const int64_t*>(ptr(*blocks)), a->block / 8, p, &a->even);
        a2aBlock_ = alltoallBlockFor(a->most, p);
        return alltoallFromBlocks(ptr(*blocks), p, rank_, ptr(*dst), a->block, a->fits);
      },
      false);
  c->stage = [this, inputs, outputs, src, dst, received, blocks, rides, a, p, sent, self, me = rank_] {
    *src = flatHost(inputs);
    *dst = outputs.size() == 1 ? host(outputs[0], false) : at::empty({received}, src->options());
    if (!rides) return;
    if (!a2aBlocks_.defined()) a2aBlocks_ = at::empty({p * alltoallBlockMax(p)}, at::kByte);
    *blocks = a2aBlocks_;
    a->block = self->carry.bytes = a2aBlock_;
    a->fits = std::min(a->block - 16 * p, segmentFor(Coll::kAlltoall));
    alltoallFillBlock(ptr(*blocks) + me * a->block, *a, p, ptr(*src), sent);
  };
  c->data = [this, src, dst, a, p, rides] {
    if (!rides) {  // many ranks: the byte matrix by a second all-gather, then its check
      at::Tensor mine = at::cat({at::tensor(a->sb), at::tensor(a->rb)}), matrix = at::empty({p * 2 * p}, at::kLong);
      stats_.count(static_cast<int64_t>(matrix.nbytes()));
      mpi_->allgather(seg(mine, 0, 2 * p), seg(matrix, 0, 2 * p, p, 2 * p));
      a->most = checkAlltoallMatrix(matrix.data_ptr<int64_t>(), 2 * p, p, &a->even);
    }
    forSegments(Coll::kAlltoall, a->most, p, [&](int64_t done, int64_t per) {  // up to `per` bytes to/from each rank
      // even splits in one segment: MPI_Alltoall, which MPICH runs 2-3x faster than its Alltoallv at 1-4 MiB
      if (a->even && per >= a->most) return mpi_->alltoall(ptr(*src), static_cast<int>(a->most), ptr(*dst));
      std::vector<int> sc(p), sd(p), rc(p), rd(p);
      alltoallSegment(a->sb, done, per, sc, sd);
      alltoallSegment(a->rb, done, per, rc, rd);
      mpi_->alltoallv(ptr(*src), sc.data(), sd.data(), ptr(*dst), rc.data(), rd.data());
    });
  };
  c->finish = [outputs, dst] {
    if (outputs.size() == 1 && outputs[0].numel()) deliver(*dst, outputs[0]);
    else if (outputs.size() > 1) deliverEach(*dst, outputs);
  };
  return c;
}

// ============================================================================================== barrier

c10::intrusive_ptr<c10d::Work> ProcessGroupACCL::barrier(const c10d::BarrierOptions& opts) {
  checkOpen();
  engineFor(Coll::kBarrier);
  auto c = newCall(wire::kBarrier, at::kByte, nullptr, 0, 0, 0, {}, c10d::OpType::BARRIER);
  c->head.dtype = 0;
  c->header = opts_.check;  // checked: the header exchange is itself a full synchronisation
  c->data = [this, header = c->header] {
    if (!header) mpi_->barrier();
  };
  return enqueue(std::move(c), opts.asyncOp);
}

}  // namespace torchhpc::accl
