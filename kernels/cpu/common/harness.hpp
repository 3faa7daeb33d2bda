// Shared measurement protocol and job runner for every CPU kernel family.
//
// A family binary (gemm, grouped conv, ...) is compiled once per variant and
// then fed a jobs file; this header owns everything that must be identical
// across families so their timings are comparable: argument parsing, the
// warm-up / sample / cache-flush protocol, raw binary I/O and the one-line-
// per-job output format the Python side parses.
//
// Output, one line per job, flushed immediately so a crash loses nothing
// already printed:
//   OK <job_id> <reps> <retaken> <disturbed> <s_1> ... <s_N>
//        seconds per call (%.9e); retaken = samples re-taken because another
//        task competed for the CPU during them, disturbed = samples still
//        disturbed when the retake allowance ran out, or taken while the cores
//        were slow to meet (sync_probe_us): kept, and printed last, so the
//        final <disturbed> samples of the line are the disturbed ones
//   UNSUPPORTED <job_id> <reason>
//   ERROR <job_id> <reason>
//   SYNC <us>   after each job: the fastest synchronization probe seen so far
//        (sync_probe_us), the caller's baseline for the next process
#pragma once

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace tc {

// ---------------------------------------------------------------- protocol

/// How one job is timed; identical for every kernel family.
struct Protocol {
  double warmup_ms;
  double min_sample_ms;
  int samples;
  int max_reps;
  bool flush;
  int retakes;         // at most this many samples re-taken per job
  double stall_limit;  // a sample is disturbed past this CPU-stall fraction of its time
  double sync_limit;        // a sample is disturbed when the synchronization probe around it
                            // takes more than sync_limit x the baseline (0: no probe)
  double sync_baseline_us;  // the caller's fastest probe so far (0: none yet)
};

/// Result of `measure`: reps per sample, one seconds-per-call per sample, and how many
/// samples were re-taken (or kept although disturbed) because of CPU contention.
struct Timing {
  int reps = 0;
  std::vector<double> seconds_per_call;
  int retaken = 0;
  int disturbed = 0;
};

/// A compile-time parameter of a family binary, printed by `--describe`.
struct Param {
  std::string name;
  long long value;
};

/// Bad command line; run_jobs turns it into a stderr message and exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Everything the command line carries.
struct RunnerArgs {
  Protocol protocol{};
  std::string jobs_path;
  bool describe = false;
};

namespace detail {

inline const char* kUsage =
    "usage: <binary> --warmup-ms W --min-sample-ms S --samples N --jobs PATH "
    "[--max-reps R (default 100000)] [--flush 0|1 (default 0)] "
    "[--retakes R (default 0)] [--stall-limit F (default 0.05)] "
    "[--sync-limit F (default 0: off)] [--sync-baseline-us U (default 0)] | --describe";

inline double parse_double(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(value) || value < 0)
    throw UsageError(flag + " expects a non-negative number, got '" + text + "'");
  return value;
}

inline long long parse_int(const std::string& flag, const std::string& text,
                           long long min_value, long long max_value) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || value < min_value || value > max_value)
    throw UsageError(flag + " expects an integer in [" + std::to_string(min_value) + ", " +
                     std::to_string(max_value) + "], got '" + text + "'");
  return value;
}

/// Reasons go on one output line: fold line breaks into spaces.
inline std::string one_line(std::string text) {
  for (char& ch : text)
    if (ch == '\n' || ch == '\r') ch = ' ';
  return text.empty() ? std::string("(no reason given)") : text;
}

}  // namespace detail

