// rowsum family binary (the tilecast-rowsum plugin): y[i] = sum_j x[i * ld + j] for the m rows
// of n fp32 values of x, rows ld >= n apart; y is m fp32 values.
//
// One variant per build, with the -D parameters:
//   RS_ACC       independent partial sums per row (1, 2, 4, 8, 16): the adds of one row form
//                RS_ACC chains, which the compiler may keep in vector lanes
//   RS_ROWS      rows summed in one pass (1, 2, 4): their loads interleave
//   RS_PARALLEL  0: one thread; 1: blocks of rows shared out over the OpenMP threads
// Job line (tilecast's harness protocol, harness.hpp):
//   <job_id> <m> <n> <ld> <x_path> <y_path>
#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include "harness.hpp"

#if !defined(RS_ACC) || !defined(RS_ROWS) || !defined(RS_PARALLEL)
#error "compile with -DRS_ACC=<1|2|4|8|16> -DRS_ROWS=<1|2|4> -DRS_PARALLEL=<0|1>"
#endif
static_assert(RS_ACC == 1 || RS_ACC == 2 || RS_ACC == 4 || RS_ACC == 8 || RS_ACC == 16,
              "RS_ACC must be 1, 2, 4, 8 or 16");
static_assert(RS_ROWS == 1 || RS_ROWS == 2 || RS_ROWS == 4, "RS_ROWS must be 1, 2 or 4");
static_assert(RS_PARALLEL == 0 || RS_PARALLEL == 1, "RS_PARALLEL must be 0 or 1");

namespace rowsum {
namespace {

constexpr std::size_t kJobTokens = 6;

/// Sums ROWS rows of n values (ld apart) into y[0..ROWS), RS_ACC partial sums per row.
template <int ROWS>
void sum_rows(const float* x, long long ld, long long n, float* y) {
  float partial[ROWS][RS_ACC] = {};
  long long j = 0;
  for (; j + RS_ACC <= n; j += RS_ACC)
    for (int r = 0; r < ROWS; ++r)
      for (int a = 0; a < RS_ACC; ++a) partial[r][a] += x[r * ld + j + a];
  for (int r = 0; r < ROWS; ++r) {
    float total = 0.0f;
    for (int a = 0; a < RS_ACC; ++a) total += partial[r][a];
    for (long long tail = j; tail < n; ++tail) total += x[r * ld + tail];
    y[r] = total;
  }
}

void rowsum(const float* x, long long m, long long n, long long ld, float* y) {
  const long long blocks = m / RS_ROWS;
#pragma omp parallel for schedule(static) if (RS_PARALLEL)
  for (long long block = 0; block < blocks; ++block)
    sum_rows<RS_ROWS>(x + block * RS_ROWS * ld, ld, n, y + block * RS_ROWS);
  for (long long row = blocks * RS_ROWS; row < m; ++row) sum_rows<1>(x + row * ld, ld, n, y + row);
}

/// A positive integer token; throws naming the token and its value.
long long parse_count(const char* name, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0)
    throw std::invalid_argument(std::string(name) + " is not an integer: '" + text + "'");
  if (value < 1) throw std::invalid_argument(std::string(name) + " must be >= 1, got " + text);
  return value;
}

/// One job line: read x, time the row sums, write y.
tc::JobResult run_job(const std::vector<std::string>& tokens, const tc::Protocol& protocol) {
  if (tokens.size() != kJobTokens)
    return tc::JobResult::error("expected " + std::to_string(kJobTokens) +
                                " tokens (id m n ld x_path y_path), got " +
                                std::to_string(tokens.size()));
  long long m, n, ld;
  try {
    m = parse_count("m", tokens[1]);
    n = parse_count("n", tokens[2]);
    ld = parse_count("ld", tokens[3]);
  } catch (const std::invalid_argument& bad_token) {
    return tc::JobResult::error(bad_token.what());
  }
  if (ld < n) return tc::JobResult::unsupported("ld=" + tokens[3] + " < n=" + tokens[2]);
  const std::vector<float> x = tc::read_binary<float>(tokens[4], std::size_t(m * ld));
  std::vector<float> y(std::size_t(m), 0.0f);
  tc::Timing timing = tc::measure(protocol, [&] { rowsum(x.data(), m, n, ld, y.data()); });
  tc::write_binary(tokens[5], y.data(), y.size());
  return tc::JobResult::ok(std::move(timing));
}

}  // namespace
}  // namespace rowsum

int main(int argc, char** argv) {
  return tc::run_jobs(argc, argv, rowsum::run_job,
                      {{"ACC", RS_ACC}, {"ROWS", RS_ROWS}, {"PARALLEL", RS_PARALLEL}});
}
