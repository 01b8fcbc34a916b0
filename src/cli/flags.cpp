// src/cli/flags.cpp: the CLI11 side of paradyse::cli::Flags (include/paradyse/cli/flags.hpp), compiled once into the
// static library paradyse_cli (the package component paradyse::cli) that every example program and benchmark links.
#include "paradyse/cli/flags.hpp"

#include <CLI/CLI.hpp>

namespace paradyse::cli {

namespace {

// CLI11 reports a ValidationError thrown by an option's callback as that option's problem.
template <class Store, class Value>
void store_or_report(const Store& store, const Value& v) {
  try {
    store(v);
  } catch (const FlagValueError& e) {
    throw CLI::ValidationError(e.what());
  }
}

}  // namespace

Flags::Flags(std::string program, std::string description)
    : program_(std::move(program)), app_(std::make_unique<CLI::App>(std::move(description), program_)) {
  app_->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app_->get_formatter()->column_width(34);
}

Flags::~Flags() = default;

FlagOption& FlagOption::without_default() {
  option_->default_str("");
  return *this;
}

FlagOption& FlagOption::nonempty(const std::string& expected) {
  option_->check(
      [name = option_->get_name(), expected](const std::string& v) {
        return v.empty() ? fmt::format("{} is empty; expected {}", name, expected) : std::string();
      },
      "");
  return *this;
}

FlagOption Flags::value(const std::string& name, const std::string& help, const std::string& type,
                  const std::string& default_text, std::function<void(const std::string&)> store) {
  CLI::Option* o = app_->add_option_function<std::string>(
      name, [store = std::move(store)](const std::string& v) { store_or_report(store, v); }, help);
  o->type_name(type);
  if (!default_text.empty()) o->default_str(default_text);
  return FlagOption(o);
}

FlagOption Flags::values(const std::string& name, const std::string& help, int count, const std::string& type,
                   const std::string& default_text, std::function<void(const std::vector<std::string>&)> store) {
  CLI::Option* o = app_->add_option_function<std::vector<std::string>>(
      name, [store = std::move(store)](const std::vector<std::string>& v) { store_or_report(store, v); }, help);
  o->expected(count);
  o->type_name(type);
  if (!default_text.empty()) o->default_str(default_text);
  return FlagOption(o);
}

FlagOption Flags::number(const std::string& name, double& out, const Interval& range, const std::string& help) {
  return value(name, help, fmt::format("NUM in {}", range.describe()), fmt::format("{}", out),
        [&out, range, name](const std::string& v) {
          if (!parse_number(v, range, out))
            throw FlagValueError(
                fmt::format("{} expects a finite number in {}, got \"{}\"", name, range.describe(), printable(v)));
        });
}

FlagOption Flags::text(const std::string& name, std::string& out, const std::string& help, const std::string& type) {
  return value(name, help, type, out, [&out](const std::string& v) { out = v; });
}

FlagOption Flags::choice(const std::string& name, std::string& out, std::vector<std::string> choices,
                   const std::string& help) {
  std::string names;
  for (const std::string& c : choices) names += (names.empty() ? "" : "|") + c;
  return value(name, help, names, out, [&out, choices = std::move(choices), name, names](const std::string& v) {
    for (const std::string& c : choices)
      if (v == c) {
        out = v;
        return;
      }
    throw FlagValueError(fmt::format("{} expects one of {}, got \"{}\"", name, names, printable(v)));
  });
}

FlagOption Flags::choice(const std::string& name, bool& out, const std::string& first, const std::string& second,
                   const std::string& help) {
  return value(name, help, first + "|" + second, out ? first : second, [&out, first, second, name](const std::string& v) {
    if (v != first && v != second)
      throw FlagValueError(fmt::format("{} expects {} or {}, got \"{}\"", name, first, second, printable(v)));
    out = v == first;
  });
}

FlagOption Flags::flag(const std::string& name, bool& out, const std::string& help) {
  return FlagOption(app_->add_flag_callback(name, [&out] { out = true; }, help));
}

FlagOption Flags::flag(const std::string& name, std::function<void()> action, const std::string& help) {
  return FlagOption(app_->add_flag_callback(name, std::move(action), help));
}

std::string Flags::usage() const { return app_->help(); }

std::optional<std::string> Flags::problem(int argc, const char* const* argv) {
  try {
    app_->parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    return std::string();
  } catch (const CLI::ExtrasError& e) {
    return fmt::format("{} (try --help)", e.what());
  } catch (const CLI::ParseError& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

}  // namespace paradyse::cli
