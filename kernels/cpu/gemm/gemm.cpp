// GEMM family binary: C (fp32, M x N row-major) = A (M x K) * B (K x N).
//
// One variant per build (see gemm_config.hpp for the -D parameters). Job line:
//   <job_id> <M> <N> <K> <row|col A> <row|col B> <a_path> <b_path> <c_path>
// A column-major A is stored as K x M row-major, a column-major B as N x K.
#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include "gemm_config.hpp"
#include "gemm_parallel.hpp"
#include "../common/harness.hpp"

namespace tc::gemm {
namespace {

constexpr std::size_t kJobTokens = 9;

/// Parses a positive dimension token; throws naming the token and value.
long long parse_dim(const char* name, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0)
    throw std::invalid_argument(std::string(name) + " is not an integer: '" + text + "'");
  if (value < 1) throw std::invalid_argument(std::string(name) + " must be >= 1, got " + text);
  return value;
}

/// "row" -> true, "col" -> false; throws naming the value otherwise.
bool parse_row_major(const char* name, const std::string& text) {
  if (text == "row") return true;
  if (text == "col") return false;
  throw std::invalid_argument(std::string("unknown layout for ") + name + ": '" + text +
                              "'; valid: row, col");
}

/// Handles one job line: read A and B, time the GEMM, write C.
JobResult run_job(const std::vector<std::string>& tokens, const Protocol& protocol) {
  if (tokens.size() != kJobTokens)
    return JobResult::error("expected " + std::to_string(kJobTokens) +
                            " tokens (id M N K layoutA layoutB a_path b_path c_path), got " +
                            std::to_string(tokens.size()));
  long long m, n, k;
  bool a_row_major, b_row_major;
  try {
    m = parse_dim("M", tokens[1]);
    n = parse_dim("N", tokens[2]);
    k = parse_dim("K", tokens[3]);
    a_row_major = parse_row_major("A", tokens[4]);
    b_row_major = parse_row_major("B", tokens[5]);
  } catch (const std::invalid_argument& bad_token) {
    return JobResult::error(bad_token.what());
  }
  if (m > kMaxDim || n > kMaxDim || k > kMaxDim)
    return JobResult::unsupported("dimension above 2^31: M=" + tokens[1] + " N=" + tokens[2] +
                                  " K=" + tokens[3]);

  const std::vector<InputT> a = read_binary<InputT>(tokens[6], std::size_t(m * k));
  const std::vector<InputT> b = read_binary<InputT>(tokens[7], std::size_t(k * n));
  AlignedBuffer c(m * n);

  Problem problem{m, n, k,
                  // row-major A: (i, p) at i*K + p; column-major (stored K x M): at p*M + i
                  {a.data(), a_row_major ? k : 1, a_row_major ? 1 : m},
                  {b.data(), b_row_major ? n : 1, b_row_major ? 1 : k},
                  c.get(), n};
  Workspace workspace(problem, omp_get_max_threads());
  Timing timing = measure(protocol, [&] { gemm(problem, workspace); });
  write_binary(tokens[8], c.get(), std::size_t(m * n));
  return JobResult::ok(std::move(timing));
}

}  // namespace
}  // namespace tc::gemm

int main(int argc, char** argv) {
  return tc::run_jobs(argc, argv, tc::gemm::run_job, tc::gemm::describe_params());
}
