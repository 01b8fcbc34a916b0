// Tests of paradyse/core/json.hpp (nlohmann ordered_json plus our parse errors, finite-number dump and json::Field):
// parsing, writing, round trips, key order and error messages.
#include "paradyse/core/json.hpp"

#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace paradyse;

namespace {

std::string parse_error(std::string_view text, std::string_view source = {}) {
  try {
    json::parse(text, source);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("json: parses every kind of value") {
  const json::Value v = json::parse(R"( {"a": [1, -2.5e3, true, false, null], "b": {"c": "x\"y\\z\n\u00e9"}, "d": {}} )");
  const json::Value& a = v.at("a");
  REQUIRE(a.size() == 5);
  CHECK(a[0].get<std::int64_t>() == 1);
  CHECK(a[1].get<double>() == -2500.0);
  CHECK(a[2].get<bool>());
  CHECK_FALSE(a[3].get<bool>());
  CHECK(a[4].is_null());
  CHECK(v.at("b").at("c").get<std::string>() == "x\"y\\z\n\xc3\xa9");
  CHECK(v.at("d").empty());
  CHECK(v.find("missing") == v.end());
  CHECK(json::type_name(a[0]) == "number");
  CHECK(json::type_name(a[1]) == "number");
  CHECK(json::type_name(v.at("d")) == "object");
}

TEST_CASE("json: doubles survive a round trip bit for bit, and keys keep their order") {
  // Fixed awkward values plus random bit patterns (every finite double must come back with the same bits).
  std::vector<double> values = {0.1, 1.0 / 3.0, 6.02214076e23, 1e-300, -0.0, 123456789012.0, 2.5e-11,
                                5e-324, 1.7976931348623157e308, 9007199254740993.0, 3.0};
  PARADYSE_FRESH_RNG(rng);
  while (values.size() < 2000) {
    const std::uint64_t bits = rng();
    double x;
    std::memcpy(&x, &bits, sizeof x);
    if (std::isfinite(x)) values.push_back(x);
  }
  json::Value v = json::Value::object();
  v["zeta"] = values;
  v["alpha"] = "text";
  v["count"] = std::int64_t(1) << 40;
  for (int indent : {0, 2}) {
    const json::Value back = json::parse(json::dump(v, indent));
    const json::Value& b = back.at("zeta");
    REQUIRE(b.size() == values.size());
    int same_bits = 0;
    for (std::size_t i = 0; i < b.size(); ++i) {
      const double x = b[i].get<double>();
      same_bits += std::memcmp(&x, &values[i], sizeof x) == 0;
    }
    CHECK(same_bits == int(values.size()));
    CHECK(back.begin().key() == "zeta");
    CHECK(std::next(back.begin()).key() == "alpha");
    CHECK(back.at("count").get<std::int64_t>() == (std::int64_t(1) << 40));
  }
  CHECK(json::dump(v, 0).find('\n') == std::string::npos);
}

TEST_CASE("json: assigning a key replaces it in place; a repeated key in a file keeps the first for lookups") {
  json::Value v = json::Value::object();
  v["k"] = 1;
  v["j"] = 0;
  v["k"] = 2;
  CHECK(v.size() == 2);
  CHECK(v.begin().key() == "k");
  CHECK(v.at("k").get<int>() == 2);
  const json::Value twice = json::parse(R"({"a": 1, "a": 2})");
  CHECK(twice.size() == 2);  // both kept, as in the file (a safetensors reader can refuse the duplicate)
  CHECK(json::Field(twice, "t")["a"].integer() == 1);
}

TEST_CASE("json: bad input names the line, column, member and what was expected") {
  CHECK(parse_error("{\"a\": 1,\n \"b\" 2}").find("line 2 column 6 (in b): ") != std::string::npos);
  CHECK(parse_error("{\"a\": 1,\n \"b\" 2}").find("expected ':'") != std::string::npos);
  CHECK(parse_error("[1, 2").find("expected ']'") != std::string::npos);
  CHECK(parse_error("{} x").find("expected end of input") != std::string::npos);
  CHECK(parse_error("nul").find("line 1 column 4: syntax error while parsing value - invalid literal") !=
        std::string::npos);
  CHECK(parse_error("\"abc").find("missing closing quote") != std::string::npos);
  CHECK(parse_error("{\"a\": [1, {\"b\": [true, tru]}]}").find("(in a[1].b[1])") != std::string::npos);
  CHECK(parse_error("").find("line 1 column 1: ") != std::string::npos);
  CHECK(parse_error(std::string(300, '[')).find("expected less nesting (256 levels at most)") != std::string::npos);
  CHECK(parse_error("[1]", "cfg.json").find("paradyse: json: cfg.json: line 1 column 4") == std::string::npos);
  CHECK(parse_error("[1", "cfg.json").find("paradyse: json: cfg.json: line 1 column 3") != std::string::npos);
}

TEST_CASE("json: Field reads typed members and names the path, the expected type and the found one") {
  const json::Value v = json::parse(R"({"gemm": {"flops_per_s": "fast", "n": 4, "x": 2.5, "big": 1e300},
                                        "collectives": [{"op": 3}], "flag": true, "empty": null})");
  const json::Field doc(v, "profile");
  CHECK(doc["gemm"]["n"].integer() == 4);
  CHECK(doc["gemm"]["n"].number() == 4.0);
  CHECK(doc["gemm"]["x"].number() == 2.5);
  CHECK(doc["flag"].boolean());
  CHECK(doc.has("gemm"));
  CHECK_FALSE(doc.has("nothing"));
  CHECK_FALSE(doc.find("empty").has_value());  // null counts as absent
  CHECK(doc.find("gemm")->path() == "gemm");
  CHECK(doc["collectives"].elements().at(0)["op"].path() == "collectives[0].op");
  CHECK(doc["gemm"].members().size() == 4);
  CHECK_THROWS_WITH_AS(doc["gemm"]["flops_per_s"].number(),
                       doctest::Contains("profile: gemm.flops_per_s is string, expected a number"), Error);
  CHECK_THROWS_WITH_AS(doc["collectives"].elements()[0]["op"].string(),
                       doctest::Contains("profile: collectives[0].op is number, expected a string"), Error);
  CHECK_THROWS_WITH_AS(doc["gemm"]["missing"], doctest::Contains("profile: missing key \"missing\" in gemm"), Error);
  CHECK_THROWS_WITH_AS(doc["flag"]["x"], doctest::Contains("profile: flag is boolean, expected an object"), Error);
  CHECK_THROWS_WITH_AS(doc["gemm"].elements(), doctest::Contains("profile: gemm is object, expected an array"), Error);
  CHECK_THROWS_WITH_AS(doc["gemm"]["x"].integer(), doctest::Contains("gemm.x = 2.5 must be an integer"), Error);
  CHECK_THROWS_WITH_AS(doc["gemm"]["n"].integer(5, 9), doctest::Contains("gemm.n = 4 must be an integer in [5, 9]"),
                       Error);
  CHECK_THROWS_WITH_AS(doc["gemm"]["big"].integer(), doctest::Contains("gemm.big = 1e+300 must be an integer"), Error);
  CHECK_THROWS_WITH_AS(doc["flag"].number(), doctest::Contains("flag is boolean, expected a number"), Error);
  json::Value with_inf = v;
  with_inf["gemm"]["x"] = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH_AS(json::Field(with_inf, "p")["gemm"]["x"].number(), doctest::Contains("gemm.x = inf must be a finite"),
                       Error);
  CHECK(json::Field(json::parse("18446744073709551615"), "u").number() > 1.8e19);
  CHECK_THROWS_AS(json::Field(json::parse("18446744073709551615"), "u").integer(), Error);
}

