// paradyse/model/safetensors.hpp: the safetensors file format (read and write) and atomic file replacement.
//
// Format (huggingface/safetensors): 8 bytes little-endian N, then N bytes of JSON header, then the data buffer.
// The header maps each tensor name to {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]} (offsets into
// the data buffer, end exclusive), plus an optional "__metadata__" object of string values. The data is raw
// little-endian, row-major, tensors back to back without holes. The header is padded with spaces to a multiple of
// 8 bytes so the data starts aligned.
//
// Reading validates everything before any tensor is used: the header length against the file size, the JSON, every
// entry's dtype, shape and offsets (within the buffer, the size its shape needs, no overlaps, no holes) and that
// the buffer ends where the file ends. Errors name the file, the tensor and what was expected.
//
// Writing is atomic: AtomicFile writes to a temporary file in the destination's folder, fsyncs it, renames it over
// the destination and fsyncs the folder; a crash or an error at any point leaves either the old file or the new
// one, never a torn one, and the temporary is removed on failure. A process killed mid-write cannot remove its
// temporary (`.NAME.tmp.XXXXXX` next to NAME): the next AtomicFile of the same destination removes such stale
// temporaries. A temporary is stale when no one holds its lock (every writer holds an flock on its temporary until
// the rename; the kernel drops it when the process dies), so a save in progress, in this process or another, keeps
// its temporary.
//
// Errors quote errno as it was right after the failing call.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/core/printable.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

namespace paradyse::safetensors {

struct TensorEntry {
  std::string name;
  std::string dtype;                 // "F32", "F64", "BF16", ...
  std::vector<std::int64_t> shape;
  std::int64_t begin = 0, end = 0;   // byte offsets into the data buffer
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    return n;
  }
};

struct Header {
  std::vector<TensorEntry> tensors;                       // in data order
  std::vector<std::pair<std::string, std::string>> metadata;
  std::int64_t data_start = 0;                            // file offset of the data buffer
  std::int64_t data_bytes = 0;

