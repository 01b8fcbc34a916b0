// paradyse/core/json.hpp: a small JSON value with a reader and a writer, enough for hardware profiles (cost/) and
// Alloc-MoE's sensitivity tables (moe/). It depends on core/ only, so every layer may use it.
//
// Objects keep their keys in insertion order (so a saved profile reads in the order it was written). Numbers are
// doubles written with 17 significant digits, so a value survives a save/load round trip bit for bit. Errors name
// the line and column of the bad input, the member it was in (gemm.flops_per_s, collectives[3].op), what was
// expected there and what was found (a byte that is not printable ASCII as its hex code, so that a binary file
// gives a readable message). A number beyond the range of a double (1e999) is an error, not infinity.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/printable.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace paradyse::json {

class Value;
using Array = std::vector<Value>;
using Object = std::vector<std::pair<std::string, Value>>;

class Value {
public:
  Value() = default;                                     // null
  Value(std::nullptr_t) {}
  Value(bool b) : data_(b) {}
  Value(double x) : data_(x) {}
  Value(int x) : data_(double(x)) {}
  Value(std::int64_t x) : data_(double(x)) {}
  Value(const char* s) : data_(std::string(s)) {}
  Value(std::string s) : data_(std::move(s)) {}
  Value(Array a) : data_(std::move(a)) {}
  Value(Object o) : data_(std::move(o)) {}

  bool is_null() const { return std::holds_alternative<std::monostate>(data_); }
  bool is_bool() const { return std::holds_alternative<bool>(data_); }
  bool is_number() const { return std::holds_alternative<double>(data_); }
  bool is_string() const { return std::holds_alternative<std::string>(data_); }
  bool is_array() const { return std::holds_alternative<Array>(data_); }
  bool is_object() const { return std::holds_alternative<Object>(data_); }

  bool as_bool() const { return get<bool>("a boolean"); }
  double as_number() const { return get<double>("a number"); }
  std::int64_t as_int() const {
    const double x = as_number();
    check(std::floor(x) == x && std::abs(x) < 9.007199254740992e15, "json: {} is not an integer", x);
    return std::int64_t(x);
  }
  const std::string& as_string() const { return get<std::string>("a string"); }
  const Array& as_array() const { return get<Array>("an array"); }
  Array& as_array() { return const_cast<Array&>(std::as_const(*this).as_array()); }
  const Object& as_object() const { return get<Object>("an object"); }
  Object& as_object() { return const_cast<Object&>(std::as_const(*this).as_object()); }

  // The member `key` of an object, or nullptr when absent.
  const Value* find(std::string_view key) const {
    for (const auto& [k, v] : as_object())
      if (k == key) return &v;
    return nullptr;
  }
  // The member `key` of an object; throws naming the key when absent.
  const Value& at(std::string_view key) const {
    const Value* v = find(key);
    check(v != nullptr, "json: missing key \"{}\"", key);
    return *v;
  }
  // Adds or replaces a member of an object (a null value becomes an empty object first).
  Value& set(std::string key, Value value) {
    if (is_null()) data_ = Object{};
    for (auto& [k, v] : as_object())
      if (k == key) return v = std::move(value);
    as_object().emplace_back(std::move(key), std::move(value));
    return as_object().back().second;
  }

  std::string_view type_name() const {
    constexpr std::string_view names[] = {"null", "boolean", "number", "string", "array", "object"};
    return names[data_.index()];
  }

private:
  template <class T>
  const T& get(std::string_view what) const {
    const T* p = std::get_if<T>(&data_);
    check(p != nullptr, "json: expected {}, found {}", what, type_name());
    return *p;
  }
  std::variant<std::monostate, bool, double, std::string, Array, Object> data_;
};

namespace detail {

class Parser {
public:
  explicit Parser(std::string_view text, std::string_view source = {}) : text_(text), source_(source) {}

