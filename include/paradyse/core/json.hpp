// paradyse/core/json.hpp: JSON for hardware profiles (cost/), sensitivity tables (moe/), cluster and model files
// (search/), Hugging Face config.json and safetensors headers (serve/, model/) and the programs' JSON output.
//
// The values are nlohmann/json's ordered_json (Debian nlohmann-json3-dev): objects keep their keys in insertion
// order, so a saved file reads in the order it was written. This header adds what the library's users rely on:
//   - parse(): errors name the file, the line and column, the member being read (gemm.flops_per_s,
//     collectives[3].op) and what nlohmann's parser expected and found, quoted printably (a binary file gives a
//     readable message, never one cut at a NUL). A number beyond the range of a double (1e999) is an error, not
//     infinity, and nesting deeper than 256 levels is refused.
//   - dump(): doubles are written in the shortest form that reads back to the same bits (nlohmann's to_chars), and
//     a non-finite number is an error naming its member (nlohmann would write null).
//   - Field: typed reading of a parsed document. Every error names the member by its full path, what was expected
//     and what was found: "profile: gemm.flops_per_s is string, expected a number".
// Include it only where JSON is read or written: nlohmann's header is large, and core headers that every unit
// includes must not pull it in.
#pragma once

#include "paradyse/core/atomic_file.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/printable.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse::json {

// A JSON value: null, boolean, number (integer or double), string, array or object (keys in insertion order).
using Value = nlohmann::ordered_json;

// "null", "boolean", "number", "string", "array" or "object".
inline std::string_view type_name(const Value& v) {
  if (v.is_number()) return "number";
  return v.type_name();
}

inline constexpr int kMaxDepth = 256;

namespace detail {

// A char iterator that records how far the parser has read, so that an error found by our own checks (a number
// out of range, too deep a nesting) gets a line and column like nlohmann's own parse errors.
struct CountingIterator {
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;
  const char* at = nullptr;
  const char** furthest = nullptr;
  reference operator*() const { return *at; }
  CountingIterator& operator++() {
    if (++at > *furthest) *furthest = at;
    return *this;
  }
  CountingIterator operator++(int) {
    CountingIterator before = *this;
    ++*this;
    return before;
  }
  bool operator==(const CountingIterator& other) const { return at == other.at; }
};

// Builds the Value through nlohmann's SAX interface while keeping the path of the member being parsed.
class Builder {
public:
  Builder(std::string_view text, const char** furthest) : text_(text), furthest_(furthest) {}

  bool null() { return add(Value(nullptr)); }
  bool boolean(bool b) { return add(Value(b)); }
  bool number_integer(Value::number_integer_t x) { return add(Value(x)); }
  bool number_unsigned(Value::number_unsigned_t x) { return add(Value(x)); }
  bool number_float(Value::number_float_t x, const std::string& token) {
    if (std::isfinite(x)) return add(Value(x));
    // The token ends at the furthest byte read or one before it (the parser reads one past a number).
    const std::size_t start = text_.rfind(token, consumed());
    return fail(start == std::string_view::npos ? consumed() : start,
                fmt::format("expected a number within the range of a double (|x| < 1.8e308), not {}", printable(token)));
  }
  bool string(std::string& s) { return add(Value(std::move(s))); }
  bool binary(Value::binary_t&) { return fail(consumed(), "expected no binary value"); }
  bool start_object(std::size_t) { return open(Value::object()); }
  bool key(std::string& k) {
    frames_.back().key = std::move(k);
    frames_.back().has_key = true;
    return true;
  }
  bool end_object() { return close(); }
  bool start_array(std::size_t) { return open(Value::array()); }
  bool end_array() { return close(); }
  bool parse_error(std::size_t byte, const std::string& token, const nlohmann::detail::exception& e) {
    if (e.id == 406) {  // out_of_range.406: a number beyond a double; point at its first byte
      const std::size_t start = text_.rfind(token, byte);
      return fail(start == std::string_view::npos ? (byte > 0 ? byte - 1 : 0) : start,
                  fmt::format("expected a number within the range of a double (|x| < 1.8e308), not {}", token));
    }
    // e.what(): "[json.exception.parse_error.101] parse error at line 1, column 5: syntax error while ...".
    std::string_view what = e.what();
    const std::size_t head = what.find("parse error");
    const std::size_t colon = what.find(": ", head == std::string_view::npos ? 0 : head);
    if (colon != std::string_view::npos) what.remove_prefix(colon + 2);
    return fail(byte > 0 ? byte - 1 : 0, std::string(what));
  }