/// Parses the shared flags; throws UsageError naming the offending flag/value.
inline RunnerArgs parse_runner_args(int argc, char** argv) {
  RunnerArgs args;
  args.protocol.max_reps = 100000;
  args.protocol.flush = false;
  args.protocol.retakes = 0;
  args.protocol.stall_limit = 0.05;
  args.protocol.sync_limit = 0.0;
  args.protocol.sync_baseline_us = 0.0;
  bool has_warmup = false, has_sample = false, has_samples = false, has_jobs = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--describe") {
      args.describe = true;
      continue;
    }
    if (i + 1 >= argc) throw UsageError("flag '" + flag + "' is unknown or lacks a value");
    const std::string value = argv[++i];
    if (flag == "--warmup-ms") {
      args.protocol.warmup_ms = detail::parse_double(flag, value);
      has_warmup = true;
    } else if (flag == "--min-sample-ms") {
      args.protocol.min_sample_ms = detail::parse_double(flag, value);
      has_sample = true;
    } else if (flag == "--samples") {
      args.protocol.samples = static_cast<int>(detail::parse_int(flag, value, 1, 1000000));
      has_samples = true;
    } else if (flag == "--max-reps") {
      args.protocol.max_reps = static_cast<int>(detail::parse_int(flag, value, 1, 1000000000));
    } else if (flag == "--flush") {
      args.protocol.flush = detail::parse_int(flag, value, 0, 1) == 1;
    } else if (flag == "--retakes") {
      args.protocol.retakes = static_cast<int>(detail::parse_int(flag, value, 0, 1000000));
    } else if (flag == "--stall-limit") {
      args.protocol.stall_limit = detail::parse_double(flag, value);
    } else if (flag == "--sync-limit") {
      args.protocol.sync_limit = detail::parse_double(flag, value);
    } else if (flag == "--sync-baseline-us") {
      args.protocol.sync_baseline_us = detail::parse_double(flag, value);
    } else if (flag == "--jobs") {
      args.jobs_path = value;
      has_jobs = true;
    } else {
      throw UsageError("unknown flag '" + flag + "'");
    }
  }
  if (args.describe) return args;
  if (!has_warmup) throw UsageError("missing required flag --warmup-ms");
  if (!has_sample) throw UsageError("missing required flag --min-sample-ms");
  if (!has_samples) throw UsageError("missing required flag --samples");
  if (!has_jobs) throw UsageError("missing required flag --jobs");
  return args;
}

// ---------------------------------------------------------------- timing

/// Twice the 32 MiB L3: touching it evicts every cache level of every core.
constexpr std::size_t kFlushBytes = std::size_t(64) << 20;

/// Writes then reads kFlushBytes (one byte per cache line) on every OpenMP
/// thread, so each core's private L1/L2 is evicted too, not only the L3.
inline void flush_caches() {
  static std::vector<unsigned char> buffer(kFlushBytes, 0);
  static volatile unsigned sink = 0;
  unsigned char* data = buffer.data();
  const long long lines = static_cast<long long>(kFlushBytes / 64);
  unsigned total = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) reduction(+ : total)
#endif
  for (long long line = 0; line < lines; ++line) {
    data[line * 64] = static_cast<unsigned char>(data[line * 64] + 1);
    total += data[line * 64];
  }
  sink = sink + total;
}

/// Cumulative time (microseconds) during which some task on this machine was
/// runnable but waiting for a CPU: the "some total" of Linux's pressure stall
/// information. -1 where the kernel does not provide it.
inline long long cpu_stall_us() {
  std::FILE* file = std::fopen("/proc/pressure/cpu", "r");
  if (file == nullptr) return -1;
  char line[256];
  long long total = -1;
  if (std::fgets(line, sizeof line, file) != nullptr) {
    const char* field = std::strstr(line, "total=");
    if (field != nullptr) total = std::atoll(field + 6);
  }
  std::fclose(file);
  return total;
}

/// Wall time (microseconds) of kSyncProbeBarriers barriers of the OpenMP thread
/// team: how long the cores take to reach each other. On the shared VMs this
/// runs on it grows for seconds at a time, often (the host
/// placing the vCPUs farther apart), while FMA throughput and the pressure
/// stall stay put; kernels that synchronize or share cache lines then run much
/// slower. -1 with fewer than two threads or without OpenMP.
inline double sync_probe_us() {
#ifdef _OPENMP
  constexpr int kSyncProbeBarriers = 200;
  if (omp_get_max_threads() < 2) return -1;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel
  for (int i = 0; i < kSyncProbeBarriers; ++i) {
#pragma omp barrier
  }
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
      .count();
#else
  return -1;
#endif
}

/// The synchronization guard of one process: the fastest probe seen, starting
/// from the caller's baseline (Protocol::sync_baseline_us).
struct SyncGuard {
  double baseline_us = 0.0;  // 0: nothing measured yet

  static SyncGuard& instance() {
    static SyncGuard guard;
    return guard;
  }

  /// One probe, folded into the baseline; true when it took more than
  /// sync_limit x the baseline. Always false when the guard is off.
  bool slow(const Protocol& protocol) {
    if (protocol.sync_limit <= 0) return false;
    const double probe = sync_probe_us();
    if (probe <= 0) return false;
    if (protocol.sync_baseline_us > 0 &&
        (baseline_us <= 0 || protocol.sync_baseline_us < baseline_us))
      baseline_us = protocol.sync_baseline_us;
    if (baseline_us <= 0 || probe < baseline_us) baseline_us = probe;
    return probe > protocol.sync_limit * baseline_us;
  }
};

