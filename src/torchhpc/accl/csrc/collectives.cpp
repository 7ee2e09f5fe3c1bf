// The collectives of ProcessGroupACCL.  Each has an entry point (its argument checks, written once as helpers; its
// Call; start) and one body that runs it top to bottom when its turn comes: stage into host buffers, the header
// exchange (the whole call on the carried path), the data phase on the path plan() chose, the copy-back.  Last, the
// MPI engine those data phases call.
#include "accl.hpp"

#include <torch/csrc/distributed/c10d/Utils.hpp>

#include <algorithm>
#include <climits>
#include <cstring>
#include <numeric>

namespace torchhpc::accl {
namespace {

wire::Header callHeader(OpType kind, at::ScalarType dtype, int64_t root, int64_t nbytes, int64_t numel,
                        const Reduction* red = nullptr) {
  return {wire::kMagic, static_cast<int64_t>(kind), 0, wire::dtypeCode(dtype), red ? red->ocode : 0, root, nbytes,
          numel, 0};
}

using T = OpType;
bool isReduceScatter(T t) { return t == T::REDUCE_SCATTER || t == T::_REDUCE_SCATTER_BASE; }
bool isAllreduce(T t) { return t == T::ALLREDUCE || t == T::ALLREDUCE_COALESCED; }

// Small calls ride whole in the header exchange (on MPI, within wire::carryBytes and max_segment_bytes): all_reduce,
// broadcast and all_gather, and reduce_scatter, which sends every rank's whole input there (p times what it needs),
// so across nodes only up to kNetReduceScatterCarry (else the ring sends its 1/p: docs/accl.md, the plan)
constexpr int64_t kNetReduceScatterCarry = 3840;
bool rides(T t, int64_t bytes, bool spansNodes, const Config& o) {
  const bool kind = isAllreduce(t) || t == T::BROADCAST || t == T::ALLGATHER || t == T::_ALLGATHER_BASE ||
                    (isReduceScatter(t) && (!spansNodes || bytes <= kNetReduceScatterCarry));
  const int64_t most = wire::carryBytes(spansNodes);
  return kind && bytes <= std::min(most, o.maxSegmentBytes.value_or(most));
}

// accl's ring: from ring_min_bytes where set; else reduce_scatter always (Open MPI's faults in a buffer of the whole
// input on every call), all_reduce when the ranks span nodes (the ring moves the least data over a link).
bool rings(T t, int64_t bytes, int ranks, bool spansNodes, const Config& o) {
  if (!(isAllreduce(t) || isReduceScatter(t)) || ranks == 1) return false;
  return o.ringMinBytes ? bytes >= *o.ringMinBytes : isReduceScatter(t) || spansNodes;
}

}  // namespace

// ============================================================================================== the plan

const char* const kPathNames[3] = {"carried", "mpi", "ring"};

Path plan(OpType type, int64_t bytes, int ranks, bool spansNodes, bool onMpi, const Config& o) {
  if (type == T::BARRIER) return Path::kCarried;  // the header exchange is a barrier
  // all_to_all's byte matrix and a sparse tensor's sizes are always exchanged before the data
  if (type == T::ALLTOALL || type == T::ALLTOALL_BASE || type == T::_ALLREDUCE_SPARSE) return Path::kMpi;
  if (!onMpi) return Path::kMpi;  // another engine: its own calls after the header
  if (rides(type, bytes, spansNodes, o)) return Path::kCarried;
  return rings(type, bytes, ranks, spansNodes, o) ? Path::kRing : Path::kMpi;
}

bool ProcessGroupACCL::header(Call& c, const Carry& carry) {
  exchange(c, c.path == Path::kCarried ? carry : Carry{});
  return c.path == Path::kCarried;
}

// ============================================================================================== all_reduce

// The tensors staged end to end in one host buffer; reduced whole in the header exchange when small, else by accl's
// ring or the engine's calls segment by segment; AVG runs as SUM and divides afterwards.
void ProcessGroupACCL::allreduceBody(Call& c) {
  const Reduction& red = *c.red;
  c.src = flatHost(c.outputs);
  const int64_t n = c.src.numel();
  if (!header(c, {Ride::kReduce, ptr(c.src), c.head.nbytes, &red})) {
    blocking(c, [&] {
      if (c.path == Path::kRing) return ring(red, n, ptr(c.src), nullptr, nullptr);
      forSegments(OpType::ALLREDUCE, n, red.esz,
                  [&](int64_t off, int64_t cnt) { c.eng->allreduce(seg(c.src, off, cnt), red); });
    });
  }
  if (red.avg) c.src.div_(size_);
  deliverEach(c.src, c.outputs);
}

WorkPtr ProcessGroupACCL::allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].is_sparse()) return allreduce_sparse(tensors, opts);
  one(tensors, "all_reduce");
  return allreduceStart(tensors, opts.reduceOp.op_, OpType::ALLREDUCE, opts.asyncOp);
}

