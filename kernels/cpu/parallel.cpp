// The pool behind parallel_tasks / parallel_for (see parallel.hpp for the contract).
//
// A job lives on its caller's stack and sits in a queue while it has unclaimed tasks. Workers and
// the caller claim task indices with an atomic counter. The caller leaves only when every task has
// finished and no worker still holds the job, so no worker touches a job after it is gone.
#include "kernels/cpu/parallel.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "core/machine.hpp"

namespace troupe::kernels::cpu {
namespace {

int all_cores() { return core::usable_cores(); }

// How long an idle worker polls for the next job before it sleeps. Ops of a training step follow
// each other within microseconds, while waking a sleeping thread costs tens to hundreds of them
// (more on a virtual machine), which would eat the gain of splitting a 1 ms GEMM.
constexpr auto spin_time = std::chrono::microseconds(200);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

std::atomic<int> g_threads{all_cores()};

struct job {
  const std::function<void(std::int64_t)>* fn = nullptr;
  std::int64_t tasks = 0;
  int max_helpers = 0;
  std::atomic<std::int64_t> next{0};
  // Written under pool::mu_; atomic so that the caller can poll them without it.
  std::atomic<std::int64_t> finished{0};
  std::atomic<int> helpers{0};
  std::exception_ptr error;  // guarded by pool::mu_

  bool done() const { return finished.load() == tasks && helpers.load() == 0; }
};

class pool {
 public:
  static pool& instance() {
    static pool p;
    return p;
  }

  ~pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  void run(std::int64_t tasks, int max_threads, const std::function<void(std::int64_t)>& fn) {
    job j;
    j.fn = &fn;
    j.tasks = tasks;
    j.max_helpers = max_threads - 1;
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (static_cast<int>(workers_.size()) < j.max_helpers)
        workers_.emplace_back([this] { worker_loop(); });
      queue_.push_back(&j);
    }
    posted_.fetch_add(1, std::memory_order_release);
    work_cv_.notify_all();
    work_on(j);
    // A helper still running a task usually finishes within microseconds of the caller; poll for
    // it before sleeping, since being woken costs more than that.
    const auto until = std::chrono::steady_clock::now() + spin_time;
    while (!j.done() && std::chrono::steady_clock::now() < until) cpu_relax();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return j.done(); });
    std::erase(queue_, &j);
    if (j.error) std::rethrow_exception(j.error);
  }

 private:
  // Runs tasks of `j` until none is left unclaimed.
  void work_on(job& j) {
    for (;;) {
      const std::int64_t i = j.next.fetch_add(1);
      if (i >= j.tasks) return;
      std::exception_ptr err;
      try {
        (*j.fn)(i);
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard<std::mutex> lk(mu_);
      if (err && !j.error) j.error = err;
      if (++j.finished == j.tasks) done_cv_.notify_all();
    }
  }

  // The first queued job that still has unclaimed tasks and room for a helper; drops exhausted
  // jobs from the queue. REQUIRES: mu_ held.
  job* pick() {
    for (auto it = queue_.begin(); it != queue_.end();) {
      job* j = *it;
      if (j->next.load() >= j->tasks) {
        it = queue_.erase(it);
        continue;
      }
      if (j->helpers < j->max_helpers) return j;
      ++it;
    }
    return nullptr;
  }

  void worker_loop() {
    std::uint64_t seen = posted_.load(std::memory_order_acquire);
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + spin_time;
      while (posted_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() < until)
        cpu_relax();
      std::unique_lock<std::mutex> lk(mu_);
      job* j = nullptr;
      work_cv_.wait(lk, [&] { return stop_ || (j = pick()) != nullptr; });
      if (stop_) return;
      seen = posted_.load(std::memory_order_acquire);
      ++j->helpers;
      lk.unlock();
      work_on(*j);
      lk.lock();
      if (--j->helpers == 0 && j->finished == j->tasks) done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<job*> queue_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
  std::atomic<std::uint64_t> posted_{0};  // jobs ever queued; idle workers poll it
};

}  // namespace

int threads() { return g_threads.load(); }

void set_threads(int n) { g_threads.store(n <= 0 ? all_cores() : n); }

void parallel_tasks(std::int64_t tasks, const std::function<void(std::int64_t)>& fn) {
  const int t = threads();
  if (tasks <= 0) return;
  if (tasks == 1 || t == 1) {
    for (std::int64_t i = 0; i < tasks; ++i) fn(i);
    return;
  }
  pool::instance().run(tasks, static_cast<int>(std::min<std::int64_t>(t, tasks)), fn);
}

void parallel_for(std::int64_t n, std::int64_t grain,
                  const std::function<void(std::int64_t, std::int64_t)>& fn) {
  if (n <= 0) return;
  const std::int64_t parts =
      std::min<std::int64_t>(threads(), n / std::max<std::int64_t>(grain, 1));
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  parallel_tasks(parts, [&](std::int64_t p) { fn(n * p / parts, n * (p + 1) / parts); });
}

}  // namespace troupe::kernels::cpu