  Value parse_document() {
    Value v = parse_value(0);
    skip_space();
    if (pos_ != text_.size()) fail("end of input");
    return v;
  }

private:
  [[noreturn]] void fail(std::string_view expected) const {
    std::size_t line = 1, column = 1;
    for (std::size_t i = 0; i < pos_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') ++line, column = 1;
      else ++column;
    }
    std::string found = "end of input";
    if (pos_ < text_.size()) {
      const auto byte = static_cast<unsigned char>(text_[pos_]);
      found = byte >= 0x20 && byte < 0x7f ? fmt::format("'{}'", char(byte)) : fmt::format("byte 0x{:02x}", byte);
    }
    throw Error(fmt::format("json: {}{}line {} column {}{}: expected {}, found {}", printable(source_),
                            source_.empty() ? "" : ": ", line, column, where(), expected, found));
  }
  // " (in a.b[2].c)" for the member being parsed, or nothing at the top level.
  std::string where() const {
    if (path_.empty()) return {};
    std::string out = " (in ";
    for (std::size_t i = 0; i < path_.size(); ++i) {
      if (i && path_[i][0] != '[') out += '.';
      out += printable(path_[i]);
    }
    return out + ")";
  }
  void skip_space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' ||
                                   text_[pos_] == '\r'))
      ++pos_;
  }
  bool consume(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) return ++pos_, true;
    return false;
  }
  void expect(char c) {
    if (!consume(c)) fail(fmt::format("'{}'", c));
  }
  bool consume_word(std::string_view word) {
    if (text_.substr(pos_, word.size()) == word) return pos_ += word.size(), true;
    return false;
  }

  Value parse_value(int depth) {
    if (depth > 256) fail("less nesting (256 levels at most)");
    skip_space();
    if (pos_ >= text_.size()) fail("a value");
    const char c = text_[pos_];
    if (c == '{') return parse_object(depth);
    if (c == '[') return parse_array(depth);
    if (c == '"') return Value(parse_string());
    if (consume_word("true")) return Value(true);
    if (consume_word("false")) return Value(false);
    if (consume_word("null")) return Value();
    if (c == '-' || (c >= '0' && c <= '9')) return Value(parse_number());
    fail("a value");
  }

  Value parse_object(int depth) {
    expect('{');
    Object object;
    if (consume('}')) return Value(std::move(object));
    do {
      skip_space();
      if (pos_ >= text_.size() || text_[pos_] != '"') fail("a string key");
      std::string key = parse_string();
      expect(':');
      path_.push_back(key);
      Value value = parse_value(depth + 1);
      path_.pop_back();
      object.emplace_back(std::move(key), std::move(value));
    } while (consume(','));
    expect('}');
    return Value(std::move(object));
  }

  Value parse_array(int depth) {
    expect('[');
    Array array;
    if (consume(']')) return Value(std::move(array));
    do {
      path_.push_back(fmt::format("[{}]", array.size()));
      array.push_back(parse_value(depth + 1));
      path_.pop_back();
    } while (consume(','));
    expect(']');
    return Value(std::move(array));
  }

  double parse_number() {
    const std::size_t start = pos_;
    if (text_[pos_] == '-') ++pos_;
    auto digits = [&] {
      const std::size_t from = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      if (pos_ == from) fail("a digit");
    };
    digits();
    if (pos_ < text_.size() && text_[pos_] == '.') ++pos_, digits();
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      digits();
    }
    const std::string token(text_.substr(start, pos_ - start));
    const double x = std::strtod(token.c_str(), nullptr);
    if (!std::isfinite(x)) {
      pos_ = start;
      fail(fmt::format("a number within the range of a double (|x| < 1.8e308), not {}", token));
    }
    return x;
  }

  static void append_utf8(std::string& out, std::uint32_t code) {
    if (code < 0x80) out += char(code);
    else if (code < 0x800) out += char(0xc0 | (code >> 6)), out += char(0x80 | (code & 0x3f));
    else if (code < 0x10000)
      out += char(0xe0 | (code >> 12)), out += char(0x80 | ((code >> 6) & 0x3f)), out += char(0x80 | (code & 0x3f));
    else
      out += char(0xf0 | (code >> 18)), out += char(0x80 | ((code >> 12) & 0x3f)),
          out += char(0x80 | ((code >> 6) & 0x3f)), out += char(0x80 | (code & 0x3f));
  }

  std::uint32_t parse_hex4() {
    std::uint32_t code = 0;
    for (int i = 0; i < 4; ++i, ++pos_) {
      if (pos_ >= text_.size()) fail("four hex digits");
      const char h = text_[pos_];
      code <<= 4;
      if (h >= '0' && h <= '9') code |= std::uint32_t(h - '0');
      else if (h >= 'a' && h <= 'f') code |= std::uint32_t(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') code |= std::uint32_t(h - 'A' + 10);
      else fail("a hex digit");
    }
    return code;
  }

  std::string parse_string() {
    ++pos_;  // the opening quote
    std::string out;
    while (true) {
      if (pos_ >= text_.size()) fail("a closing '\"'");
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) --pos_, fail("no control character inside a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) fail("an escape character");
      switch (text_[pos_++]) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t code = parse_hex4();
          if (code >= 0xd800 && code < 0xdc00 && consume_word("\\u")) {  // a surrogate pair
            const std::uint32_t low = parse_hex4();
            code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
          }
          append_utf8(out, code);
          break;
        }
        default: --pos_, fail("one of \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u");
      }
    }
  }

  std::string_view text_;
  std::string_view source_;        // the file name, for messages
  std::size_t pos_ = 0;
  std::vector<std::string> path_;  // the members being parsed, outermost first
};