TEST_CASE("json: writing a non-finite number is an error naming the member") {
  CHECK_THROWS_AS(json::dump(json::Value(std::nan(""))), Error);
  json::Value v = json::Value::object();
  v["rates"] = {1.0, std::numeric_limits<double>::infinity()};
  CHECK_THROWS_WITH_AS(json::dump(v), doctest::Contains("cannot write the non-finite number inf (in rates[1])"), Error);
}

TEST_CASE("json: a binary input's message shows the bad byte and is not cut at a NUL") {
  const std::string binary("{\"name\": \0\x01\x02 more", 18);
  const std::string message = parse_error(binary, "profile.bin");
  CAPTURE(message);
  CHECK(message.find("json: profile.bin: line 1 column 10 (in name): ") != std::string::npos);
  CHECK(message.find("found byte 0x00") != std::string::npos);
  CHECK(message.find("[json.hpp:") != std::string::npos);  // the source location after the byte: nothing was cut
  CHECK(parse_error("\x89PNG").find("found byte 0x89") != std::string::npos);
  CHECK(parse_error("\x89PNG").find("\\x89") != std::string::npos);  // nlohmann's "last read" quoted printably
}

TEST_CASE("json: a number beyond a double is an error naming the member, not infinity") {
  CHECK_THROWS_WITH_AS(json::parse("{\"gemm\": {\"flops_per_s\": 1e999}}"),
                       doctest::Contains("line 1 column 26 (in gemm.flops_per_s): expected a number within the range "
                                         "of a double (|x| < 1.8e308), not 1e999"),
                       Error);
  CHECK_THROWS_WITH_AS(json::parse("[1, [2, -1e400]]"), doctest::Contains("(in [1][1])"), Error);
  CHECK(json::parse("1e-400").get<double>() == 0.0);  // underflow to zero is harmless
  CHECK(json::parse("1.7976931348623157e308").get<double>() > 1e308);
}

TEST_CASE("json: load_file names the file, and a folder is not a JSON file") {
  const std::string folder = ".";
  CHECK_THROWS_WITH_AS(json::load_file(folder), doctest::Contains("\".\" is a folder, not a JSON file"), Error);
  const std::string path = "test_cost_json_bad.json";
  {
    std::ofstream out(path, std::ios::binary);
    out << "{\n  \"a\": tru\n}";
  }
  CHECK_THROWS_WITH_AS(json::load_file(path), doctest::Contains("json: test_cost_json_bad.json: line 2 column "), Error);
  CHECK_THROWS_WITH_AS(json::load_file(path), doctest::Contains("(in a): syntax error while parsing value"), Error);
  json::Value v = json::Value::object();
  v["b"] = 0.1;
  v["a"] = json::Value::array({1, 2});
  json::save_file(v, path);
  const json::Value back = json::load_file(path);
  CHECK(back == v);
  CHECK(back.begin().key() == "b");
  std::remove(path.c_str());
}