  const TensorEntry* find(std::string_view name) const {
    for (const TensorEntry& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
  const std::string* meta(std::string_view key) const {
    for (const auto& [k, v] : metadata)
      if (k == key) return &v;
    return nullptr;
  }
};

inline std::int64_t dtype_bytes(std::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
  return 0;
}

namespace detail {

// The text of an errno value captured right after a failing call (reading errno in the same check() as the call is
// wrong: the arguments may be evaluated before the call).
inline std::string errno_text(int error) { return error ? std::strerror(error) : "unknown error (errno 0)"; }

// The header's JSON (core/json.hpp) read into a Header: every entry must have exactly dtype, shape and
// data_offsets, shapes and offsets non-negative integers below 2^53, metadata values strings.
inline Header parse_header(std::string_view text, const std::string& file, std::int64_t data_start,
                           std::int64_t data_bytes) {
  const std::string context = fmt::format("safetensors: {}: corrupted header", file);
  json::Value value;
  try {
    value = json::parse(text, "the header");
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {}", context, error_reason(e)));
  }
  const json::Field doc(value, context);
  Header header;
  header.data_start = data_start;
  header.data_bytes = data_bytes;
  constexpr std::int64_t kMaxInteger = std::int64_t(1) << 53;
  for (const auto& [name, entry] : doc.members()) {
    for (const char c : name)
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
        doc.fail(fmt::format("tensor name '{}' holds a control character", printable(name)));
    if (name == "__metadata__") {
      for (const auto& [key, text_value] : entry.members()) header.metadata.emplace_back(key, text_value.string());
      continue;
    }
    TensorEntry t;
    t.name = name;
    bool dtype = false, shape = false, offsets = false;
    for (const auto& [key, field] : entry.members()) {
      if (key == "dtype") {
        t.dtype = field.string();
        dtype = true;
      } else if (key == "shape") {
        for (const json::Field& d : field.elements()) t.shape.push_back(d.integer(0, kMaxInteger));
        shape = true;
      } else if (key == "data_offsets") {
        const std::vector<json::Field> o = field.elements();
        if (o.size() != 2) doc.fail(fmt::format("tensor '{}': data_offsets must be [begin, end]", printable(name)));
        t.begin = o[0].integer(0, kMaxInteger);
        t.end = o[1].integer(0, kMaxInteger);
        offsets = true;
      } else {
        doc.fail(fmt::format("tensor '{}': unknown key '{}'", printable(name), printable(key)));
      }
    }
    if (!dtype || !shape || !offsets)
      doc.fail(fmt::format("tensor '{}' lacks dtype, shape or data_offsets", printable(name)));
    header.tensors.push_back(std::move(t));
  }
  return header;
}

// The bytes a tensor of `shape` and element width needs, or -1 when that exceeds 2^62 (a corrupted shape).
inline std::int64_t checked_bytes(const std::vector<std::int64_t>& shape, std::int64_t width) {
  std::int64_t n = width;
  for (const std::int64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n) || n > (std::int64_t(1) << 62)) return -1;
  return n;
}

// Throws unless the entries tile the data buffer exactly, each with the byte size its dtype and shape need.
inline void validate_layout(Header& header, const std::string& file) {
  std::vector<std::string_view> names;
  for (const TensorEntry& t : header.tensors) names.push_back(t.name);
  std::sort(names.begin(), names.end());
  for (std::size_t i = 1; i < names.size(); ++i)
    check(names[i] != names[i - 1], "safetensors: {}: tensor '{}' appears twice in the header", file, names[i]);
  for (const TensorEntry& t : header.tensors) {
    const std::int64_t width = dtype_bytes(t.dtype);
    check(width > 0, "safetensors: {}: tensor '{}' has unknown dtype '{}'", file, t.name, printable(t.dtype));
    const std::int64_t needs = checked_bytes(t.shape, width);
    check(needs >= 0, "safetensors: {}: tensor '{}' has shape [{}], more than 2^62 bytes: the header is corrupted",
          file, t.name, fmt::join(t.shape, ", "));
    check(t.begin <= t.end && t.end - t.begin == needs,
          "safetensors: {}: tensor '{}' ({} {}) has data_offsets [{}, {}) of {} bytes, its shape needs {}", file,
          t.name, t.dtype, fmt::join(t.shape, "x"), t.begin, t.end, t.end - t.begin, needs);
    check(t.end <= header.data_bytes,
          "safetensors: {}: tensor '{}' ends at byte {} of a data buffer of {} bytes: the file is truncated", file,
          t.name, t.end, header.data_bytes);
  }
  std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::int64_t covered = 0;
  for (const TensorEntry& t : header.tensors) {
    check(t.begin == covered, "safetensors: {}: tensor '{}' starts at byte {}, expected {} (tensors overlap or leave a hole)",
          file, t.name, t.begin, covered);
    covered = t.end;
  }
  check(covered == header.data_bytes,
        "safetensors: {}: the tensors cover {} bytes but the data buffer holds {}: the file has trailing bytes", file,
        covered, header.data_bytes);
}

}  // namespace detail

// A header for `tensors` (their offsets are assigned here, back to back in the given order) and `metadata`,
// encoded with its 8-byte length prefix and padded so that the data starts at a multiple of 8.
inline std::string encode_header(std::vector<TensorEntry>& tensors,
                                 const std::vector<std::pair<std::string, std::string>>& metadata) {
  json::Value doc = json::Value::object();
  if (!metadata.empty()) {
    json::Value& meta = doc["__metadata__"] = json::Value::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
  }
  std::int64_t offset = 0;
  for (TensorEntry& t : tensors) {
    const std::int64_t width = dtype_bytes(t.dtype);
    check(width > 0, "safetensors: tensor '{}' has unknown dtype '{}'", t.name, t.dtype);
    check(!t.name.empty() && t.name != "__metadata__", "safetensors: '{}' is not a valid tensor name", t.name);
    t.begin = offset;
    t.end = offset + t.numel() * width;
    offset = t.end;
    doc[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  }
  std::string text = json::dump(doc, 0);
  while (text.size() % 8) text += ' ';
  std::string out(8, '\0');
  const std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[std::size_t(i)] = char((n >> (8 * i)) & 0xff);
  return out + text;
}

// An open file descriptor, closed on destruction.
class File {
public:
  File() = default;
  File(const std::string& path, int flags, mode_t mode = 0644) : path_(path), fd_(::open(path.c_str(), flags | O_CLOEXEC, mode)) {
    const int error = errno;
    check(fd_ >= 0, "safetensors: cannot open {}: {}", path, detail::errno_text(error));
    if ((flags & O_ACCMODE) == O_RDONLY) {  // opening a folder read-only succeeds: say what it is
      struct stat st {};
      check(::fstat(fd_, &st) != 0 || !S_ISDIR(st.st_mode), "safetensors: {} is a folder, not a file", path);
    }
  }
  // Takes ownership of an open descriptor.
  static File adopt(const std::string& path, int fd) {
    File file;
    file.path_ = path;
    file.fd_ = fd;
    return file;
  }
  File(File&& other) noexcept : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}
  File& operator=(File&& other) noexcept {
    std::swap(path_, other.path_);
    std::swap(fd_, other.fd_);
    return *this;
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }

  int fd() const noexcept { return fd_; }
  const std::string& path() const noexcept { return path_; }
  std::int64_t size() const {
    struct stat st {};
    const int rc = ::fstat(fd_, &st);
    const int error = errno;
    check(rc == 0, "safetensors: cannot stat {}: {}", path_, detail::errno_text(error));
    return std::int64_t(st.st_size);
  }
  // Reads exactly `bytes` at `offset`; a short read means the file is shorter than its header says.
  void read_at(void* out, std::int64_t bytes, std::int64_t offset) const {
    auto* p = static_cast<char*>(out);
    while (bytes > 0) {
      const ssize_t got = ::pread(fd_, p, std::size_t(bytes), offset);
      const int error = errno;
      if (got < 0 && error == EINTR) continue;
      check(got > 0, "safetensors: {}: cannot read {} bytes at offset {}: {}", path_, bytes, offset,
            got == 0 ? std::string("the file is truncated") : detail::errno_text(error));
      p += got;
      bytes -= got;
      offset += got;
    }
  }
  void write_at(const void* data, std::int64_t bytes, std::int64_t offset) {
    const auto* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t put = ::pwrite(fd_, p, std::size_t(bytes), offset);
      const int error = errno;
      if (put < 0 && error == EINTR) continue;
      check(put > 0, "safetensors: {}: cannot write {} bytes at offset {}: {}", path_, bytes, offset,
            put == 0 ? std::string("no progress (disk full?)") : detail::errno_text(error));
      p += put;
      bytes -= put;
      offset += put;
    }
  }
  void sync() {
    const int rc = ::fsync(fd_);
    const int error = errno;
    check(rc == 0, "safetensors: fsync of {} failed: {}", path_, detail::errno_text(error));
  }

private:
  std::string path_;
  int fd_ = -1;
};

