// DISCO contraction family binary: one register tile of the CPU DISCO kernels per build, run
// through the shared measurement protocol (harness.hpp). Defines (tilecast/families/disco.py
// sets them from the kernel name):
//   TC_DISCO_DIR      0 forward contraction, 1 transpose (backward) contraction
//   TC_DISCO_VARIANT  0 csr (disco_csr_forward.hpp / disco_csr_transpose.hpp), 1 kpacked
//                     (disco_kpacked.hpp, forward only), 2 lines (disco_lines_transpose.hpp,
//                     transpose only)
//   TC_DISCO_ISA      1 AVX-512, 0 AVX2: must be the ISA this build targets (-march)
//   TC_BT, TC_NV      csr: the register tile, BT channels x NV vectors of output longitudes, a
//                     row of disco_csr_variants.hpp (so the runtime can run it too); TC_KREG 0
//   TC_KREG, TC_NV    kpacked: KREG basis functions x NV vectors, a row of
//                     disco_kpacked_variants.hpp; TC_BT 1
//   TC_LB, TC_NV      lines: LB input lines x NV vectors, the kernel's one tile (kLineBlock x
//                     kLineVectors); TC_BT 1, TC_KREG 0, TC_LAT_BLOCK 1; TC_LB 0 otherwise
//   TC_LAT_BLOCK      latitudes per work item (output latitudes forward, input backward)
// Job line (precision fp32 | bf16 | fp16: the storage of the input and of the kernel's output):
//   forward:   <id> <precision> <bc> <hi> <wi> <k> <ho> <wo> <nnz> <offsets> <columns> <values>
//              <nbr> <kpad> <kp_offset> <kp_idx> <kp_vals> <in> <out>
//   transpose: <id> <precision> <bc> <hi> <wi> <k> <ho> <wo> <nnz> <offsets> <columns> <values>
//              <keys> <boff> <bcol> <bvals> <in> <out>
// forward: psi's CSR (roff [k*ho + 1], col int64 [nnz], vals float32 [nnz]) and its kpacked
// layout (offset int64 [ho + 1], idx int64 [nbr, 2], vals float32 [nbr, kpad]; `0 0 - - -`
// where psi has none: a kpacked build answers UNSUPPORTED), in = x (bc, hi, wi); transpose:
// the transposed CSR (troff [hi*s + 1], tcol, tvals) and its line-blocked regrouping (boff
// [ceil(hi*s / LB) + 1], bcol int64 [keys], bvals float32 [keys, LB];
// tilecast/disco/lines.py), in = gy (bc, k, ho, wo). Each build
// reads only its variant's layout. Inputs are raw little-endian values of the precision; the
// output is written as float32. A timed call decodes psi's columns (neighbours) and runs the
// kernel, as the runtime entry does per call.
#include <omp.h>

#include <cstdint>
#include <string>
#include <vector>

#include "disco_csr_decode.hpp"
#include "disco_csr_variants.hpp"
#include "disco_kpacked_variants.hpp"
#include "disco_lines_transpose.hpp"
#include "../common/harness.hpp"

#if !defined(TC_DISCO_DIR) || !defined(TC_DISCO_VARIANT) || !defined(TC_DISCO_ISA) || \
    !defined(TC_BT) || !defined(TC_KREG) || !defined(TC_LB) || !defined(TC_NV) ||     \
    !defined(TC_LAT_BLOCK)
#error "define TC_DISCO_DIR, TC_DISCO_VARIANT, TC_DISCO_ISA, TC_BT, TC_KREG, TC_LB, TC_NV and TC_LAT_BLOCK"
#endif
#if (TC_DISCO_ISA == 1) != defined(__AVX512F__)
#error "TC_DISCO_ISA names another ISA than this build targets (AVX-512 iff __AVX512F__)"
#endif
#if TC_DISCO_VARIANT != 0 && TC_DISCO_VARIANT != 1 && TC_DISCO_VARIANT != 2
#error "unknown TC_DISCO_VARIANT (0: csr, 1: kpacked, 2: lines)"
#endif