WorkPtr ProcessGroupACCL::allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK_VALUE(!tensors.empty(), "accl: all_reduce_coalesced needs at least one tensor");
  for (const auto& t : tensors) {
    TORCH_CHECK_TYPE(t.scalar_type() == tensors[0].scalar_type(), "accl: all_reduce_coalesced needs tensors of one "
                     "dtype, got ", wire::torchName(tensors[0].scalar_type()), " and ",
                     wire::torchName(t.scalar_type()));
    TORCH_CHECK_VALUE(t.device() == tensors[0].device(), "accl: all_reduce_coalesced needs tensors on one device");
  }
  return allreduceStart(tensors, opts.reduceOp.op_, OpType::ALLREDUCE_COALESCED, opts.asyncOp);
}

// the tensors (checked: one dtype, one device) reduced end to end as one call
WorkPtr ProcessGroupACCL::allreduceStart(const Tensors& tensors, RedOpType op, OpType type, bool asyncOp) {
  const Reduction& red = reductionFor(tensors[0].scalar_type(), op, collName(type));
  checkOpen();
  int64_t numel = 0;
  for (const auto& t : tensors) numel += t.numel();
  const int64_t bytes = numel * static_cast<int64_t>(red.esz);
  return start(new Call{.head = callHeader(type, red.dtype, 0, bytes, numel, &red),
                        .body = &ProcessGroupACCL::allreduceBody, .inputs = tensors, .outputs = tensors, .red = &red},
               type, engineFor(OpType::ALLREDUCE, red.dtype, red.op), bytes, asyncOp);
}

WorkPtr ProcessGroupACCL::allreduce_sparse(Tensors& tensors, const c10d::AllreduceOptions& opts) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "accl: all_reduce takes exactly one tensor per call, got ", tensors.size());
  const at::Tensor& t = tensors[0];
  TORCH_CHECK_TYPE(t.layout() == at::kSparse, "accl: sparse all_reduce needs a sparse COO tensor");
  TORCH_CHECK_VALUE(opts.reduceOp.op_ == RedOpType::SUM, "accl: sparse all_reduce supports ReduceOp.SUM only (as ",
                    "gloo), got ReduceOp.", opName(opts.reduceOp.op_));
  checkOpen();
  Call* c = new Call{.head = callHeader(OpType::ALLREDUCE, t.scalar_type(), 0, 0, t.numel()),
                     .body = &ProcessGroupACCL::sparseBody, .inputs = tensors, .outputs = tensors};
  c->head.op = wire::opCode(opts.reduceOp.op_);
  c->head.extra = t.sparse_dim();
  return start(c, OpType::_ALLREDUCE_SPARSE, engineFor(OpType::ALLREDUCE), 0, opts.asyncOp);
}

// Every rank's (indices, values) all-gathered, then summed by coalescing (gloo's algorithm): the header checks dtype
// and dense size; the nnz counts travel first.
void ProcessGroupACCL::sparseBody(Call& c) {
  const at::Tensor& t = c.outputs[0];
  const int p = size_;
  header(c);
  blocking(c, [&] {
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
    c.dst = at::sparse_coo_tensor(allIndices.t(), allValues, t.sizes()).coalesce();
  });
  at::Tensor(t).copy_(c.dst.to(t.device()));
}

// ============================================================================================== broadcast, reduce

