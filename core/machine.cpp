#include "core/machine.hpp"

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <thread>
#include <fmt/format.h>

namespace troupe::core {

machine_facts this_machine() {
  machine_facts m;
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  m.memory_bytes = pages > 0 && page > 0 ? std::uint64_t(pages) * std::uint64_t(page) : 0;
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) == 0)
    m.open_files = r.rlim_cur == RLIM_INFINITY ? UINT64_MAX : r.rlim_cur;
  if (::getrlimit(RLIMIT_NPROC, &r) == 0)
    m.processes = r.rlim_cur == RLIM_INFINITY ? 0 : r.rlim_cur;
  m.cores = usable_cores();
  return m;
}

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

void raise_open_file_limit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == r.rlim_max) return;
  r.rlim_cur = r.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &r);
}

std::uint64_t worker_bytes(const config& c) {
  const std::uint64_t params = static_cast<std::uint64_t>(parameter_count(c.model));
  const std::uint64_t per_stage = params / static_cast<std::uint64_t>(c.parallel.pipeline_stage);
  return per_stage * 16 + (std::uint64_t(16) << 20);
}

status check_local_workers(const config& c, int workers, bool processes, const std::string& how) {
  const machine_facts m = this_machine();
  const auto gib = [](std::uint64_t b) { return fmt::format("{:.1f} GiB", static_cast<double>(b) / (1 << 30)); };
  // The process itself keeps some files open (its libraries, logs, the terminal).
  const std::uint64_t reserve = 64;
  if (!processes && m.open_files != UINT64_MAX) {
    const std::uint64_t most = m.open_files > reserve ? (m.open_files - reserve) / files_per_worker : 0;
    if (static_cast<std::uint64_t>(workers) > most)
      return config_error(
          c, "parallel.data_parallel",
          fmt::format("{} is more than this process can run: each worker keeps up to {} files and "
                      "sockets open, and the open-file limit (ulimit -n) is {}, enough for {}",
                      how, files_per_worker, m.open_files, most),
          "use fewer workers, raise the limit (ulimit -n), or spread the job over several "
          "processes or nodes with `troupe launch`");
  }
  if (processes && m.processes > 0 && static_cast<std::uint64_t>(workers) > m.processes)
    return error::make(fmt::format("{} is more processes than this user may start (ulimit -u is {})",
                                   how, m.processes),
                       "use fewer workers per node (--local_worker_num) and more nodes");
  if (c.runtime.device == "cpu" && m.memory_bytes > 0) {
    const std::uint64_t each = worker_bytes(c);
    const std::uint64_t most = m.memory_bytes / each;
    if (static_cast<std::uint64_t>(workers) > most)
      return config_error(
          c, "parallel.data_parallel",
          fmt::format("{} need at least {} of memory ({} each: fp32 parameters, gradients and "
                      "AdamW moments of a stage, and its runtime), but this machine has {}",
                      how, gib(each * static_cast<std::uint64_t>(workers)), gib(each),
                      gib(m.memory_bytes)),
          fmt::format("at most {} such workers fit here: use fewer (parallel.data_parallel x "
                      "parallel.pipeline_stage), or spread them over nodes with `troupe launch`",
                      most));
  }
  return {};
}

}  // namespace troupe::core