  Value root;
  std::size_t error_at = 0;  // byte offset of the error
  std::string error;         // empty when the parse succeeded
  std::string error_path;    // the member being parsed at the error

private:
  struct Frame {
    Value* value;
    std::string key;
    bool has_key = false;
  };
  std::size_t consumed() const { return std::size_t(*furthest_ - text_.data()); }

  bool fail(std::size_t at, std::string message) {
    if (!error.empty()) return false;
    error_at = at;
    error = std::move(message);
    error_path = path();
    return false;
  }
  // "a.b[2].c": the members being parsed, outermost first (an object's key until its value is complete, an
  // array's index of the element being parsed).
  std::string path() const {
    std::string out;
    for (std::size_t i = 0; i < frames_.size(); ++i) {
      const Frame& f = frames_[i];
      const bool innermost = i + 1 == frames_.size();
      if (f.value->is_array()) out += fmt::format("[{}]", f.value->size() - (innermost ? 0 : 1));
      else if (f.has_key) out += (out.empty() ? "" : ".") + printable(f.key);
      else break;
    }
    return out;
  }
  Value* insert(Value v) {
    if (frames_.empty()) {
      root = std::move(v);
      return &root;
    }
    Frame& top = frames_.back();
    if (top.value->is_array()) {
      top.value->push_back(std::move(v));
      return &top.value->back();
    }
    // Appended without a lookup (ordered_json's find is linear: a lookup per key would make a safetensors header
    // of 10^4 tensors quadratic). A repeated key is kept as in the file; find() and Field see its first value.
    auto& members = top.value->get_ref<Value::object_t&>();
    members.emplace_back(top.key, std::move(v));  // a copy: the path names an open member by its key
    return &members.back().second;
  }
  bool add(Value v) {
    insert(std::move(v));
    if (!frames_.empty()) frames_.back().has_key = false;  // the member is complete
    return true;
  }
  bool open(Value container) {
    if (frames_.size() >= std::size_t(kMaxDepth))
      return fail(consumed() > 0 ? consumed() - 1 : 0, fmt::format("expected less nesting ({} levels at most)", kMaxDepth));
    frames_.push_back({insert(std::move(container)), {}, false});
    return true;
  }
  bool close() {
    frames_.pop_back();
    if (!frames_.empty() && !frames_.back().value->is_array()) frames_.back().has_key = false;
    return true;
  }

  std::string_view text_;
  const char** furthest_;
  std::vector<Frame> frames_;
};

inline std::pair<std::size_t, std::size_t> line_and_column(std::string_view text, std::size_t at) {
  std::size_t line = 1, column = 1;
  for (std::size_t i = 0; i < at && i < text.size(); ++i) {
    if (text[i] == '\n') ++line, column = 1;
    else ++column;
  }
  return {line, column};
}

inline void check_finite(const Value& v, std::string& path) {
  if (v.is_number_float()) {
    const double x = v.get<double>();
    check(std::isfinite(x), "json: cannot write the non-finite number {}{}", x,
          path.empty() ? "" : fmt::format(" (in {})", path));
  } else if (v.is_array()) {
    for (std::size_t i = 0; i < v.size(); ++i) {
      const std::size_t length = path.size();
      path += fmt::format("[{}]", i);
      check_finite(v[i], path);
      path.resize(length);
    }
  } else if (v.is_object()) {
    for (const auto& [key, member] : v.items()) {
      const std::size_t length = path.size();
      path += (path.empty() ? "" : ".") + printable(key);
      check_finite(member, path);
      path.resize(length);
    }
  }
}

}  // namespace detail