// The root's tensor (staged on the root only); carried from the root through the header exchange when small, else
// the engine's broadcast segment by segment.
void ProcessGroupACCL::broadcastBody(Call& c) {
  const int root = static_cast<int>(c.head.root);
  c.src = host(c.outputs[0], rank_ == root);
  if (!header(c, {Ride::kBroadcast, ptr(c.src), c.head.nbytes, nullptr, root})) {
    blocking(c, [&] {
      forSegments(OpType::BROADCAST, c.src.numel(), c.src.element_size(),
                  [&](int64_t off, int64_t cnt) { c.eng->broadcast(seg(c.src, off, cnt), root); });
    });
  }
  if (rank_ != root) deliver(c.src, c.outputs[0]);
}

WorkPtr ProcessGroupACCL::broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = one(tensors, "broadcast");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "accl: broadcast rootTensor must be 0, got ", opts.rootTensor);
  checkRank(opts.rootRank, "broadcast", "root");
  checkOpen();
  const int64_t bytes = t.nbytes();
  return start(new Call{.head = callHeader(OpType::BROADCAST, t.scalar_type(), opts.rootRank, bytes, t.numel()),
                        .body = &ProcessGroupACCL::broadcastBody, .inputs = tensors, .outputs = tensors},
               OpType::BROADCAST, engineFor(OpType::BROADCAST, t.scalar_type()), bytes, opts.asyncOp);
}

// Every rank's tensor reduced into the root's by the engine, segment by segment; the others' are left as they were.
void ProcessGroupACCL::reduceBody(Call& c) {
  const Reduction& red = *c.red;
  const int root = static_cast<int>(c.head.root);
  c.src = host(c.outputs[0], true);
  header(c);
  blocking(c, [&] {
    forSegments(OpType::REDUCE, c.src.numel(), red.esz,
                [&](int64_t off, int64_t cnt) { c.eng->reduce(seg(c.src, off, cnt), red, root); });
  });
  if (rank_ != root) return;
  if (red.avg) c.src.div_(size_);
  deliver(c.src, c.outputs[0]);
}

WorkPtr ProcessGroupACCL::reduce(Tensors& tensors, const c10d::ReduceOptions& opts) {
  const at::Tensor& t = one(tensors, "reduce");
  checkRank(opts.rootRank, "reduce", "root");
  const Reduction& red = reductionFor(t.scalar_type(), opts.reduceOp.op_, "reduce");
  checkOpen();
  const int64_t bytes = t.numel() * static_cast<int64_t>(red.esz);
  return start(new Call{.head = callHeader(OpType::REDUCE, red.dtype, opts.rootRank, bytes, t.numel(), &red),
                        .body = &ProcessGroupACCL::reduceBody, .inputs = tensors, .outputs = tensors, .red = &red},
               OpType::REDUCE, engineFor(OpType::REDUCE, red.dtype, red.op), bytes, opts.asyncOp);
}

// ============================================================================================== all_gather

// Into one host buffer of p rows (the output tensor's own memory where it can be): this rank's row placed first and
// the others gathered in the header exchange when small, else the engine's all_gather segment by segment (every
// row's segment at once); then into the output tensor or list.
void ProcessGroupACCL::allgatherBody(Call& c) {
  const int p = size_;
  const int64_t n = c.inputs[0].numel(), esz = c.inputs[0].element_size();
  c.src = host(c.inputs[0], true);
  c.dst = c.outputs.size() == 1 ? host(c.outputs[0], false) : at::empty({p * n}, c.src.options());
  char* mine = ptr(c.dst) + rank_ * n * esz;
  if (c.path == Path::kCarried && ptr(c.src) != mine) std::memcpy(mine, ptr(c.src), n * esz);
  if (!header(c, {Ride::kGather, ptr(c.dst), n * esz})) {
    blocking(c, [&] {
      forSegments(OpType::ALLGATHER, n, esz * p, [&](int64_t off, int64_t cnt) {
        c.eng->allgather(seg(c.src, off, cnt), seg(c.dst, off, cnt, p, n));
      });
    });
  }
  deliverEach(c.dst, c.outputs);
}

WorkPtr ProcessGroupACCL::allgatherStart(const at::Tensor& input, Tensors outputs, OpType type, bool asyncOp) {
  checkOpen();
  const int64_t n = input.numel(), esz = input.element_size();
  return start(new Call{.head = callHeader(OpType::ALLGATHER, input.scalar_type(), 0, n * esz, n),
                        .body = &ProcessGroupACCL::allgatherBody, .inputs = {input}, .outputs = std::move(outputs)},
               type, engineFor(OpType::ALLGATHER, input.scalar_type()), n * esz * size_, asyncOp);
}

