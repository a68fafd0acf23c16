// Files: reading whole files and writing them atomically (an anonymous O_TMPFILE file, or a named
// temporary where the file system has none; fsync, link, rename, fsync of the directory; stale
// temporaries of killed writers cleaned up).
#include <linum/core/files.hpp>
#include <linum/core/error.hpp>

#include <atomic>
#include <charconv>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

namespace linum::files {

namespace {

std::string errno_str(int err) { return std::strerror(err); }

}  // namespace

std::vector<std::uint8_t> read_file(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(detail::cat("cannot open '", path.string(), "' for reading: ", errno_str(errno)));
  std::vector<std::uint8_t> out;
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) out.reserve(static_cast<std::size_t>(st.st_size));
  std::uint8_t buf[1 << 16];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      throw IoError(detail::cat("cannot read '", path.string(), "': ", errno_str(err)));
    }
    if (n == 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  ::close(fd);
  return out;
}

// Removes temporary files that earlier writers of `name` in `dir` left behind when they were killed
// mid-write: ".<name>.tmp-<pid>-<n>" whose process no longer exists and that have not been touched
// for a minute (so a writer in another PID namespace sharing the directory is left alone).
// Best effort: errors are ignored.
static void remove_stale_temporaries(const std::filesystem::path& dir, const std::string& name) {
  const std::string prefix = "." + name + ".tmp-";
  std::error_code ec;
  const auto now = std::filesystem::file_time_type::clock::now();
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    if (file.compare(0, prefix.size(), prefix) != 0) continue;
    long pid = 0;
    const auto [p, parse] = std::from_chars(file.data() + prefix.size(), file.data() + file.size(), pid);
    if (parse != std::errc() || p == file.data() + file.size() || *p != '-' || pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to judge)
    std::error_code time_ec;
    const auto written = std::filesystem::last_write_time(it->path(), time_ec);
    if (time_ec || now - written < std::chrono::minutes(1)) continue;
    std::filesystem::remove(it->path(), time_ec);
  }
}

void write_file_atomic(const std::filesystem::path& path, std::span<const std::uint8_t> bytes) {
  static std::atomic<unsigned> counter{0};
  const std::filesystem::path dir = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  if (path.filename().empty())
    throw IoError(detail::cat("cannot write '", path.string(), "': the path names a directory, not a file"));
  remove_stale_temporaries(dir, path.filename().string());
  const std::filesystem::path tmp =
      dir / detail::cat(".", path.filename().string(), ".tmp-", ::getpid(), "-", counter.fetch_add(1));
  auto failure = [&](const std::string& step, int err) {
    return IoError(detail::cat("cannot write '", path.string(), "': ", step, ": ", errno_str(err),
                               "; the previous file (if any) is unchanged"));
  };
  // First choice: an anonymous file in the target's directory (O_TMPFILE) that gets a name only
  // once it is complete and on disk, so a writer killed mid-write leaves nothing behind. File
  // systems without O_TMPFILE get a named temporary file (cleaned up by later writers if killed).
  int fd = ::open(dir.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0666);
  bool named = fd < 0;
  if (named) {
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) throw failure(detail::cat("creating the temporary file '", tmp.string(), "'"), errno);
  }
  auto abandon = [&](const char* step) {
    int err = errno;
    if (fd >= 0) ::close(fd);
    if (named) ::unlink(tmp.c_str());
    throw failure(step, err);
  };
  std::size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, std::min<std::size_t>(bytes.size() - done, std::size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      abandon("writing");
    }
    if (n == 0) {
      errno = EIO;
      abandon("writing");
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) abandon("flushing to disk (fsync)");
  if (!named) {
    // Name the finished file: through its descriptor (needs CAP_DAC_READ_SEARCH) or /proc.
    const std::string self = detail::cat("/proc/self/fd/", fd);
    if (::linkat(fd, "", AT_FDCWD, tmp.c_str(), AT_EMPTY_PATH) != 0 &&
        ::linkat(AT_FDCWD, self.c_str(), AT_FDCWD, tmp.c_str(), AT_SYMLINK_FOLLOW) != 0)
      abandon("naming the finished temporary file (linkat)");
    named = true;
  }
  int rc = ::close(fd);
  fd = -1;
  if (rc != 0) abandon("closing");
  if (::rename(tmp.c_str(), path.c_str()) != 0) abandon("renaming the temporary file over the target");
  // Make the rename itself durable; failure here leaves a complete file, so it is not an error.
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace linum::files
