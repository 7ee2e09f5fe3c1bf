// Which (dtype, reduce op) pairs accl reduces and how MPI carries each out (gloo's rules):
// - float32/float64 and the fixed-width integers: MPI's predefined types and ops;
// - bool as one byte per element: SUM, MAX and BOR are OR, PRODUCT, MIN and BAND are AND, BXOR is XOR;
// - float16/bfloat16: 16-bit words reduced by MPI user ops in the tensor's own precision (each result
//   rounded to the dtype, as torch's CPU kernels do), nothing widened on the wire;
// - AVG: SUM then a division by the group size, floating types only; BAND/BOR/BXOR: integer and bool only.
#include "accl.hpp"

#include <cmath>
#include <map>

namespace torchhpc::accl {
namespace {

bool isFloat(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

bool isReducible(at::ScalarType t) {
  return isFloat(t) || t == at::kChar || t == at::kShort || t == at::kInt || t == at::kLong || t == at::kByte ||
         t == at::kBool;
}

template <typename T, RedOpType OP>
void halfOp(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = static_cast<float>(a[i]), y = static_cast<float>(b[i]), r;
    if constexpr (OP == RedOpType::SUM) r = x + y;
    else if constexpr (OP == RedOpType::PRODUCT) r = x * y;
    else if constexpr (OP == RedOpType::MIN) r = (std::isnan(x) || x < y) ? x : y;
    else r = (std::isnan(x) || x > y) ? x : y;
    b[i] = T(r);
  }
}

template <typename T>
MPI_Op halfMpiOp(RedOpType op) {
  MPI_User_function* fn = nullptr;
  switch (op) {
    case RedOpType::SUM: case RedOpType::AVG: fn = &halfOp<T, RedOpType::SUM>; break;
    case RedOpType::PRODUCT: fn = &halfOp<T, RedOpType::PRODUCT>; break;
    case RedOpType::MIN: fn = &halfOp<T, RedOpType::MIN>; break;
    default: fn = &halfOp<T, RedOpType::MAX>; break;
  }
  MPI_Op out = MPI_OP_NULL;
  MPI_Op_create(fn, 1, &out);
  return out;
}

MPI_Datatype mpiType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kChar: return MPI_INT8_T;
    case at::kShort: return MPI_INT16_T;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    default: return t == at::kHalf || t == at::kBFloat16 ? MPI_UINT16_T : MPI_UINT8_T;  // uint8, bool
  }
}

MPI_Op mpiOp(at::ScalarType t, RedOpType op) {
  if (t == at::kHalf) return halfMpiOp<c10::Half>(op);
  if (t == at::kBFloat16) return halfMpiOp<c10::BFloat16>(op);
  // by RedOpType: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR; bool's SUM/MAX are OR, PRODUCT/MIN are AND
  const MPI_Op numeric[] = {MPI_SUM, MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX, MPI_BAND, MPI_BOR, MPI_BXOR};
  const MPI_Op logical[] = {MPI_MAX, MPI_MAX, MPI_MIN, MPI_MIN, MPI_MAX, MPI_BAND, MPI_BOR, MPI_BXOR};
  return (t == at::kBool ? logical : numeric)[static_cast<int>(op)];
}

void checkPair(at::ScalarType t, RedOpType op, const char* what) {
  const std::string dtype = wire::torchName(t);
  TORCH_CHECK_VALUE(op <= RedOpType::BXOR, "accl: ", what, " does not support ReduceOp.", opName(op),
                    " (supported: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR)");
  TORCH_CHECK_TYPE(isReducible(t), "accl: ", what, " cannot reduce dtype ", dtype,
                   "; supported: float16, bfloat16, float32, float64, int8, int16, int32, int64, uint8, bool");
  const bool bitwise = op == RedOpType::BAND || op == RedOpType::BOR || op == RedOpType::BXOR;
  TORCH_CHECK_TYPE(!bitwise || !isFloat(t), "accl: ", what, ": ReduceOp.", opName(op),
                   " is only defined for integer and bool tensors, got ", dtype);
  TORCH_CHECK_TYPE(op != RedOpType::AVG || isFloat(t), "accl: ", what, ": ReduceOp.AVG needs a floating-point tensor ",
                   "(the average of ", dtype, " values is not a ", dtype, "); got ", dtype);
}

}  // namespace

std::string opName(RedOpType op) {  // the wire's names (RedOpType's order), and the ones it never carries
  if (op < 8) return wire::kOpNames[op];
  return op == RedOpType::PREMUL_SUM ? "PREMUL_SUM" : "op#" + std::to_string(static_cast<int>(op));
}

const Reduction& reductionFor(at::ScalarType dtype, RedOpType op, const char* what) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, Reduction> known;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(static_cast<int>(dtype), static_cast<int>(op));
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  checkPair(dtype, op, what);
  Reduction r{dtype, op, c10::elementSize(dtype), op == RedOpType::AVG, mpiType(dtype), mpiOp(dtype, op),
              wire::dtypeCode(dtype), wire::opCode(op)};
  return known.emplace(key, r).first->second;
}

}  // namespace torchhpc::accl