WorkPtr ProcessGroupACCL::_allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  checkSameDtype(output, input, "all_gather_into_tensor");
  checkWhole(output, input, "all_gather_into_tensor", "output", "input");
  return allgatherStart(input, {output}, OpType::_ALLGATHER_BASE, opts.asyncOp);
}

WorkPtr ProcessGroupACCL::allgather(std::vector<Tensors>& outputs, Tensors& inputs,
                                    const c10d::AllgatherOptions& opts) {
  const at::Tensor& input = one(inputs, "all_gather");
  TORCH_CHECK_VALUE(outputs.size() == 1, "accl: all_gather takes one output list, got ", outputs.size());
  checkList(outputs[0], input, "all_gather", "output_tensor_list");
  return allgatherStart(input, outputs[0], OpType::ALLGATHER, opts.asyncOp);
}

WorkPtr ProcessGroupACCL::allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  checkPairs(outputs.size(), inputs.size(), "all_gather_into_tensor");
  WorkPtr last;  // collectives complete in issue order: the last one's Work covers them all
  for (size_t i = 0; i < inputs.size(); ++i) last = _allgather_base(outputs[i], inputs[i], opts);
  return last;
}

WorkPtr ProcessGroupACCL::allgather_coalesced(std::vector<Tensors>& outputLists, Tensors& inputs,
                                              const c10d::AllgatherOptions& opts) {
  // outputLists[r][j] receives rank r's inputs[j] (torch's layout: one list per rank)
  bool shaped = !inputs.empty() && static_cast<int>(outputLists.size()) == size_;
  for (const auto& l : outputLists) shaped = shaped && l.size() == inputs.size();
  TORCH_CHECK_VALUE(shaped, "accl: all_gather_coalesced needs at least one input tensor and ", size_,
                    " output lists (one per rank), each with one tensor per input tensor (", inputs.size(), ")");
  WorkPtr last;
  for (size_t j = 0; j < inputs.size(); ++j) {
    std::vector<Tensors> outs(1);
    for (const auto& l : outputLists) outs[0].push_back(l[j]);
    Tensors in{inputs[j]};
    last = allgather(outs, in, opts);
  }
  return last;
}

// ============================================================================================== reduce_scatter

// Every rank's p blocks staged end to end.  Small: the whole input reduced in the header exchange, in a buffer the
// group keeps (the caller's input stays as given; calls run one at a time), and this rank's block taken.  Else accl's
// ring or the engine's reduce_scatter segment by segment (every block's segment at once).
void ProcessGroupACCL::reduceScatterBody(Call& c) {
  const Reduction& red = *c.red;
  const int p = size_;
  const int64_t n = c.outputs[0].numel(), bytes = n * static_cast<int64_t>(red.esz);
  c.src = flatHost(c.inputs);
  c.dst = host(c.outputs[0], false);
  if (c.path == Path::kCarried) {
    char* whole = carryBuffer();
    std::memcpy(whole, ptr(c.src), bytes * p);
    header(c, {Ride::kReduce, whole, bytes * p, &red});
    std::memcpy(ptr(c.dst), whole + rank_ * bytes, bytes);
  } else {
    header(c);
    blocking(c, [&] {
      if (c.path == Path::kRing) return ring(red, n * p, nullptr, ptr(c.src), ptr(c.dst));
      forSegments(OpType::REDUCE_SCATTER, n, red.esz * p, [&](int64_t off, int64_t cnt) {
        c.eng->reduceScatter(seg(c.src, off, cnt, p, n), seg(c.dst, off, cnt), red);
      });
    });
  }
  if (red.avg) c.dst.div_(p);
  deliver(c.dst, c.outputs[0]);
}

WorkPtr ProcessGroupACCL::reduceScatterStart(Tensors inputs, const at::Tensor& output, c10d::ReduceOp op, OpType type,
                                             bool asyncOp) {
  const Reduction& red = reductionFor(output.scalar_type(), op.op_, "reduce_scatter");
  checkOpen();
  const int64_t n = output.numel(), bytes = n * static_cast<int64_t>(red.esz);
  return start(new Call{.head = callHeader(OpType::REDUCE_SCATTER, red.dtype, 0, bytes, n, &red),
                        .body = &ProcessGroupACCL::reduceScatterBody, .inputs = std::move(inputs),
                        .outputs = {output}, .red = &red},
               type, engineFor(OpType::REDUCE_SCATTER, red.dtype, red.op), bytes * size_, asyncOp);
}