// A file written under a temporary name in the destination's folder and renamed over the destination by commit().
// Without commit() (an error, an exception) the temporary is removed and the destination is untouched.
class AtomicFile {
public:
  explicit AtomicFile(const std::string& destination) : destination_(destination) {
    const std::filesystem::path dest(destination);
    check(!dest.filename().empty(), "safetensors: '{}' names a folder, not a file", destination);
    const std::filesystem::path folder = dest.parent_path().empty() ? "." : dest.parent_path();
    check(std::filesystem::is_directory(folder), "safetensors: the folder {} of {} does not exist", folder.string(),
          destination);
    std::error_code ignored;
    check(!std::filesystem::is_directory(dest, ignored), "safetensors: {} is a folder; a file cannot replace it",
          destination);
    remove_stale_temporaries(folder, dest.filename().string());
    std::string pattern = (folder / temporary_prefix(dest.filename().string())).string() + "XXXXXX";
    const int fd = ::mkstemp(pattern.data());
    const int error = errno;
    check(fd >= 0, "safetensors: cannot create a temporary file {}: {}", pattern, detail::errno_text(error));
    ::flock(fd, LOCK_EX | LOCK_NB);  // ours until the rename: no other save takes it for a stale one
    ::fchmod(fd, 0644);              // mkstemp makes it private; a checkpoint is an ordinary file
    temporary_ = pattern;
    file_ = File::adopt(temporary_, fd);
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (!committed_) ::unlink(temporary_.c_str());
  }

