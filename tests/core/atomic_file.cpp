// Side outputs are written atomically and every failure names the file and the system's reason (issue 27): a full
// device, a missing or non-folder parent, a folder as target; the old file survives a failed or abandoned write.
#include "paradyse/core/atomic_file.hpp"
#include "paradyse/core/csv_table.hpp"
#include "paradyse/core/json.hpp"

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

using namespace paradyse;

namespace {
std::filesystem::path scratch_folder(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("paradyse_atomic_{}_{}", name, ::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}
std::string content_of(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}
std::string message_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(nothing thrown)";
}
bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("a full device is reported with the file and \"No space left on device\", never \"Success\"") {
  const std::string csv = message_of([] { CsvTable t("/dev/full", {"a", "b"}); });
  CHECK(has(csv, "--csv /dev/full: writing failed: No space left on device"));
  const std::string json = message_of([] { json::save_file(json::Value::object(), "/dev/full", "--table"); });
  CHECK(has(json, "--table /dev/full: writing failed: No space left on device"));
}

TEST_CASE("an unusable folder is reported with the file and the reason, and a folder is not a file name") {
  const auto dir = scratch_folder("folders");
  const std::string missing = (dir / "missing" / "t.csv").string();
  CHECK(has(message_of([&] { CsvTable t(missing, {"a"}); }), "--csv " + missing));
  CHECK(has(message_of([&] { CsvTable t(missing, {"a"}); }), "No such file or directory"));
  std::ofstream(dir / "plain") << "x";
  const std::string under_file = (dir / "plain" / "t.json").string();
  CHECK(has(message_of([&] { write_file_atomically(under_file, "{}", "json"); }), "Not a directory"));
  CHECK(has(message_of([&] { write_file_atomically(dir.string(), "{}", "--table"); }), "is a folder"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("the old file is kept until commit, and an abandoned write leaves no temporary file") {
  const auto dir = scratch_folder("keep");
  const auto target = dir / "table.csv";
  std::ofstream(target) << "old\n";
  {
    AtomicFile f(target.string(), "--csv");
    f.write("new\n");
    CHECK(content_of(target) == "old\n");  // untouched while writing
  }                                         // abandoned: no commit
  CHECK(content_of(target) == "old\n");
  CHECK(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()) == 1);
  {
    CsvTable t(target.string(), {"x", "y"});
    t.row(1, "a,b");
    CHECK(content_of(target) == "old\n");
    t.close();
  }
  CHECK(content_of(target) == "x,y\n1,\"a,b\"\n");
  CHECK(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()) == 1);
  write_file_atomically(target.string(), "z", "json");
  CHECK(content_of(target) == "z");
  std::filesystem::remove_all(dir);
}

TEST_CASE("a special file (/dev/null) is written in place, not replaced") {
  CHECK_NOTHROW(write_file_atomically("/dev/null", "text", "--csv"));
  CHECK(std::filesystem::is_character_file("/dev/null"));
}

TEST_CASE("a side table (OnFailure::warns) that fails warns once, writes no more rows and says failed(); the run goes on") {
  const auto dir = scratch_folder("warns");
  {
    CsvTable full("/dev/full", {"a", "b"}, CsvTable::OnFailure::warns);  // the header write fails: no throw
    CHECK(full.failed());
    CHECK_NOTHROW(full.row(1, 2));
    CHECK_NOTHROW(full.close());
  }
  {
    CsvTable missing((dir / "missing" / "t.csv").string(), {"a"}, CsvTable::OnFailure::warns);
    CHECK(missing.failed());
    CHECK_NOTHROW(missing.row(1));
  }
  const auto target = dir / "table.csv";
  std::ofstream(target) << "old\n";
  {
    CsvTable fine(target.string(), {"x"}, CsvTable::OnFailure::warns);
    fine.row(1);
    fine.close();
    CHECK(!fine.failed());
  }
  CHECK(content_of(target) == "x\n1\n");
  // The default still throws, naming the file and the reason.
  CHECK(has(message_of([] { CsvTable t("/dev/full", {"a"}); }), "No space left on device"));
  std::filesystem::remove_all(dir);
}