WorkPtr ProcessGroupACCL::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                               const c10d::ReduceScatterOptions& opts) {
  checkSameDtype(output, input, "reduce_scatter_tensor");
  checkWhole(input, output, "reduce_scatter_tensor", "input", "output");
  return reduceScatterStart({input}, output, opts.reduceOp, OpType::_REDUCE_SCATTER_BASE, opts.asyncOp);
}

WorkPtr ProcessGroupACCL::reduce_scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                                         const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& output = one(outputs, "reduce_scatter");
  TORCH_CHECK_VALUE(inputs.size() == 1, "accl: reduce_scatter takes one input list");
  checkList(inputs[0], output, "reduce_scatter", "input_list");
  return reduceScatterStart(inputs[0], output, opts.reduceOp, OpType::REDUCE_SCATTER, opts.asyncOp);
}

WorkPtr ProcessGroupACCL::reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                          const c10d::ReduceScatterOptions& opts) {
  checkPairs(outputs.size(), inputs.size(), "reduce_scatter_tensor");
  WorkPtr last;
  for (size_t i = 0; i < inputs.size(); ++i) last = _reduce_scatter_base(outputs[i], inputs[i], opts);
  return last;
}

// ============================================================================================== gather, scatter

// Rows to the root (gather) or from it (scatter): every rank's one tensor, and on the root p rows in one host buffer;
// the engine's call segment by segment (every row's segment at once).
void ProcessGroupACCL::rootedBody(Call& c) {
  const bool toRoot = c.head.kind == static_cast<int64_t>(T::GATHER), isRoot = rank_ == c.head.root;
  const int root = static_cast<int>(c.head.root), p = size_;
  const at::Tensor& mine = toRoot ? c.inputs[0] : c.outputs[0];
  const Tensors& rows = toRoot ? c.outputs : c.inputs;  // the root's list
  const int64_t n = mine.numel(), esz = mine.element_size();
  c.src = host(mine, toRoot);
  if (isRoot) c.dst = toRoot ? at::empty({p * n}, c.src.options()) : flatHost(rows);
  header(c);
  blocking(c, [&] {
    forSegments(toRoot ? OpType::GATHER : OpType::SCATTER, n, esz * p, [&](int64_t off, int64_t cnt) {
      const Seg part = seg(c.src, off, cnt), block = seg(c.dst, off, cnt, p, n);
      if (toRoot) c.eng->gather(part, block, root);
      else c.eng->scatter(block, part, root);
    });
  });
  if (!toRoot) deliver(c.src, mine);
  else if (isRoot) deliverEach(c.dst, rows);
}

WorkPtr ProcessGroupACCL::rootedStart(OpType kind, const Tensors& mineList, const std::vector<Tensors>& lists,
                                      int64_t root, bool asyncOp) {
  const bool toRoot = kind == OpType::GATHER;
  const char* what = toRoot ? "gather" : "scatter";
  const at::Tensor& mine = one(mineList, what);
  checkRank(root, what, "root");
  Tensors rows = rootList(lists, mine, root, what, toRoot ? "gather_list" : "scatter_list");
  checkOpen();
  const int64_t n = mine.numel(), esz = mine.element_size();
  Tensors one{mine};
  return start(new Call{.head = callHeader(kind, mine.scalar_type(), root, n * esz, n),
                        .body = &ProcessGroupACCL::rootedBody, .inputs = toRoot ? one : rows,
                        .outputs = toRoot ? rows : one},
               kind, engineFor(kind, mine.scalar_type()), n * esz * size_, asyncOp);
}

WorkPtr ProcessGroupACCL::gather(std::vector<Tensors>& outputs, Tensors& inputs, const c10d::GatherOptions& opts) {
  return rootedStart(OpType::GATHER, inputs, outputs, opts.rootRank, opts.asyncOp);
}

WorkPtr ProcessGroupACCL::scatter(Tensors& outputs, std::vector<Tensors>& inputs, const c10d::ScatterOptions& opts) {
  return rootedStart(OpType::SCATTER, outputs, inputs, opts.rootRank, opts.asyncOp);
}

