// Subcommand registry. Each cli/cmd_*.cpp defines one subcommand and registers it with a static
// `command_registrar`, so adding a subcommand touches no shared file. `setup` adds the subcommand's
// options to its CLI11 app; `run` executes it after parsing and returns the process exit code.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace troupe::cli {

struct command {
  std::string name;
  std::string description;
  /// Adds options to `app` (the subcommand) and returns the function run when it was chosen.
  std::function<std::function<int()>(CLI::App& app)> setup;
};

std::vector<command>& registry();

struct command_registrar {
  explicit command_registrar(command c) { registry().push_back(std::move(c)); }
};

/// Prints an error (already formatted by core::error::to_string) to stderr as "troupe: error: ...".
void print_error(const std::string& text);

}  // namespace troupe::cli
