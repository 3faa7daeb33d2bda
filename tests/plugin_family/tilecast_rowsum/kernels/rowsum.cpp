// rowsum family binary (the tilecast-rowsum plugin): the kernel of rowsum_kernel.hpp behind
// tilecast's job runner (harness.hpp). Job line:
//   <job_id> <m> <n> <ld> <x_path> <y_path>
#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include "rowsum_kernel.hpp"

namespace rowsum {
namespace {

constexpr std::size_t kJobTokens = 6;

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
  const int threads = omp_get_max_threads();
  tc::Timing timing =
      tc::measure(protocol, [&] { rowsum(x.data(), m, n, ld, y.data(), threads); });
  tc::write_binary(tokens[5], y.data(), y.size());
  return tc::JobResult::ok(std::move(timing));
}

}  // namespace
}  // namespace rowsum

int main(int argc, char** argv) {
  return tc::run_jobs(argc, argv, rowsum::run_job, rowsum::describe_params());
}
