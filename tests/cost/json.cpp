// Tests of paradyse/core/json.hpp: parsing, writing, round trips and error messages.
#include "paradyse/core/json.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

using namespace paradyse;

TEST_CASE("json: parses every kind of value") {
  const json::Value v = json::parse(R"( {"a": [1, -2.5e3, true, false, null], "b": {"c": "x\"y\\z\n\u00e9"}, "d": {}} )");
  const json::Array& a = v.at("a").as_array();
  REQUIRE(a.size() == 5);
  CHECK(a[0].as_int() == 1);
  CHECK(a[1].as_number() == -2500.0);
  CHECK(a[2].as_bool());
  CHECK_FALSE(a[3].as_bool());
  CHECK(a[4].is_null());
  CHECK(v.at("b").at("c").as_string() == "x\"y\\z\n\xc3\xa9");
  CHECK(v.at("d").as_object().empty());
  CHECK(v.find("missing") == nullptr);
}

TEST_CASE("json: doubles survive a round trip bit for bit, and keys keep their order") {
  json::Value v;
  const double values[] = {0.1, 1.0 / 3.0, 6.02214076e23, 1e-300, -0.0, 123456789012.0, 2.5e-11};
  json::Array a;
  for (double x : values) a.push_back(x);
  v.set("zeta", json::Value(a));
  v.set("alpha", "text");
  v.set("count", std::int64_t(1) << 40);
  for (int indent : {0, 2}) {
    const json::Value back = json::parse(json::dump(v, indent));
    const json::Array& b = back.at("zeta").as_array();
    REQUIRE(b.size() == std::size(values));
    for (std::size_t i = 0; i < b.size(); ++i) CHECK(b[i].as_number() == values[i]);
    CHECK(back.as_object()[0].first == "zeta");
    CHECK(back.as_object()[1].first == "alpha");
    CHECK(back.at("count").as_int() == (std::int64_t(1) << 40));
  }
}

TEST_CASE("json: set replaces an existing key") {
  json::Value v;
  v.set("k", 1);
  v.set("k", 2);
  CHECK(v.as_object().size() == 1);
  CHECK(v.at("k").as_int() == 2);
}

TEST_CASE("json: bad input names the line, column and what was expected") {
  const auto message = [](const char* text) {
    try {
      json::parse(text);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message("{\"a\": 1,\n \"b\" 2}").find("line 2 column 6: expected ':'") != std::string::npos);
  CHECK(message("[1, 2").find("expected ']'") != std::string::npos);
  CHECK(message("{} x").find("expected end of input") != std::string::npos);
  CHECK(message("nul").find("expected a value") != std::string::npos);
  CHECK(message("\"abc").find("closing") != std::string::npos);
  CHECK_THROWS_AS(json::parse("{}").at("nothing"), Error);
  CHECK_THROWS_WITH_AS(json::parse("\"s\"").as_number(), doctest::Contains("expected a number, found string"), Error);
  CHECK_THROWS_WITH_AS(json::parse("1.5").as_int(), doctest::Contains("not an integer"), Error);
}

TEST_CASE("json: writing a non-finite number is an error") {
  CHECK_THROWS_AS(json::dump(json::Value(std::nan(""))), Error);
}

TEST_CASE("json: a binary input's message shows the bad byte and is not cut at a NUL") {
  const std::string binary("{\"name\": \0\x01\x02 more", 18);
  std::string message;
  try {
    json::parse(binary, "profile.bin");
  } catch (const Error& e) {
    message = e.what();
  }
  CAPTURE(message);
  CHECK(message.find("json: profile.bin: line 1 column 10 (in name): expected a value, found byte 0x00") != std::string::npos);
  CHECK(message.find("[json.hpp:") != std::string::npos);  // the source location after the byte: nothing was cut
  CHECK_THROWS_WITH_AS(json::parse("\x89PNG"), doctest::Contains("found byte 0x89"), Error);
}

TEST_CASE("json: a number beyond a double is an error naming the member, not infinity") {
  CHECK_THROWS_WITH_AS(json::parse("{\"gemm\": {\"flops_per_s\": 1e999}}"),
                       doctest::Contains("(in gemm.flops_per_s): expected a number within the range of a double (|x| < 1.8e308), not 1e999"),
                       Error);
  CHECK_THROWS_WITH_AS(json::parse("[1, [2, -1e400]]"), doctest::Contains("(in [1][1])"), Error);
  CHECK(json::parse("1e-400").as_number() == 0.0);  // underflow to zero is harmless
  CHECK(json::parse("1.7976931348623157e308").as_number() > 1e308);
}

TEST_CASE("json: load_file names the file, and a folder is not a JSON file") {
  const std::string folder = ".";
  CHECK_THROWS_WITH_AS(json::load_file(folder), doctest::Contains("\".\" is a folder, not a JSON file"), Error);
  const std::string path = "test_cost_json_bad.json";
  {
    std::ofstream out(path, std::ios::binary);
    out << "{\n  \"a\": tru\n}";
  }
  CHECK_THROWS_WITH_AS(json::load_file(path), doctest::Contains("json: test_cost_json_bad.json: line 2 column 8 (in a)"),
                       Error);
  std::remove(path.c_str());
}