// ============================================================================================== all_to_all

void ProcessGroupACCL::checkSplits(const std::vector<int64_t>& sizes, const at::Tensor& t, const char* name) const {
  const int64_t p = size_, rows = t.dim() ? t.size(0) : 1;
  const char* what = "accl: all_to_all_single ";
  if (sizes.empty()) {
    TORCH_CHECK_VALUE(t.dim() && t.size(0) % p == 0, what, name, " of size ", t.sizes(),
                      ": dim 0 is not divisible by world_size ", p, "; pass split sizes");
    return;
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(sizes.size()) == p, what, name, "_split_sizes has ", sizes.size(),
                    " entries, world_size is ", p);
  for (int64_t s : sizes) TORCH_CHECK_VALUE(s >= 0, what, name, "_split_sizes must be >= 0");
  const int64_t sum = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  TORCH_CHECK_VALUE(sum == rows, what, name, "_split_sizes sum to ", sum, " but ", name, " has ", rows, " rows");
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
}  // namespace

// Every rank's byte counts (to each rank, then from each) gathered with the header while p rows of 16p bytes fit
// wire::carryBytes (32 ranks on one node, 63 across nodes) and checked against each other.  Beyond, the whole
// matrix would grow as p^2 (16 MiB per rank at 1,024 ranks): each rank checks its own column instead, what every
// rank sends it (an all-to-all of one count each) against what it expects, and one all-reduce agrees on the verdict
// and the largest and smallest count; only a mismatch gathers the matrix, for the error every rank raises.  Then
// MPI's all-to-all segment by segment: without counts where every rank sends every rank the same bytes in one
// segment (MPICH runs it 2-3x faster than Alltoallv at 1-4 MiB).
void ProcessGroupACCL::alltoallBody(Call& c) {
  const int p = size_;
  const int64_t row = 16 * p;
  int64_t received = 0, most = 0;
  for (const auto& t : c.outputs) received += t.numel();
  c.src = flatHost(c.inputs);
  c.dst = c.outputs.size() == 1 ? host(c.outputs[0], false) : at::empty({received}, c.src.options());
  std::vector<int64_t> mine(c.sendBytes), toMe(p);
  mine.insert(mine.end(), c.recvBytes.begin(), c.recvBytes.end());
  bool even = false;
  if (p * row <= wire::carryBytes(spansNodes_)) {
    char* all = carryBuffer();
    std::memcpy(all + rank_ * row, mine.data(), row);
    exchange(c, {Ride::kGather, all, row});
    most = checkAlltoallMatrix(reinterpret_cast<const int64_t*>(all), 2 * p, p, &even);
  } else {
    exchange(c, {});
    blocking(c, [&] {
      mpi_->alltoall(c.sendBytes.data(), sizeof(int64_t), toMe.data());
      // over this rank's sends and expected receives: "even" then holds for its own buffers whatever a peer says
      int64_t v[3] = {*std::max_element(mine.begin(), mine.end()), -*std::min_element(mine.begin(), mine.end()),
                      toMe != c.recvBytes};
      mpi_->allreduce({reinterpret_cast<char*>(v), 3, at::kLong}, reductionFor(at::kLong, RedOpType::MAX, "a2a"));
      std::tie(most, even) = std::pair{v[0], v[0] == -v[1]};
      if (!v[2]) return;
      std::vector<int64_t> all(2 * p * p);
      mpi_->allgather({reinterpret_cast<char*>(mine.data()), row}, {reinterpret_cast<char*>(all.data()), row,
                                                                     at::kByte, p, row});
      checkAlltoallMatrix(all.data(), 2 * p, p, &even);  // raises the mismatch
    });
  }
  blocking(c, [&] {
    forSegments(OpType::ALLTOALL, most, p, [&](int64_t done, int64_t per) {  // up to `per` bytes to/from each rank
      if (even && per >= most) return mpi_->alltoall(ptr(c.src), static_cast<int>(most), ptr(c.dst));
      std::vector<int> sc(p), sd(p), rc(p), rd(p);
      alltoallSegment(c.sendBytes, done, per, sc, sd);
      alltoallSegment(c.recvBytes, done, per, rc, rd);
      mpi_->alltoallv(ptr(c.src), sc.data(), sd.data(), ptr(c.dst), rc.data(), rd.data());
    });
  });
  if (c.outputs.size() > 1 || c.outputs[0].numel()) deliverEach(c.dst, c.outputs);
}

