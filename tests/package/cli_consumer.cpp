// The installed command-line component (paradyse::cli: paradyse/cli/flags.hpp over the installed static library):
// a program states a flag, parses its command line and rejects a bad value.
#include <paradyse/cli/flags.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  int ranks = 1;
  paradyse::cli::Flags flags("cli_consumer", "A consumer of the installed paradyse::cli component.");
  flags.integer("--ranks", ranks, 1, 256, "thread ranks");
  flags.parse(argc, argv);
  const char* bad[] = {"cli_consumer", "--ranks", "0"};
  paradyse::cli::Flags again("cli_consumer", "the same flag, given a value outside its range");
  int unused = 1;
  again.integer("--ranks", unused, 1, 256, "thread ranks");
  const bool ok = ranks == 3 && again.problem(3, bad).has_value();
  std::printf("package cli consumer: %s\n", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