namespace tc::disco {
namespace {

constexpr int kDir = TC_DISCO_DIR;
constexpr int kVariant = TC_DISCO_VARIANT;
constexpr index_t kLatBlock = TC_LAT_BLOCK;
static_assert(kDir == 0 || kDir == 1, "TC_DISCO_DIR must be 0 (forward) or 1 (transpose)");
static_assert(kLatBlock >= 1, "TC_LAT_BLOCK must be positive");
static_assert(kDir == 1 || TC_BT == 1, "the forward tile has one channel (TC_BT = 1)");
static_assert(TC_DISCO_VARIANT == 2 || TC_LB == 0, "only lines tiles name LB (TC_LB = 0)");
#if TC_DISCO_VARIANT == 0
static_assert(TC_KREG == 0, "csr tiles hold one basis function per row (TC_KREG = 0)");
static_assert(kDir == 0 ? has_tile(Variants<float>::forward_tiles, TC_BT, TC_NV)
                        : has_tile(Variants<float>::transpose_tiles, TC_BT, TC_NV),
              "TC_BT x TC_NV is not a tile of disco_csr_variants.hpp for this direction and ISA");
#elif TC_DISCO_VARIANT == 1
static_assert(kDir == 0, "the kpacked variant is a forward contraction (TC_DISCO_DIR = 0)");
static_assert(has_packed(PackedVariants<float>::tiles, TC_KREG, TC_NV),
              "TC_KREG x TC_NV is not a tile of disco_kpacked_variants.hpp for this ISA");
#else
static_assert(kDir == 1, "the lines variant is a transpose contraction (TC_DISCO_DIR = 1)");
static_assert(TC_LB == kLineBlock && TC_NV == kLineVectors,
              "TC_LB x TC_NV is not the line-blocked transpose's tile for this ISA "
              "(kLineBlock x kLineVectors, disco_lines_transpose.hpp)");
static_assert(TC_BT == 1 && TC_KREG == 0 && kLatBlock == 1,
              "lines tiles name LB and NV only (TC_BT = 1, TC_KREG = 0, TC_LAT_BLOCK = 1)");
#endif

constexpr std::size_t kJobTokens = kDir == 0 ? 19 : 18;
constexpr const char* kJobHelp =
    kDir == 0 ? "<id> <precision> <bc> <hi> <wi> <k> <ho> <wo> <nnz> <offsets> <columns> "
                "<values> <nbr> <kpad> <kp_offset> <kp_idx> <kp_vals> <in> <out>"
              : "<id> <precision> <bc> <hi> <wi> <k> <ho> <wo> <nnz> <offsets> <columns> "
                "<values> <keys> <boff> <bcol> <bvals> <in> <out>";
// where the input and output paths are: the last two tokens
constexpr std::size_t kIn = kJobTokens - 2, kOut = kJobTokens - 1;

index_t parse_size(const std::string& name, const std::string& text) {
  try {
    std::size_t used = 0;
    const long long value = std::stoll(text, &used);
    if (used == text.size() && value >= 0) return value;
  } catch (const std::exception&) {
  }
  throw std::invalid_argument(name + " must be a non-negative integer, got '" + text + "'");
}

/// One job's inputs read from disk: psi's (transposed) CSR and the activations.
template <typename Elem>
struct Inputs {
  std::vector<std::int64_t> offsets, columns;
  std::vector<float> values;
  std::vector<Elem> in;
};

/// Writes a kernel's output as float32 (what the family reads back).
template <typename Elem>
void write_output(const std::string& path, const std::vector<Elem>& out) {
  std::vector<float> as_float(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) as_float[i] = to_float(out[i]);
  write_binary(path, as_float.data(), as_float.size());
}

/// Times the compiled csr tile on one job and writes its output as float32.
template <typename Elem>
JobResult run_csr(const std::vector<std::string>& tokens, const Dims& d, index_t nnz,
                  const Protocol& protocol) {
  const index_t rows = kDir == 0 ? d.k * d.ho : d.hi * d.stride();
  const index_t in_count = kDir == 0 ? d.bc * d.hi * d.wi : d.bc * d.k * d.ho * d.wo;
  const index_t out_count = kDir == 0 ? d.bc * d.k * d.ho * d.wo : d.bc * d.hi * d.wi;
  Inputs<Elem> inputs{read_binary<std::int64_t>(tokens[9], std::size_t(rows + 1)),
                      read_binary<std::int64_t>(tokens[10], std::size_t(nnz)),
                      read_binary<float>(tokens[11], std::size_t(nnz)),
                      read_binary<Elem>(tokens[kIn], std::size_t(in_count))};
  if (check_offsets(inputs.offsets.data(), rows, nnz) != kOk)
    return JobResult::error("bad CSR offsets: they must start at 0, never decrease and end at nnz");
  std::vector<Elem> out(out_count);
  std::vector<std::int32_t> line(nnz), quot(nnz);
  const int threads = omp_get_max_threads();
  bool decoded = true;
  auto call = [&] {
    if constexpr (kDir == 0) {
      decoded = decode_forward(inputs.columns.data(), nnz, d, threads, line.data(), quot.data());
      forward_blocked<TC_NV, Elem>(inputs.in.data(), out.data(), d, inputs.offsets.data(),
                                   line.data(), quot.data(), inputs.values.data(), threads,
                                   kLatBlock);
    } else {
      decoded = decode_transpose(inputs.columns.data(), nnz, d, threads, quot.data());
      transpose_blocked<TC_BT, TC_NV, Elem>(inputs.in.data(), out.data(), d,
                                            inputs.offsets.data(), inputs.columns.data(),
                                            quot.data(), inputs.values.data(), threads, kLatBlock);
    }
  };
  // check the columns once before timing: an out-of-range entry would read out of bounds
  decoded = kDir == 0
                ? decode_forward(inputs.columns.data(), nnz, d, threads, line.data(), quot.data())
                : decode_transpose(inputs.columns.data(), nnz, d, threads, quot.data());
  if (!decoded) return JobResult::error("a psi column lies outside the grid");
  Timing timing = measure(protocol, call);
  write_output(tokens[kOut], out);
  return JobResult::ok(std::move(timing));
}

/// Times the compiled kpacked tile on one job (all output latitudes, K_PAD from the job line)
/// and writes its output as float32.
template <typename Elem>
JobResult run_kpacked(const std::vector<std::string>& tokens, const Dims& d,
                      const Protocol& protocol) {
  const index_t nbr = parse_size("nbr", tokens[12]), kpad = parse_size("kpad", tokens[13]);
  if (nbr == 0)
    return JobResult::unsupported("psi has no kpacked layout (its basis functions' supports "
                                  "differ, or it has no entries)");
  if ((kpad != 8 && kpad != 16) || kpad < d.k)
    return JobResult::error("kpad=" + std::to_string(kpad) + " must be 8 or 16 and at least k");
  const auto offset = read_binary<std::int64_t>(tokens[14], std::size_t(d.ho + 1));
  const auto idx = read_binary<std::int64_t>(tokens[15], std::size_t(2 * nbr));
  const auto vals = read_binary<float>(tokens[16], std::size_t(nbr * kpad));
  const auto in = read_binary<Elem>(tokens[kIn], std::size_t(d.bc * d.hi * d.wi));
  if (check_offsets(offset.data(), d.ho, nbr) != kOk)
    return JobResult::error("bad kpacked offsets: they must start at 0, never decrease and end at nbr");
  std::vector<Elem> out(d.bc * d.k * d.ho * d.wo);
  std::vector<std::int32_t> line(nbr), quot(nbr);
  const int threads = omp_get_max_threads();
  // check the neighbours once before timing: one out of range would read out of bounds
  if (!decode_neighbours(idx.data(), 0, nbr, d, threads, line.data(), quot.data()))
    return JobResult::error("a kpacked neighbour lies outside the grid");
  auto call = [&] {
    decode_neighbours(idx.data(), 0, nbr, d, threads, line.data(), quot.data());
    kpacked_forward_blocked<TC_KREG, TC_NV, Elem>(in.data(), out.data(), d, 0, d.ho,
                                                  offset.data(), line.data(), quot.data(),
                                                  vals.data(), kpad, threads, kLatBlock);
  };
  Timing timing = measure(protocol, call);
  write_output(tokens[kOut], out);
  return JobResult::ok(std::move(timing));
}

/// Times the line-blocked transpose on one job (its layout from the job line) and writes its
/// output as float32.
template <typename Elem>
JobResult run_lines(const std::vector<std::string>& tokens, const Dims& d,
                    const Protocol& protocol) {
  const index_t keys = parse_size("keys", tokens[12]);
  const index_t blocks = ceil_div(d.hi * d.stride(), kLineBlock);
  const auto boff = read_binary<std::int64_t>(tokens[13], std::size_t(blocks + 1));
  const auto bcol = read_binary<std::int64_t>(tokens[14], std::size_t(keys));
  const auto bvals = read_binary<float>(tokens[15], std::size_t(keys * kLineBlock));
  const auto in = read_binary<Elem>(tokens[kIn], std::size_t(d.bc * d.k * d.ho * d.wo));
  if (check_offsets(boff.data(), blocks, keys) != kOk)
    return JobResult::error("bad line-block offsets: they must start at 0, never decrease and "
                            "end at keys");
  const index_t columns = d.k * d.ho * d.wo;
  for (index_t e = 0; e < keys; ++e)
    if (bcol[e] < 0 || bcol[e] >= columns)
      return JobResult::error("a line-blocked column lies outside gy");
  std::vector<Elem> out(d.bc * d.hi * d.wi);
  const int threads = omp_get_max_threads();
  // the runtime entry decodes nothing per call either: the layout holds the columns
  auto call = [&] {
    transpose_lines(in.data(), out.data(), d, boff.data(), bcol.data(), bvals.data(), threads);
  };
  Timing timing = measure(protocol, call);
  write_output(tokens[kOut], out);
  return JobResult::ok(std::move(timing));
}

/// The compiled variant on one job of storage type Elem.
template <typename Elem>
JobResult run_typed(const std::vector<std::string>& tokens, const Dims& d, index_t nnz,
                    const Protocol& protocol) {
  // the other variants' kernels are never instantiated (their tile macros are not valid)
  if constexpr (kVariant == 0) {
    return run_csr<Elem>(tokens, d, nnz, protocol);
  } else if constexpr (kVariant == 1) {
    return run_kpacked<Elem>(tokens, d, protocol);
  } else {
    return run_lines<Elem>(tokens, d, protocol);
  }
}

JobResult run_job(const std::vector<std::string>& tokens, const Protocol& protocol) {
  if (tokens.size() != kJobTokens)
    return JobResult::error("expected " + std::to_string(kJobTokens) + " tokens (" + kJobHelp +
                            "), got " + std::to_string(tokens.size()));
  Dims d{};
  index_t nnz = 0;
  try {
    d = Dims{parse_size("bc", tokens[2]), parse_size("hi", tokens[3]), parse_size("wi", tokens[4]),
             parse_size("k", tokens[5]),  parse_size("ho", tokens[6]), parse_size("wo", tokens[7])};
    nnz = parse_size("nnz", tokens[8]);
  } catch (const std::invalid_argument& bad) {
    return JobResult::error(bad.what());
  }
  if (check_dims(d) != kOk)
    return JobResult::unsupported("every size must be positive and wi a multiple of wo");
  const std::string& precision = tokens[1];
  if (precision == "fp32") return run_typed<float>(tokens, d, nnz, protocol);
  if (precision == "bf16") return run_typed<BFloat16>(tokens, d, nnz, protocol);
  if (precision == "fp16") return run_typed<Float16>(tokens, d, nnz, protocol);
  return JobResult::error("unknown precision '" + precision + "'; valid: fp32, bf16, fp16");
}

}  // namespace
}  // namespace tc::disco

int main(int argc, char** argv) {
  return tc::run_jobs(argc, argv, tc::disco::run_job,
                      {{"TC_DISCO_DIR", TC_DISCO_DIR}, {"TC_DISCO_VARIANT", TC_DISCO_VARIANT},
                       {"TC_DISCO_ISA", TC_DISCO_ISA}, {"TC_BT", TC_BT}, {"TC_KREG", TC_KREG},
                       {"TC_LB", TC_LB}, {"TC_NV", TC_NV}, {"TC_LAT_BLOCK", TC_LAT_BLOCK}});
}