WorkPtr ProcessGroupACCL::alltoallStart(Tensors inputs, Tensors outputs, std::vector<int64_t> sendBytes,
                                        std::vector<int64_t> recvBytes, OpType type, bool asyncOp) {
  Call* c = new Call{.head = callHeader(OpType::ALLTOALL, inputs[0].scalar_type(), 0, 0, 0),
                     .compare = wire::kCompareCall,  // sizes are checked on the byte matrix
                     .body = &ProcessGroupACCL::alltoallBody, .inputs = std::move(inputs),
                     .outputs = std::move(outputs), .sendBytes = std::move(sendBytes),
                     .recvBytes = std::move(recvBytes)};
  c->head.extra = size_;
  return start(c, type, engineFor(OpType::ALLTOALL), 0, asyncOp);
}

WorkPtr ProcessGroupACCL::alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
                                        std::vector<int64_t>& inputSplits, const c10d::AllToAllOptions& opts) {
  checkSameDtype(output, input, "all_to_all_single");
  checkSplits(inputSplits, input, "input");
  checkSplits(outputSplits, output, "output");
  checkOpen();
  std::vector<int64_t> sb(size_), rb(size_), offsets(size_);
  c10d::computeLengthsAndOffsets(inputSplits, input, &sb, &offsets);  // elements, to bytes below
  c10d::computeLengthsAndOffsets(outputSplits, output, &rb, &offsets);
  for (auto* v : {&sb, &rb})
    for (auto& x : *v) x *= input.element_size();
  return alltoallStart({input}, {output}, std::move(sb), std::move(rb), OpType::ALLTOALL_BASE, opts.asyncOp);
}

WorkPtr ProcessGroupACCL::alltoall(Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) {
  const size_t p = static_cast<size_t>(size_);
  TORCH_CHECK_VALUE(outputs.size() == p && inputs.size() == p, "accl: all_to_all needs ", p, " input and ", p,
                    " output tensors, got ", inputs.size(), " and ", outputs.size());
  for (const auto* list : {&inputs, &outputs})
    for (const auto& t : *list)
      TORCH_CHECK_TYPE(t.scalar_type() == inputs[0].scalar_type(), "accl: all_to_all needs every tensor of one dtype");
  checkOpen();
  std::vector<int64_t> sb, rb;
  for (const auto& t : inputs) sb.push_back(static_cast<int64_t>(t.nbytes()));
  for (const auto& t : outputs) rb.push_back(static_cast<int64_t>(t.nbytes()));
  return alltoallStart(inputs, outputs, std::move(sb), std::move(rb), OpType::ALLTOALL, opts.asyncOp);
}

// ============================================================================================== barrier

// The header exchange is itself a full synchronisation.
void ProcessGroupACCL::barrierBody(Call& c) {
  header(c);
}

WorkPtr ProcessGroupACCL::barrier(const c10d::BarrierOptions& opts) {
  checkOpen();
  Call* c = new Call{.head = callHeader(OpType::BARRIER, at::kByte, 0, 0, 0), .body = &ProcessGroupACCL::barrierBody};
  c->head.dtype = 0;
  return start(c, OpType::BARRIER, engineFor(OpType::BARRIER), 0, opts.asyncOp);
}

// ============================================================================================== the MPI engine
// One blocking MPI call per segment on host buffers, made once the header exchange proved every rank arrived.

void Engine::send(const Seg&, int, int) {
  throw c10::NotImplementedError("accl: the " + name() + " engine has no send");
}

void Engine::recv(const Seg&, int, int) {
  throw c10::NotImplementedError("accl: the " + name() + " engine has no recv");
}

MpiEngine::MpiEngine(MPI_Comm comm) : Engine("mpi"), comm_(comm) {
  ACCL_MPI(MPI_Comm_rank, comm, &rank_);
  ACCL_MPI(MPI_Comm_size, comm, &size_);
}

void MpiEngine::allreduce(const Seg& b, const Reduction& r) {
  ACCL_MPI(MPI_Allreduce, MPI_IN_PLACE, b.data, static_cast<int>(b.count), r.type, r.mpiOp, comm_);
}

