// paradyse/core/csv_table.hpp: the tables the example programs and benchmarks print, also written as CSV
// (`--csv FILE`) for scripts/plot.py and spreadsheets.
//
//   CsvTable csv(path, {"step", "length", "loss"});   // an empty path writes nothing
//   csv.row(step, length, fmt::format("{:.17g}", loss));
//   csv.row_of(fields);                                 // a std::vector<std::string>, one per column
//
// One header line, then one line per row; a field holding a comma, a quote or a line break is quoted (RFC 4180).
// Numbers are written by fmt (doubles as the shortest text that reads back to the same value).
//
// Written through core/atomic_file.hpp: the rows go to a temporary file beside the target, each written (and
// checked) as it comes, and close() puts the table in place (fsync, rename), so a full disk or an unwritable folder
// throws, naming the file and the system's reason, before a program says "wrote", and never truncates an old table.
// A table destroyed without close() (a run stopped by an error elsewhere) is put in place with the rows so far; one
// whose writing failed leaves the old table untouched. A long run's side table (OnFailure::warns) reports a failure
// once on stderr and goes on without it; failed() tells the program, for its exit status. A run killed outright leaves its rows in PATH.tmp.<pid>.<n>.
#pragma once

#include "paradyse/core/atomic_file.hpp"
#include "paradyse/core/error.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse {

class CsvTable {
public:
  // What a failure to write the table does: throw (the default), or, for a side output of a long run, warn once on
  // stderr ("warning: --csv FILE: writing failed: No space left on device; ...") and write no more rows (failed()
  // then says so; the old table, if any, is kept).
  enum class OnFailure { throws, warns };

  CsvTable() = default;
  // `flag` names the table in messages: the flag that gave its path.
  CsvTable(const std::string& path, std::vector<std::string> columns, OnFailure on_failure = OnFailure::throws,
           const std::string& flag = "--csv")
      : columns_(columns.size()), on_failure_(on_failure) {
    if (path.empty()) return;
    guarded([&] {
      file_ = std::make_unique<AtomicFile>(path, flag);
      write_line(columns);
    });
  }
  CsvTable(const CsvTable&) = delete;
  CsvTable& operator=(const CsvTable&) = delete;
  ~CsvTable() {
    if (!file_ || !file_->open()) return;
    try {
      file_->commit();
    } catch (const std::exception& e) {  // a destructor cannot throw: say so instead of losing it silently
      std::fprintf(stderr, "warning: %s\n", e.what());
    }
  }
  // Puts the table in place; throws (naming the file and the reason) when it cannot. Later rows are refused.
  void close() {
    if (file_ && file_->open()) guarded([&] { file_->commit(); });
  }
  bool enabled() const noexcept { return file_ != nullptr; }
  // Whether writing the table failed (OnFailure::warns: warned, and no more rows written).
  bool failed() const noexcept { return failed_; }

  // One row: as many fields as columns, each formatted by fmt ("{}").
  template <class... Fields>
  void row(const Fields&... fields) {
    if (!file_) return;
    std::vector<std::string> texts{fmt::format("{}", fields)...};
    check(texts.size() == columns_, "CsvTable: a row of {} fields for {} columns", texts.size(), columns_);
    guarded([&] { write_line(texts); });
  }

  // One row of fields already formatted, as many as columns (for rows whose width is known at run time).
  void row_of(const std::vector<std::string>& fields) {
    if (!file_) return;
    check(fields.size() == columns_, "CsvTable: a row of {} fields for {} columns", fields.size(), columns_);
    guarded([&] { write_line(fields); });
  }

  // A field as CSV writes it: quoted when it holds a comma, a quote or a line break (quotes doubled).
  static std::string quoted(std::string_view field) {
    if (field.find_first_of(",\"\n\r") == std::string_view::npos) return std::string(field);
    std::string out = "\"";
    for (char c : field) {
      if (c == '"') out += '"';
      out += c;
    }
    return out + '"';
  }

private:
  void write_line(const std::vector<std::string>& fields) {
    std::string line;
    for (std::size_t i = 0; i < fields.size(); ++i) line += (i ? "," : "") + quoted(fields[i]);
    line += '\n';
    file_->write(line);  // throws naming the file and the system's reason; the old table is kept
  }

  // Runs a write of the table: its Error is thrown, or (OnFailure::warns) reported once and the table dropped.
  template <class Io>
  void guarded(Io&& io) {
    if (on_failure_ == OnFailure::throws) return io();
    try {
      io();
    } catch (const Error& e) {
      file_.reset();  // abandoned: the old table (if any) is kept
      failed_ = true;
      std::fprintf(stderr, "warning: %s; the run goes on without this table\n", e.what());
    }
  }

  std::unique_ptr<AtomicFile> file_;
  std::size_t columns_ = 0;
  OnFailure on_failure_ = OnFailure::throws;
  bool failed_ = false;
};

}  // namespace paradyse