// Parses one JSON document; `source` (a file name) prefixes error messages:
//   json: profile.json: line 3 column 18 (in gemm.flops_per_s): expected a number within the range of a double ...
inline Value parse(std::string_view text, std::string_view source = {}) {
  const char* furthest = text.data();
  detail::Builder builder(text, &furthest);
  const detail::CountingIterator first{text.data(), &furthest}, last{text.data() + text.size(), &furthest};
  bool ok = false;
  try {
    ok = Value::sax_parse(first, last, &builder);
  } catch (const nlohmann::json::exception& e) {  // defensive: the SAX interface reports through parse_error
    throw Error(fmt::format("json: {}{}{}", printable(source), source.empty() ? "" : ": ", printable(e.what())));
  }
  if (!ok || !builder.error.empty()) {
    const auto [line, column] = detail::line_and_column(text, builder.error_at);
    // nlohmann reads a NUL as the end of the input: name the byte that stopped it when it is not printable text.
    std::string found;
    if (builder.error_at < text.size()) {
      const auto byte = static_cast<unsigned char>(text[builder.error_at]);
      if ((byte < 0x20 || byte >= 0x7f) && byte != '\n' && byte != '\r' && byte != '\t')
        found = fmt::format(", found byte 0x{:02x}", byte);
    }
    throw Error(fmt::format("json: {}{}line {} column {}{}: {}{}", printable(source), source.empty() ? "" : ": ", line,
                            column, builder.error_path.empty() ? "" : fmt::format(" (in {})", builder.error_path),
                            printable(builder.error), found));
  }
  return std::move(builder.root);
}

// indent 0 writes one line; indent > 0 pretty-prints with that many spaces per level. Throws for a non-finite number.
inline std::string dump(const Value& value, int indent = 2) {
  std::string path;
  detail::check_finite(value, path);
  return value.dump(indent > 0 ? indent : -1);
}

// Errors name the file.
inline Value load_file(const std::string& path) {
  std::error_code error;
  check(!std::filesystem::is_directory(path, error), "json: \"{}\" is a folder, not a JSON file", printable(path));
  std::ifstream in(path, std::ios::binary);
  check(bool(in), "json: cannot open \"{}\" for reading", printable(path));
  std::ostringstream text;
  text << in.rdbuf();
  check(!in.bad(), "json: reading \"{}\" failed", printable(path));
  return parse(text.str(), path);
}

// Written atomically (core/atomic_file.hpp): a full disk or an unwritable folder throws naming the file and the
// reason, and the old file stays as it was. `what` names the file's role in messages (the flag that gave it).
inline void save_file(const Value& value, const std::string& path, const std::string& what = "json") {
  write_file_atomically(path, dump(value) + '\n', what);
}

// A member of a parsed document, for reading it with errors that name it. `context` begins every message (the
// format and file being read: "profile", "hf config model/config.json"); `path` is the member's full path.
//   const json::Field doc(value, "profile");
//   double rate = doc["gemm"]["flops_per_s"].number();   // profile: gemm.flops_per_s is string, expected a number
class Field {
public:
  Field(const Value& value, std::string context, std::string path = {})
      : value_(&value), context_(std::move(context)), path_(std::move(path)) {}

  const Value& value() const { return *value_; }
  const std::string& path() const { return path_; }
  const std::string& context() const { return context_; }
  // The path, or "the document" at the top level.
  std::string name() const { return path_.empty() ? std::string("the document") : path_; }

  // Throws "<context>: <message>".
  [[noreturn]] void fail(std::string_view message,
                         std::source_location where = std::source_location::current()) const {
    throw Error(fmt::format("{}: {}", context_, message), where);
  }
  // Throws "<context>: <path> is <type>, expected <what>" unless `ok`.
  void expect(bool ok, std::string_view what) const {
    if (!ok) fail(fmt::format("{} is {}, expected {}", name(), type_name(*value_), what));
  }