void MpiEngine::reduce(const Seg& b, const Reduction& r, int root) {
  // the root reduces in place; the others' buffers are only read
  const void* s = rank_ == root ? MPI_IN_PLACE : b.data;
  void* d = rank_ == root ? b.data : nullptr;
  ACCL_MPI(MPI_Reduce, s, d, static_cast<int>(b.count), r.type, r.mpiOp, root, comm_);
}

void MpiEngine::broadcast(const Seg& b, int root) {
  ACCL_MPI(MPI_Bcast, b.data, static_cast<int>(b.bytes()), MPI_BYTE, root, comm_);
}

void MpiEngine::blocks(const Seg& rows, int bytes) {
  const int64_t stride = rows.data ? rows.stride : bytes;
  TORCH_CHECK_VALUE(stride * (size_ - 1) <= INT_MAX, "accl: a strided block lies beyond MPI's int displacements");
  counts_.assign(size_, bytes);
  displs_.resize(size_);
  for (int r = 0; r < size_; ++r) displs_[r] = static_cast<int>(r * stride);
}

void MpiEngine::allgather(const Seg& send, const Seg& rows) {
  const int bytes = static_cast<int>(send.bytes());
  // the input already in place (all_gather_into_tensor of a shard of the output, as FSDP calls it)
  const void* s = send.data == rows.row(rank_) ? MPI_IN_PLACE : send.data;
  if (rows.stride == bytes) {
    ACCL_MPI(MPI_Allgather, s, bytes, MPI_BYTE, rows.data, bytes, MPI_BYTE, comm_);
    return;
  }
  blocks(rows, bytes);  // rank r's block at rows.row(r)
  ACCL_MPI(MPI_Allgatherv, s, bytes, MPI_BYTE, rows.data, counts_.data(), displs_.data(), MPI_BYTE, comm_);
}

void MpiEngine::gather(const Seg& send, const Seg& rows, int root) {
  const int bytes = static_cast<int>(send.bytes());
  blocks(rows, bytes);
  ACCL_MPI(MPI_Gatherv, send.data, bytes, MPI_BYTE, rows.data, counts_.data(), displs_.data(), MPI_BYTE, root, comm_);
}

void MpiEngine::scatter(const Seg& rows, const Seg& recv, int root) {
  const int bytes = static_cast<int>(recv.bytes());
  blocks(rows, bytes);
  ACCL_MPI(MPI_Scatterv, rows.data, counts_.data(), displs_.data(), MPI_BYTE, recv.data, bytes, MPI_BYTE, root, comm_);
}

void MpiEngine::reduceScatter(const Seg& rows, const Seg& recv, const Reduction& r) {
  const int64_t bytes = recv.bytes();
  char* src = rows.data;
  if (rows.stride != bytes) {  // a segment of every rank's block: its rows copied together, into a kept buffer
    if (!scratch_.defined() || static_cast<int64_t>(scratch_.nbytes()) < bytes * size_)
      scratch_ = at::empty({bytes * size_}, at::TensorOptions().dtype(at::kByte));
    src = ptr(scratch_);
    for (int k = 0; k < size_; ++k) std::memcpy(src + k * bytes, rows.row(k), bytes);
  }
  ACCL_MPI(MPI_Reduce_scatter_block, src, recv.data, static_cast<int>(recv.count), r.type, r.mpiOp, comm_);
}

void MpiEngine::alltoall(const void* src, int bytes, void* dst) {
  ACCL_MPI(MPI_Alltoall, src, bytes, MPI_BYTE, dst, bytes, MPI_BYTE, comm_);
}

void MpiEngine::alltoallv(const void* src, const int* sc, const int* sd, void* dst, const int* rc, const int* rd) {
  ACCL_MPI(MPI_Alltoallv, src, sc, sd, MPI_BYTE, dst, rc, rd, MPI_BYTE, comm_);
}

void MpiEngine::allgatherv(const void* src, int bytes, void* dst, const int* counts, const int* displs) {
  ACCL_MPI(MPI_Allgatherv, src, bytes, MPI_BYTE, dst, counts, displs, MPI_BYTE, comm_);
}

}  // namespace torchhpc::accl
