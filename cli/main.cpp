// The `troupe` executable: one binary, one subcommand per cli/cmd_*.cpp.
#include <algorithm>
#include <cstdio>
#include <exception>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/files.hpp"

namespace troupe::cli {

std::vector<command>& registry() {
  static std::vector<command> commands;
  return commands;
}

void print_error(const std::string& text) { std::fprintf(stderr, "troupe: error: %s\n", text.c_str()); }

}  // namespace troupe::cli

int main(int argc, char** argv) {
  using namespace troupe::cli;
  CLI::App app{"troupe: train and fine-tune GPT-2 and LLaMA models with pipeline and data "
               "parallelism, built as an actor system"};
  app.require_subcommand(1);
  // A stop signal lets a trace or metrics append in progress finish (core/files.hpp).
  troupe::core::guard_appends_from_stop_signals();
  auto& cmds = registry();
  std::sort(cmds.begin(), cmds.end(), [](auto& a, auto& b) { return a.name < b.name; });
  std::function<int()> chosen;
  for (auto& c : cmds) {
    CLI::App* sub = app.add_subcommand(c.name, c.description);
    auto run = c.setup(*sub);
    sub->callback([&chosen, run] { chosen = run; });
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints the message; every usage error exits 2, as the subcommands document.
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  try {
    return chosen ? chosen() : 1;
  } catch (const troupe::core::failure& e) {
    print_error(e.what());
    return 1;
  } catch (const std::exception& e) {
    print_error(std::string("unexpected: ") + e.what());
    return 1;
  }
}