  bool is_null() const { return value_->is_null(); }
  bool is_object() const { return value_->is_object(); }
  bool is_array() const { return value_->is_array(); }
  bool has(std::string_view key) const { return value_->is_object() && value_->contains(key); }

  // The member `key` of an object; an error names the key when absent.
  Field operator[](std::string_view key) const {
    expect(value_->is_object(), "an object");
    const auto it = value_->find(key);
    if (it == value_->end())
      fail(fmt::format("missing key \"{}\"{}", printable(key), path_.empty() ? "" : fmt::format(" in {}", path_)));
    return Field(*it, context_, child(key));
  }
  // The member `key`, or nothing when it is absent (or null).
  std::optional<Field> find(std::string_view key) const {
    expect(value_->is_object(), "an object");
    const auto it = value_->find(key);
    if (it == value_->end() || it->is_null()) return std::nullopt;
    return Field(*it, context_, child(key));
  }
  // The elements of an array.
  std::vector<Field> elements() const {
    expect(value_->is_array(), "an array");
    std::vector<Field> out;
    out.reserve(value_->size());
    for (std::size_t i = 0; i < value_->size(); ++i)
      out.emplace_back((*value_)[i], context_, fmt::format("{}[{}]", path_, i));
    return out;
  }
  // The members of an object, in file order.
  std::vector<std::pair<std::string, Field>> members() const {
    expect(value_->is_object(), "an object");
    std::vector<std::pair<std::string, Field>> out;
    for (const auto& [key, v] : value_->items()) out.emplace_back(key, Field(v, context_, child(key)));
    return out;
  }
  std::size_t size() const {
    expect(value_->is_array() || value_->is_object(), "an array or an object");
    return value_->size();
  }

  // A finite number.
  double number() const {
    expect(value_->is_number(), "a number");
    const double x = value_->get<double>();
    if (!std::isfinite(x)) fail(fmt::format("{} = {} must be a finite number", name(), x));
    return x;
  }
  // An integer in [min, max] (a double with an integral value counts).
  std::int64_t integer(std::int64_t min = std::numeric_limits<std::int64_t>::min(),
                       std::int64_t max = std::numeric_limits<std::int64_t>::max()) const {
    expect(value_->is_number(), "an integer");
    if (value_->is_number_integer() && !value_->is_number_unsigned()) {
      const std::int64_t x = value_->get<std::int64_t>();
      if (x < min || x > max) fail(fmt::format("{} = {} must be an integer in [{}, {}]", name(), x, min, max));
      return x;
    }
    if (value_->is_number_unsigned() && value_->get<std::uint64_t>() <= std::uint64_t(max))
      return integer_in(std::int64_t(value_->get<std::uint64_t>()), min, max);
    const double x = value_->get<double>();
    if (!(std::floor(x) == x && x >= double(min) && x <= double(max)) || std::abs(x) >= 9.2e18)
      fail(fmt::format("{} = {} must be an integer in [{}, {}]", name(), x, min, max));
    return std::int64_t(x);
  }
  const std::string& string() const {
    expect(value_->is_string(), "a string");
    return value_->get_ref<const std::string&>();
  }
  bool boolean() const {
    expect(value_->is_boolean(), "a boolean");
    return value_->get<bool>();
  }

private:
  std::string child(std::string_view key) const {
    return path_.empty() ? printable(key) : fmt::format("{}.{}", path_, printable(key));
  }
  std::int64_t integer_in(std::int64_t x, std::int64_t min, std::int64_t max) const {
    if (x < min || x > max) fail(fmt::format("{} = {} must be an integer in [{}, {}]", name(), x, min, max));
    return x;
  }

  const Value* value_;
  std::string context_;
  std::string path_;
};

}  // namespace paradyse::json