  File& file() noexcept { return file_; }
  const std::string& temporary_path() const noexcept { return temporary_; }

  // fsync the data, rename over the destination (still holding the temporary's lock), fsync the folder (so the
  // rename itself is durable).
  void commit() {
    file_.sync();
    const int rc = ::rename(temporary_.c_str(), destination_.c_str());
    const int error = errno;
    check(rc == 0, "safetensors: cannot rename {} to {}: {}", temporary_, destination_, detail::errno_text(error));
    committed_ = true;
    file_ = File();
    const std::filesystem::path folder = std::filesystem::path(destination_).parent_path();
    const int dir = ::open(folder.empty() ? "." : folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir >= 0) {
      ::fsync(dir);
      ::close(dir);
    }
  }

  // The name prefix of the temporaries of a destination named `filename`.
  static std::string temporary_prefix(const std::string& filename) { return "." + filename + ".tmp."; }

  // Removes the temporaries of `filename` in `folder` that no live writer holds (left by killed saves); returns how
  // many. Best effort: what cannot be opened, locked or removed stays.
  static int remove_stale_temporaries(const std::filesystem::path& folder, const std::string& filename) {
    const std::string prefix = temporary_prefix(filename);
    int removed = 0;
    std::error_code error;
    for (std::filesystem::directory_iterator it(folder, error), end; !error && it != end; it.increment(error)) {
      const std::string name = it->path().filename().string();
      if (name.size() != prefix.size() + 6 || name.compare(0, prefix.size(), prefix) != 0) continue;
      std::error_code type_error;
      if (!it->is_regular_file(type_error)) continue;
      const int fd = ::open(it->path().c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
      if (fd < 0) continue;
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0) removed += ::unlink(it->path().c_str()) == 0;  // no writer holds it
      ::close(fd);
    }
    return removed;
  }

private:
  std::string destination_, temporary_;
  File file_;
  bool committed_ = false;
};

// Opens `path` and reads and validates its header.
inline Header read_header(const File& file) {
  const std::int64_t size = file.size();
  check(size >= 8, "safetensors: {}: {} bytes is too short for the 8-byte header length: the file is truncated",
        file.path(), size);
  unsigned char prefix[8];
  file.read_at(prefix, 8, 0);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  check(n >= 2 && n <= std::uint64_t(size - 8),
        "safetensors: {}: the header claims {} bytes but the file has {} after the length: the file is truncated or "
        "not a safetensors file",
        file.path(), n, size - 8);
  check(n <= (std::uint64_t(100) << 20), "safetensors: {}: a header of {} bytes exceeds the 100 MB limit", file.path(), n);
  std::string text(n, '\0');
  file.read_at(text.data(), std::int64_t(n), 8);
  Header header = detail::parse_header(text, file.path(), 8 + std::int64_t(n), size - 8 - std::int64_t(n));
  detail::validate_layout(header, file.path());
  return header;
}

// FNV-1a over bytes, continued from `hash` (a cheap checksum that catches flipped or shuffled bytes).
inline std::uint64_t fnv1a(const void* data, std::size_t bytes, std::uint64_t hash = 0xcbf29ce484222325ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 0x100000001b3ull;
  return hash;
}

}  // namespace paradyse::safetensors
