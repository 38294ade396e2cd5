// `troupe replay RUN_DIR [--until-step S] [--dump-tensors DIR] [--rank R] [--work-dir DIR]`:
// re-runs a recorded job in this process and checks every tensor it sends against the run's
// message logs (docs/replay.md). `--compare OTHER_RUN` instead sets two recorded runs' logs side
// by side and names where they part. Exit 0 when the replay matched bit for bit, 1 at the first
// difference (printed with rank, step, micro-batch and instruction), 2 when the run cannot be
// replayed (not a run directory, not recorded, damaged logs, missing data).
#include <cstdio>
#include <string>

#include "replay/replay.hpp"
#include "cli/command.hpp"

namespace troupe::cli {
namespace {

struct replay_args {
  std::string run_dir;
  int until_step = -1;
  std::string dump_dir;
  int rank = -1;
  std::string work_dir;
  std::string compare;
  bool quiet = false;
};

int run_compare(const replay_args& a) {
  auto r = actors::compare_runs(a.run_dir, a.compare);
  if (!r) {
    print_error(r.err().to_string());
    return 2;
  }
  const auto& c = r.value();
  if (c.configs_differ && !a.quiet)
    std::printf("note: the two runs' config.toml differ\n");
  if (c.same) {
    std::printf("%s and %s sent the same bits: %lld messages over %d steps\n", a.run_dir.c_str(),
                a.compare.c_str(), static_cast<long long>(c.messages), c.steps);
    return 0;
  }
  std::fprintf(stderr,
               "troupe: %s and %s part at step %lld: %lld of their %lld messages differ, %lld of "
               "them in that step\n",
               a.run_dir.c_str(), a.compare.c_str(), static_cast<long long>(c.first_step),
               static_cast<long long>(c.differing), static_cast<long long>(c.messages),
               static_cast<long long>(c.differing_in_first_step));
  if (!a.quiet) {
    if (!c.first_differences.empty())
      std::fprintf(stderr, "  each worker's first differing message of step %lld:\n",
                   static_cast<long long>(c.first_step));
    for (const auto& d : c.first_differences) std::fprintf(stderr, "    %s\n", d.c_str());
    for (const auto& d : c.clip_differences) std::fprintf(stderr, "    %s\n", d.c_str());
  }
  return 1;
}

int run_replay(const replay_args& a) {
  if (!a.compare.empty()) return run_compare(a);
  actors::replay_options opt;
  opt.run_dir = a.run_dir;
  opt.until_step = a.until_step;
  opt.dump_dir = a.dump_dir;
  opt.rank = a.rank;
  opt.work_dir = a.work_dir;
  opt.log = a.quiet ? nullptr : stdout;
  auto r = actors::replay_run(opt);
  if (!r) {
    print_error(r.err().to_string());
    return 2;
  }
  const auto& rep = r.value();
  const std::string who = a.rank >= 0 ? "rank " + std::to_string(a.rank) + " of " : "";
  if (!rep.matched) {
    std::fprintf(stderr, "troupe: replay of %s%s differs: %s\n", who.c_str(), a.run_dir.c_str(),
                 rep.mismatch.c_str());
    if (!rep.dump_file.empty())
      std::fprintf(stderr, "  tensors of that step so far: %s\n", rep.dump_file.c_str());
    return 1;
  }
  std::printf("replay%s matched the recorded run bit for bit: %lld messages over %d steps\n",
              a.rank >= 0 ? (" of rank " + std::to_string(a.rank)).c_str() : "",
              static_cast<long long>(rep.messages), rep.steps());
  if (!rep.dump_file.empty()) std::printf("  tensors of step %d: %s\n", rep.last_step, rep.dump_file.c_str());
  return 0;
}

const command_registrar reg{command{
    "replay",
    "Re-run a recorded run in one process and check every message against its logs, bit for bit",
    [](CLI::App& app) {
      auto a = std::make_shared<replay_args>();
      app.add_option("run_dir", a->run_dir,
                     "run directory of a recorded `troupe train` (its runtime.run_dir)")
          ->required();
      CLI::Option* until =
          app.add_option("--until-step", a->until_step, "stop after this step (0-based)")
              ->check(CLI::NonNegativeNumber);
      CLI::Option* dump =
          app.add_option("--dump-tensors", a->dump_dir,
                         "write the tensors sent in the last replayed step (or in the step that "
                         "differed) to DIR/step_<S>.safetensors, named by their tags");
      CLI::Option* rank =
          app.add_option("--rank", a->rank,
                         "replay this worker alone, fed by the tensors its neighbours sent it in "
                         "the recorded run (needs runtime.record_tensors = true)")
              ->check(CLI::NonNegativeNumber);
      CLI::Option* work =
          app.add_option("--work-dir", a->work_dir,
                         "keep the replay's own run directory (metrics, checkpoints) here instead "
                         "of a temporary one");
      CLI::Option* compare =
          app.add_option("--compare", a->compare,
                         "compare RUN_DIR's message logs with this other recorded run's instead "
                         "of replaying: prints the first step where they differ and each "
                         "worker's first differing message in it (nothing is re-run)");
      compare->excludes(until)->excludes(dump)->excludes(rank)->excludes(work);
      app.add_flag("--quiet", a->quiet, "print only the verdict");
      app.footer(
          "Exit status: 0 matched bit for bit (or, with --compare, the runs sent the same bits), "
          "1 the first difference (printed), 2 the run cannot be replayed or compared.\nRun it "
          "from the directory the run was started in: data paths in RUN_DIR/config.toml are "
          "relative to it.");
      return [a] { return run_replay(*a); };
    }}};

}  // namespace
}  // namespace troupe::cli