/// Times `fn` under `protocol`: warm up for warmup_ms (at least one call),
/// size reps so one sample lasts >= min_sample_ms, then take `samples`
/// samples of `reps` back-to-back calls, flushing caches before each sample
/// when asked. Returns seconds per call for each sample.
///
/// Contention guard: a sample during which tasks waited for a CPU for more than
/// stall_limit of its duration shared the cores with someone else (on 2 cores an
/// OpenMP kernel then runs several times slower, as its barriers wait for a
/// preempted thread); it is re-taken, at most `retakes` times per job, then kept and
/// counted. Synchronization guard: a sample whose probe before or after it
/// (SyncGuard, one probe between consecutive samples) took more than sync_limit
/// x the baseline ran while the cores were slow to meet; such spells last
/// seconds, so it is kept and counted as disturbed at once, not re-taken: the
/// samples of the job's other rounds, taken seconds apart, decide its median.
template <class F>
Timing measure(const Protocol& protocol, F&& fn) {
  using clock = std::chrono::steady_clock;
  const auto warmup_start = clock::now();
  // Reps are sized from the fastest warm-up call: the first call pays for page faults and
  // thread start-up, and sizing from it would shrink every sample to one noisy call.
  double fastest_ms = 1e300;
  double warmup_elapsed_ms = 0.0;
  do {
    const auto call_start = clock::now();
    fn();
    const auto call_end = clock::now();
    fastest_ms = std::min(fastest_ms,
                          std::chrono::duration<double, std::milli>(call_end - call_start).count());
    warmup_elapsed_ms = std::chrono::duration<double, std::milli>(call_end - warmup_start).count();
  } while (warmup_elapsed_ms < protocol.warmup_ms);

  const double per_call_ms = std::max(fastest_ms, 1e-9);
  const double wanted = std::ceil(protocol.min_sample_ms / per_call_ms);
  Timing timing;
  timing.reps = static_cast<int>(std::clamp(wanted, 1.0, double(protocol.max_reps)));
  timing.seconds_per_call.reserve(protocol.samples);
  std::vector<double> disturbed_seconds;  // kept once the allowance is spent; printed last
  SyncGuard& sync = SyncGuard::instance();
  for (int settle = 0; settle < 2; ++settle) sync.slow(protocol);  // the team's first barriers
  bool slow_before = sync.slow(protocol);
  while (static_cast<int>(timing.seconds_per_call.size() + disturbed_seconds.size()) <
         protocol.samples) {
    if (protocol.flush) flush_caches();
    const long long stall_before = cpu_stall_us();
    const auto start = clock::now();
    for (int rep = 0; rep < timing.reps; ++rep) fn();
    const double seconds = std::chrono::duration<double>(clock::now() - start).count();
    const long long stall_after = cpu_stall_us();
    const bool slow_after = sync.slow(protocol);  // also the next sample's "before"
    const bool slow = slow_before || slow_after;
    slow_before = slow_after;
    const bool contended = stall_before >= 0 && stall_after >= 0 &&
                           (stall_after - stall_before) * 1e-6 > protocol.stall_limit * seconds;
    if (contended && timing.retaken < protocol.retakes) {
      ++timing.retaken;
      continue;
    }
    // a slow spell lasts seconds: a retake would fall in the same one, so such a sample is
    // kept apart at once
    (contended || slow ? disturbed_seconds : timing.seconds_per_call).push_back(seconds / timing.reps);
  }
  timing.disturbed = static_cast<int>(disturbed_seconds.size());
  timing.seconds_per_call.insert(timing.seconds_per_call.end(), disturbed_seconds.begin(),
                                 disturbed_seconds.end());
  return timing;
}

// ---------------------------------------------------------------- file I/O

/// Reads a raw binary file of exactly `count` elements of T; throws with the
/// path and the expected vs actual byte counts otherwise.
template <class T>
std::vector<T> read_binary(const std::string& path, std::size_t count) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw std::runtime_error("cannot open '" + path + "' for reading");
  const auto actual = static_cast<long long>(in.tellg());
  const auto expected = static_cast<long long>(count * sizeof(T));
  if (actual != expected)
    throw std::runtime_error("file '" + path + "' has " + std::to_string(actual) +
                             " bytes, expected " + std::to_string(expected) + " (" +
                             std::to_string(count) + " elements of " +
                             std::to_string(sizeof(T)) + " bytes)");
  std::vector<T> data(count);
  in.seekg(0);
  if (!in.read(reinterpret_cast<char*>(data.data()), expected))
    throw std::runtime_error("short read from '" + path + "'");
  return data;
}

