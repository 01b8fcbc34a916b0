// paradyse/core/atomic_file.hpp: the one writer of the programs' side outputs (CSV tables, JSON: sensitivity tables,
// calibrated profiles), so that a full disk or an unwritable folder is reported, naming the file and the system's
// reason, and never leaves a truncated or empty file where the old one was.
//
//   AtomicFile out("table.json", "--table");   // creates table.json.tmp.<pid>.<n> beside the target
//   out.write(text);                            // every write checked (partial writes and EINTR resumed)
//   out.commit();                               // fsync, close (checked), rename over table.json
//   write_file_atomically("table.json", text, "--table");   // the same in one call
//
// Until commit() the target is untouched; an AtomicFile destroyed without commit() removes its temporary file. A
// target that exists and is not a regular file (/dev/null, /dev/full, /dev/stdout, a pipe) is written in place:
// there is nothing to replace, and a temporary file beside it would be one in /dev. Every error is an Error
// "<what> <path>: <action> failed: <strerror>" (a write that stores nothing without an errno says so).
#pragma once

#include "paradyse/core/error.hpp"

#include <fmt/format.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace paradyse {

class AtomicFile {
public:
  // `what` names the file's role in messages: the flag that gave it ("--csv") or the format ("json").
  AtomicFile(std::string path, std::string what) : path_(std::move(path)), what_(std::move(what)) {
    check(!path_.empty(), "{}: the file name is empty", what_);
    struct stat st{};
    if (::stat(path_.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
      throw Error(fmt::format("{} {}: is a folder; expected a file name", what_, path_));
    in_place_ = ::stat(path_.c_str(), &st) == 0 && !S_ISREG(st.st_mode);
    if (in_place_) {
      fd_ = open_checked(path_, O_WRONLY | O_TRUNC, "opening");
      return;
    }
    static std::atomic<unsigned> counter{0};
    temporary_ = fmt::format("{}.tmp.{}.{}", path_, ::getpid(), counter.fetch_add(1));
    fd_ = open_checked(temporary_, O_WRONLY | O_CREAT | O_EXCL, "creating a file beside it");
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() { abandon(); }

  const std::string& path() const noexcept { return path_; }
  bool open() const noexcept { return fd_ >= 0; }

  // Writes all of `bytes` (unbuffered: what returned is in the file system's hands). Throws naming the file; the
  // file is then abandoned (the target keeps its old content).
  void write(std::string_view bytes) {
    check(fd_ >= 0, "{} {}: written after it was committed or abandoned", what_, path_);
    while (!bytes.empty()) {
      errno = 0;
      const ::ssize_t n = ::write(fd_, bytes.data(), bytes.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("writing", n == 0 ? 0 : errno);
      bytes.remove_prefix(std::size_t(n));
    }
  }

  // Makes the file the target: fsync, close and rename, each checked. Throws naming the file (and then the target
  // keeps its old content).
  void commit() {
    check(fd_ >= 0, "{} {}: committed twice or after it was abandoned", what_, path_);
    if (!in_place_ && ::fsync(fd_) != 0) fail("saving to disk (fsync)", errno);
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) {
      const int error = errno;
      fd_ = -1;
      fail("closing", error);
    }
    if (in_place_) return;
    if (::rename(temporary_.c_str(), path_.c_str()) != 0) fail("renaming the finished file onto it", errno);
    temporary_.clear();
    sync_folder();
  }

  // Gives up: closes and removes the temporary file; the target keeps its old content. No-op once committed.
  void abandon() noexcept {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
    if (!temporary_.empty()) ::unlink(temporary_.c_str());
    temporary_.clear();
  }

private:
  int open_checked(const std::string& name, int flags, const char* action) {
    errno = 0;
    int fd = -1;
    do fd = ::open(name.c_str(), flags | O_CLOEXEC, 0666);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) {
      const int error = errno;
      temporary_.clear();  // nothing was created
      fail(action, error);
    }
    return fd;
  }

  [[noreturn]] void fail(const char* action, int error) {
    abandon();
    throw Error(fmt::format("{} {}: {} failed: {}", what_, path_, action,
                            error != 0 ? std::strerror(error) : "nothing was written and no reason given"));
  }

  // The rename is durable once the folder's entry is on disk too (best effort: some file systems refuse it).
  void sync_folder() noexcept {
    const std::size_t slash = path_.rfind('/');
    const std::string folder = slash == std::string::npos ? "." : slash == 0 ? "/" : path_.substr(0, slash);
    const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return;
    (void)::fsync(fd);
    ::close(fd);
  }

  std::string path_, what_, temporary_;
  int fd_ = -1;
  bool in_place_ = false;
};

// `text` as the whole content of `path`, atomically (see AtomicFile); errors name `what` and the file.
inline void write_file_atomically(const std::string& path, std::string_view text, const std::string& what) {
  AtomicFile file(path, what);
  file.write(text);
  file.commit();
}

}  // namespace paradyse