inline void write_string(std::string& out, std::string_view s) {
  out += '"';
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) out += fmt::format("\\u{:04x}", int(c));
        else out += c;
    }
  }
  out += '"';
}

inline void write_value(std::string& out, const Value& v, int indent, int depth) {
  const auto newline = [&](int d) {
    if (indent <= 0) return;
    out += '\n';
    out.append(std::size_t(indent * d), ' ');
  };
  if (v.is_null()) out += "null";
  else if (v.is_bool()) out += v.as_bool() ? "true" : "false";
  else if (v.is_number()) {
    const double x = v.as_number();
    check(std::isfinite(x), "json: cannot write the non-finite number {}", x);
    if (std::floor(x) == x && std::abs(x) < 1e15) out += fmt::format("{}", std::int64_t(x));
    else out += fmt::format("{:.17g}", x);
  } else if (v.is_string()) write_string(out, v.as_string());
  else if (v.is_array()) {
    const Array& a = v.as_array();
    // Arrays of numbers stay on one line: tables of fitted coefficients read better that way.
    bool flat = true;
    for (const Value& e : a) flat = flat && (e.is_number() || e.is_bool() || e.is_null());
    out += '[';
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (i) out += flat ? ", " : ",";
      if (!flat) newline(depth + 1);
      write_value(out, a[i], indent, depth + 1);
    }
    if (!flat && !a.empty()) newline(depth);
    out += ']';
  } else {
    const Object& o = v.as_object();
    out += '{';
    for (std::size_t i = 0; i < o.size(); ++i) {
      if (i) out += ',';
      newline(depth + 1);
      write_string(out, o[i].first);
      out += indent > 0 ? ": " : ":";
      write_value(out, o[i].second, indent, depth + 1);
    }
    if (!o.empty()) newline(depth);
    out += '}';
  }
}

}  // namespace detail

// `source` (a file name) prefixes error messages.
inline Value parse(std::string_view text, std::string_view source = {}) {
  return detail::Parser(text, source).parse_document();
}

// indent 0 writes one line; indent > 0 pretty-prints with that many spaces per level.
inline std::string dump(const Value& value, int indent = 2) {
  std::string out;
  detail::write_value(out, value, indent, 0);
  return out;
}

// Errors name the file.
inline Value load_file(const std::string& path) {
  std::error_code error;
  check(!std::filesystem::is_directory(path, error), "json: \"{}\" is a folder, not a JSON file", path);
  std::ifstream in(path, std::ios::binary);
  check(bool(in), "json: cannot open \"{}\" for reading", path);
  std::ostringstream text;
  text << in.rdbuf();
  check(!in.bad(), "json: reading \"{}\" failed", path);
  return parse(text.str(), path);
}

inline void save_file(const Value& value, const std::string& path) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  check(bool(out), "json: cannot open \"{}\" for writing", path);
  out << dump(value) << '\n';
  check(bool(out), "json: writing \"{}\" failed", path);
}

}  // namespace paradyse::json
