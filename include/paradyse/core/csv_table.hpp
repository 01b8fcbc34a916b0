// paradyse/core/csv_table.hpp: the tables the example programs and benchmarks print, also written as CSV
// (`--csv FILE`) for scripts/plot.py and spreadsheets.
//
//   CsvTable csv(path, {"step", "length", "loss"});   // an empty path writes nothing
//   csv.row(step, length, fmt::format("{:.17g}", loss));
//   csv.row_of(fields);                                 // a std::vector<std::string>, one per column
//
// One header line, then one line per row; a field holding a comma, a quote or a line break is quoted (RFC 4180).
// Every row is flushed as it is written, so a run stopped early leaves the rows so far. Numbers are written by fmt
// (doubles as the shortest text that reads back to the same value).
#pragma once

#include "paradyse/core/error.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse {

class CsvTable {
public:
  CsvTable() = default;
  CsvTable(const std::string& path, std::vector<std::string> columns) : columns_(columns.size()) {
    if (path.empty()) return;
    errno = 0;
    file_ = std::fopen(path.c_str(), "w");
    const int error = errno;  // read before check's arguments are formed (their order is unspecified)
    check(file_ != nullptr, "--csv {}: cannot create the file: {}", path, std::strerror(error));
    path_ = path;
    try {
      write_line(columns);
    } catch (...) {  // the destructor does not run for a constructor that throws
      std::fclose(file_);
      throw;
    }
  }
  CsvTable(const CsvTable&) = delete;
  CsvTable& operator=(const CsvTable&) = delete;
  ~CsvTable() {
    if (file_) std::fclose(file_);
  }
  bool enabled() const noexcept { return file_ != nullptr; }

  // One row: as many fields as columns, each formatted by fmt ("{}").
  template <class... Fields>
  void row(const Fields&... fields) {
    if (!file_) return;
    std::vector<std::string> texts{fmt::format("{}", fields)...};
    check(texts.size() == columns_, "CsvTable: a row of {} fields for {} columns", texts.size(), columns_);
    write_line(texts);
  }

  // One row of fields already formatted, as many as columns (for rows whose width is known at run time).
  void row_of(const std::vector<std::string>& fields) {
    if (!file_) return;
    check(fields.size() == columns_, "CsvTable: a row of {} fields for {} columns", fields.size(), columns_);
    write_line(fields);
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
    // The error is taken right after the failing call: errno read inside check's argument list could be read before
    // the write (unspecified order) and say "Success"; a short write that sets no errno says so.
    errno = 0;
    const bool written = std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0;
    const int error = errno;
    check(written, "--csv {}: writing failed: {}", path_, error != 0 ? std::strerror(error) : "short write");
  }

  std::FILE* file_ = nullptr;
  std::string path_;
  std::size_t columns_ = 0;
};

}  // namespace paradyse
