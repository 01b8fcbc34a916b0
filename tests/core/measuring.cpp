// Tests of the measuring helpers in core/: the CSV writer (core/csv_table.hpp: quoting, rows of run-time width, a
// failed write naming the system's reason), percentiles beside the median (core/statistics.hpp) and the stopwatch
// (core/timer.hpp).
#include "paradyse/core/csv_table.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/timer.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace paradyse;

TEST_CASE("CsvTable: one header line, quoted fields where needed, rows of run-time width") {
  const std::filesystem::path path = std::filesystem::temp_directory_path() / "paradyse_csv_table_test.csv";
  {
    CsvTable csv(path.string(), {"name", "value"});
    CHECK(csv.enabled());
    csv.row("plain", 1.5);
    csv.row("a, b", "say \"hi\"");
    csv.row_of({"x", "2"});
    CHECK_THROWS_AS(csv.row("one field"), Error);
    CHECK_THROWS_AS(csv.row_of({"a", "b", "c"}), Error);
  }
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  CHECK(text.str() == "name,value\nplain,1.5\n\"a, b\",\"say \"\"hi\"\"\"\nx,2\n");
  std::filesystem::remove(path);
  CsvTable none("", {"a"});
  CHECK_FALSE(none.enabled());
  none.row(1);  // writes nothing
}

TEST_CASE("CsvTable: a failed create or write names the system's reason") {
  try {
    CsvTable csv("/nonexistent-folder/x.csv", {"a"});
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("No such file or directory") != std::string::npos);
  }
  if (std::filesystem::exists("/dev/full")) {
    try {
      CsvTable csv("/dev/full", {"a"});
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find("No space left on device") != std::string::npos);
      CHECK(std::string(e.what()).find("Success") == std::string::npos);
    }
  }
}

TEST_CASE("percentile: linear between the sorted values; the median at 0.5") {
  const std::vector<double> v{4, 1, 3, 2};
  CHECK(percentile(v, 0.5) == doctest::Approx(median(v)));
  CHECK(percentile(v, 0.0) == 1);
  CHECK(percentile(v, 1.0) == 4);
  CHECK(percentile(v, 0.25) == doctest::Approx(1.75));
  CHECK(percentile({}, 0.5) == 0);
}

TEST_CASE("expected_max_of_normals: the closed forms for 2 and 3, Tippett's table beyond, tabulated and integrated") {
  const double pi = std::acos(-1.0);
  CHECK(expected_max_of_normals(1) == 0);
  CHECK(expected_max_of_normals(2) == doctest::Approx(1 / std::sqrt(pi)).epsilon(1e-9));
  CHECK(expected_max_of_normals(3) == doctest::Approx(1.5 / std::sqrt(pi)).epsilon(1e-9));
  // Tippett (1925) / Harter (1961), six decimals.
  CHECK(expected_max_of_normals(4) == doctest::Approx(1.029375).epsilon(1e-6));
  CHECK(expected_max_of_normals(5) == doctest::Approx(1.162964).epsilon(1e-6));
  CHECK(expected_max_of_normals(10) == doctest::Approx(1.538753).epsilon(1e-6));
  CHECK(expected_max_of_normals(100) == doctest::Approx(2.507594).epsilon(1e-6));  // past the table: integrated
  CHECK(expected_max_of_normals(64) < expected_max_of_normals(65));
  CHECK_THROWS_WITH_AS(expected_max_of_normals(0), doctest::Contains("p = 0"), Error);
}

TEST_CASE("Timer: wall seconds since the start, lap restarts") {
  Timer timer;
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double first = timer.lap();
  CHECK(first >= 0.019);
  CHECK(timer.seconds() < first + 1.0);
  CHECK(time_seconds([] { std::this_thread::sleep_for(std::chrono::milliseconds(5)); }) >= 0.004);
  const double cpu = thread_cpu_seconds();
  CHECK(cpu >= 0);
  CHECK(wall_seconds() > 0);
}