/// Writes `count` elements as raw bytes through a temp file + rename, so a
/// reader never sees a half-written file.
template <class T>
void write_binary(const std::string& path, const T* data, std::size_t count) {
  const std::string temp_path = path + ".tmp";
  {
    std::ofstream out(temp_path, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("cannot open '" + temp_path + "' for writing");
    out.write(reinterpret_cast<const char*>(data), std::streamsize(count * sizeof(T)));
    if (!out) throw std::runtime_error("write to '" + temp_path + "' failed");
  }
  if (std::rename(temp_path.c_str(), path.c_str()) != 0)
    throw std::runtime_error("cannot rename '" + temp_path + "' to '" + path + "'");
}

// ---------------------------------------------------------------- jobs

enum class JobStatus { OK, UNSUPPORTED, ERROR };

/// The single table of status words written on output lines.
inline const char* status_word(JobStatus status) {
  static const char* const kWords[] = {"OK", "UNSUPPORTED", "ERROR"};
  return kWords[static_cast<int>(status)];
}

/// What a family handler returns for one job.
struct JobResult {
  JobStatus status = JobStatus::ERROR;
  std::string reason;
  Timing timing;

  static JobResult ok(Timing timing) { return {JobStatus::OK, "", std::move(timing)}; }
  static JobResult unsupported(std::string why) {
    return {JobStatus::UNSUPPORTED, std::move(why), {}};
  }
  static JobResult error(std::string why) { return {JobStatus::ERROR, std::move(why), {}}; }
};

/// Splits one jobs-file line into whitespace-separated tokens.
inline std::vector<std::string> split_tokens(const std::string& line) {
  std::istringstream stream(line);
  std::vector<std::string> tokens;
  for (std::string token; stream >> token;) tokens.push_back(token);
  return tokens;
}

/// Prints one job's line and flushes stdout.
inline void print_result(const std::string& job_id, const JobResult& result) {
  if (result.status == JobStatus::OK) {
    std::printf("OK %s %d %d %d", job_id.c_str(), result.timing.reps, result.timing.retaken,
                result.timing.disturbed);
    for (double seconds : result.timing.seconds_per_call) std::printf(" %.9e", seconds);
    std::printf("\n");
  } else {
    std::printf("%s %s %s\n", status_word(result.status), job_id.c_str(),
                detail::one_line(result.reason).c_str());
  }
  std::fflush(stdout);
}

/// Entry point of a family binary: parses the protocol, then runs
/// `handler(tokens, protocol) -> JobResult` for each non-blank line of the
/// jobs file (tokens[0] is the job id). std::exceptions from the handler
/// become ERROR lines and the next job runs. `--describe` prints `params`
/// as `PARAM <NAME> <VALUE>` lines instead. Returns the process exit code:
/// 0 when every job line was printed, 2 on a bad command line or jobs file.
template <class Handler>
int run_jobs(int argc, char** argv, Handler handler, const std::vector<Param>& params = {}) {
  RunnerArgs args;
  try {
    args = parse_runner_args(argc, argv);
  } catch (const UsageError& error) {
    std::fprintf(stderr, "error: %s\n%s\n", error.what(), detail::kUsage);
    return 2;
  }
  if (args.describe) {
    for (const Param& param : params) std::printf("PARAM %s %lld\n", param.name.c_str(), param.value);
    std::fflush(stdout);
    return 0;
  }
  std::ifstream jobs(args.jobs_path);
  if (!jobs) {
    std::fprintf(stderr, "error: cannot open jobs file '%s'\n", args.jobs_path.c_str());
    return 2;
  }
  for (std::string line; std::getline(jobs, line);) {
    const std::vector<std::string> tokens = split_tokens(line);
    if (tokens.empty()) continue;
    JobResult result;
    try {
      result = handler(tokens, args.protocol);
    } catch (const std::exception& error) {
      result = JobResult::error(error.what());
    } catch (...) {
      result = JobResult::error("non-standard exception");
    }
    const double sync_baseline_us = SyncGuard::instance().baseline_us;
    if (args.protocol.sync_limit > 0 && sync_baseline_us > 0)
      std::printf("SYNC %.3f\n", sync_baseline_us);
    print_result(tokens[0], result);
  }
  return 0;
}

}  // namespace tc
