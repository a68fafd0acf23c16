#include <linum/core/storage/spill_file.hpp>
#include <linum/core/storage/transfer_stats.hpp>

#include <linum/core/error.hpp>
#include <linum/core/memory.hpp>

#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace linum::storage {
namespace {

constexpr std::int64_t kAlign = 4096;

std::filesystem::path default_directory() {
  for (const char* var : {"LINUM_SPILL_DIR", "TMPDIR"})
    if (const char* v = std::getenv(var); v != nullptr && *v != '\0') return v;
  return "/tmp";
}

std::string describe_bytes(std::int64_t b) { return linum::detail::cat(static_cast<double>(b) / (1 << 20), " MiB"); }

// An unnamed file in `dir`: O_TMPFILE where the filesystem has it, else a named one unlinked at once.
int open_unnamed(const std::filesystem::path& dir) {
  struct stat st{};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw IoError(linum::detail::cat("offload: the spill directory '", dir.string(), "' ",
                                     ::stat(dir.c_str(), &st) != 0 ? "does not exist" : "is not a directory",
                                     "; create it or choose another with storage::set_spill_options({.directory = ...}) "
                                     "or $LINUM_SPILL_DIR"));
#ifdef O_TMPFILE
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0) return fd;
  if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL && errno != ENOENT)
    throw IoError(linum::detail::cat("offload: cannot create the spill file in '", dir.string(), "': ", std::strerror(errno),
                                     "; choose a writable directory with storage::set_spill_options or $LINUM_SPILL_DIR"));
#endif
  std::string templ = (dir / "linum-spill-XXXXXX").string();
  int named = ::mkstemp(templ.data());
  if (named < 0)
    throw IoError(linum::detail::cat("offload: cannot create the spill file in '", dir.string(), "': ", std::strerror(errno),
                                     "; choose a writable directory with storage::set_spill_options or $LINUM_SPILL_DIR"));
  ::unlink(templ.c_str());
  ::fcntl(named, F_SETFD, FD_CLOEXEC);
  return named;
}

}  // namespace

class SpillFile::Impl : public std::enable_shared_from_this<Impl> {
 public:
  enum class State : std::uint8_t { queued, writing, on_disk, reading, loaded, failed };
  struct Slot {
    State state = State::queued;
    bool dropped = false;  // the entry was freed while the I/O thread worked on it
    Array ram;             // queued, writing, loaded, failed: the value in RAM
    Shape shape;
    DType dtype = DType::f32;
    std::int64_t bytes = 0;
    std::int64_t offset = -1;  // on disk (or being read/written): where
  };

  Impl(SpillOptions options, int fd) : directory_(options.directory), windows_{options.write_behind_bytes, options.read_ahead_bytes}, fd_(fd) {}
  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    ::close(fd_);
    memory::detail::on_offloaded(-on_disk_bytes_);
  }

  std::shared_ptr<Entry> put(const Array& a) {
    if (!a.defined()) throw ValueError("offload: cannot store an undefined array");
    std::unique_lock<std::mutex> lock(mutex_);
    if (!error_.empty()) throw IoError(error_);
    if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
    const auto bytes = static_cast<std::int64_t>(a.nbytes());
    const std::uint64_t id = next_id_++;
    Slot& s = slots_[id];
    s.shape = a.shape();
    s.dtype = a.dtype();
    s.bytes = bytes;
    if (bytes == 0) {
      s.state = State::on_disk;
    } else {
      s.ram = a.detached();
      queue_.push_back(id);
      queued_bytes_ += bytes;
      cv_.notify_all();
      // Back-pressure: bound what waits in RAM, and under a live-byte cap let the writes catch up.
      cv_.wait(lock, [&] {
        if (!error_.empty() || queued_bytes_ == 0) return true;
        const std::int64_t limit = memory::live_limit();
        if (limit > 0 && memory::stats().live_bytes > limit / 2) return false;
        return queued_bytes_ <= windows_.write_behind_bytes;
      });
    }
    return std::shared_ptr<Entry>(new Entry(shared_from_this(), id, a.shape(), a.dtype()));
  }

  Array get(const Entry& e) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = slots_.find(e.id_);
    if (it == slots_.end()) throw AutodiffError("offload: the entry was already freed");
    Slot& s = it->second;
    cv_.wait(lock, [&] { return s.state != State::reading; });
    Array out;
    switch (s.state) {
      case State::queued:
      case State::writing:
      case State::failed: out = s.ram; break;
      case State::loaded:
        out = std::move(s.ram);
        s.ram = Array();
        s.state = State::on_disk;
        break;
      case State::on_disk: {
        if (s.bytes == 0) {
          out = Array::empty(s.shape, s.dtype);
          break;
        }
        s.state = State::reading;
        const std::int64_t offset = s.offset, bytes = s.bytes;
        lock.unlock();
        Array a;
        std::string err;
        try {
          a = Array::empty(s.shape, s.dtype);
          err = read_at(a.mutable_raw(), bytes, offset);
        } catch (...) {
          lock.lock();
          s.state = State::on_disk;
          cv_.notify_all();
          throw;
        }
        lock.lock();
        s.state = State::on_disk;
        cv_.notify_all();
        if (!err.empty()) throw IoError(err);
        memory::detail::on_offload_io(0, bytes);
        out = std::move(a);
        break;
      }
      case State::reading: break;  // waited for above
    }
    schedule_read_ahead(e.id_);
    return out;
  }

  void release(std::uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = slots_.find(id);
    if (it == slots_.end()) return;
    Slot& s = it->second;
    if (s.state == State::writing || s.state == State::reading) {
      s.dropped = true;  // the I/O thread (or reader) finishes, then frees it
      return;
    }
    if (s.state == State::queued) queued_bytes_ -= s.bytes;
    free_slot(it);
    cv_.notify_all();
  }

  void flush() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return queued_bytes_ == 0 && !busy_; });
  }

  std::int64_t used_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return end_;
  }

  SpillOptions options() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {.directory = directory_, .write_behind_bytes = windows_.write_behind_bytes, .read_ahead_bytes = windows_.read_ahead_bytes};
  }
  const std::filesystem::path& directory() const { return directory_; }
  SpillWindows windows() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return windows_;
  }
  void set_windows(SpillWindows w) {
    if (w.write_behind_bytes < 0 || w.read_ahead_bytes < 0)
      throw ValueError(linum::detail::cat("offload: spill windows must be >= 0 bytes, got write_behind ", w.write_behind_bytes,
                                          " and read_ahead ", w.read_ahead_bytes));
    std::lock_guard<std::mutex> lock(mutex_);
    windows_ = w;
    if (w.read_ahead_bytes == 0) {
      read_queue_.clear();
      hinted_.clear();
    }
    cv_.notify_all();  // puts waiting on a smaller window re-check
  }

 private:
  // The slot's place in the file (at the end), counted as offloaded; and back (the lock held).
  void allocate_extent(Slot& s) {
    const std::int64_t size = (s.bytes + kAlign - 1) / kAlign * kAlign;
    s.offset = end_;
    extents_[end_] = size;
    end_ += size;
    on_disk_bytes_ += s.bytes;
    memory::detail::on_offloaded(s.bytes);
  }
  void release_extent(Slot& s) {
    if (s.offset < 0) return;
    extents_.erase(s.offset);
    end_ = extents_.empty() ? 0 : extents_.rbegin()->first + extents_.rbegin()->second;
    on_disk_bytes_ -= s.bytes;
    memory::detail::on_offloaded(-s.bytes);
    s.offset = -1;
  }
  // Frees a slot that no I/O is touching (called with the lock held).
  void free_slot(std::map<std::uint64_t, Slot>::iterator it) {
    release_extent(it->second);
    slots_.erase(it);
  }

  std::string write_at(const void* data, std::int64_t bytes, std::int64_t offset) const {
    const detail::TransferTimer timed(detail::Transfer::write, bytes);
    const auto* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::pwrite(fd_, p, static_cast<std::size_t>(bytes), offset);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = n < 0 ? errno : ENOSPC;
        return linum::detail::cat("offload: writing ", describe_bytes(bytes), " to the spill file in '", directory_.string(),
                                  "' failed: ", std::strerror(err),
                                  err == ENOSPC || err == EFBIG || err == EDQUOT
                                      ? "; free space there, or choose a larger disk with storage::set_spill_options or "
                                        "$LINUM_SPILL_DIR (the values already queued are kept in RAM)"
                                      : "; the values already queued are kept in RAM");
      }
      p += n;
      bytes -= n;
      offset += n;
    }
    return {};
  }
  std::string read_at(void* data, std::int64_t bytes, std::int64_t offset) const {
    const detail::TransferTimer timed(detail::Transfer::read, bytes);
    auto* p = static_cast<char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::pread(fd_, p, static_cast<std::size_t>(bytes), offset);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        return linum::detail::cat("offload: reading ", describe_bytes(bytes), " back from the spill file in '",
                                  directory_.string(), "' failed: ", n < 0 ? std::strerror(errno) : "the file is shorter");
      p += n;
      bytes -= n;
      offset += n;
    }
    return {};
  }

  // After entry `id` was read, queue reads of what the backward pass is likely to need next: the
  // entries stored after it that are still alive (the rest of a checkpointed block being replayed,
  // which reads its values in forward order), then the newest entries stored before it (the
  // blocks and ops the backward pass reaches next), up to read_ahead_bytes in RAM.
  void schedule_read_ahead(std::uint64_t id) {
    if (windows_.read_ahead_bytes <= 0) return;
    std::int64_t ahead = 0;
    read_queue_.clear();
    auto consider = [&](std::uint64_t key, const Slot& s) {
      if (s.state == State::loaded || s.state == State::reading) ahead += s.bytes;
      else if (s.state == State::on_disk && s.bytes > 0 && ahead + s.bytes <= windows_.read_ahead_bytes) {
        ahead += s.bytes;
        read_queue_.push_back(key);
      }
      return ahead < windows_.read_ahead_bytes;
    };
    bool more = true;
    for (auto it = slots_.upper_bound(id); more && it != slots_.end(); ++it) more = consider(it->first, it->second);
    for (auto it = std::make_reverse_iterator(slots_.lower_bound(id)); more && it != slots_.rend(); ++it)
      more = consider(it->first, it->second);
    if (!read_queue_.empty()) cv_.notify_all();
  }

  // Starts reading entry `id` back (ahead of the read-ahead queue).
 public:
  void prefetch(std::uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (windows_.read_ahead_bytes <= 0) return;  // no reading ahead at all: RAM use independent of timing
    auto it = slots_.find(id);
    if (it == slots_.end() || it->second.state != State::on_disk || it->second.bytes == 0) return;
    hinted_.push_back(id);
    cv_.notify_all();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty() || !hinted_.empty() || !read_queue_.empty(); });
      if (stop_) return;
      if (!queue_.empty()) {
        const std::uint64_t id = queue_.front();
        queue_.pop_front();
        auto it = slots_.find(id);
        if (it == slots_.end() || it->second.state != State::queued) continue;
        Slot& s = it->second;
        s.state = State::writing;
        allocate_extent(s);
        busy_ = true;
        Array data = s.ram;
        lock.unlock();
        const std::string err = write_at(data.raw(), s.bytes, s.offset);
        lock.lock();
        busy_ = false;
        queued_bytes_ -= s.bytes;
        if (err.empty()) {
          memory::detail::on_offload_io(s.bytes, 0);
          s.state = State::on_disk;
          s.ram = Array();
        } else {
          release_extent(s);
          s.state = State::failed;
          if (error_.empty()) error_ = err;
        }
        if (s.dropped) free_slot(it);
        data = Array();
        cv_.notify_all();
        continue;
      }
      std::deque<std::uint64_t>& reads = hinted_.empty() ? read_queue_ : hinted_;
      const std::uint64_t id = reads.front();
      reads.pop_front();
      auto it = slots_.find(id);
      if (it == slots_.end() || it->second.state != State::on_disk) continue;
      Slot& s = it->second;
      const std::int64_t limit = memory::live_limit();
      // Hinted reads and read-ahead together hold at most read_ahead_bytes in RAM (so a planner can
      // bound what reading ahead adds to a step's peak); under a cap, they leave a quarter of it free.
      if (loaded_bytes() + s.bytes > windows_.read_ahead_bytes ||
          (limit > 0 && memory::stats().live_bytes + s.bytes > limit / 4 * 3)) {
        read_queue_.clear();  // keep the headroom for the backward pass itself
        hinted_.clear();
        continue;
      }
      s.state = State::reading;
      busy_ = true;
      lock.unlock();
      Array a;
      std::string err;
      try {
        a = Array::empty(s.shape, s.dtype);
        err = read_at(a.mutable_raw(), s.bytes, s.offset);
      } catch (const std::exception& e) {
        err = e.what();
      }
      lock.lock();
      busy_ = false;
      if (err.empty()) {
        memory::detail::on_offload_io(0, s.bytes);
        s.ram = std::move(a);
        s.state = State::loaded;
      } else {
        s.state = State::on_disk;  // get() reads it itself (and reports the error if it persists)
        read_queue_.clear();
      }
      if (s.dropped) free_slot(it);
      cv_.notify_all();
    }
  }

  // Bytes read back ahead of need, waiting in RAM for their get() (the lock held).
  std::int64_t loaded_bytes() const {
    std::int64_t n = 0;
    for (const auto& [key, s] : slots_)
      if (s.state == State::loaded) n += s.bytes;
    return n;
  }

  const std::filesystem::path directory_;
  SpillWindows windows_;
  const int fd_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::thread worker_;
  bool stop_ = false;
  bool busy_ = false;
  std::string error_;
  std::uint64_t next_id_ = 0;
  std::map<std::uint64_t, Slot> slots_;
  std::deque<std::uint64_t> queue_;       // writes, oldest first
  std::deque<std::uint64_t> hinted_;      // reads asked for by prefetch(), in order
  std::deque<std::uint64_t> read_queue_;  // read-ahead (schedule_read_ahead)
  std::int64_t queued_bytes_ = 0;
  std::int64_t on_disk_bytes_ = 0;
  std::map<std::int64_t, std::int64_t> extents_;  // offset -> size of live entries
  std::int64_t end_ = 0;
};

SpillFile::Entry::~Entry() { impl_->release(id_); }
Array SpillFile::Entry::read() const { return impl_->get(*this); }
void SpillFile::Entry::prefetch() const { impl_->prefetch(id_); }
std::int64_t SpillFile::Entry::bytes() const { return shape_.numel() * static_cast<std::int64_t>(dtype_size(dtype_)); }

SpillFile SpillFile::open(SpillOptions options) {
  if (options.directory.empty()) options.directory = default_directory();
  const int fd = open_unnamed(options.directory);
  return SpillFile(std::make_shared<Impl>(std::move(options), fd));
}

std::shared_ptr<SpillFile::Entry> SpillFile::put(const Array& a) { return impl_->put(a); }
Array SpillFile::get(const Entry& entry) { return entry.read(); }
void SpillFile::flush() { impl_->flush(); }
const std::filesystem::path& SpillFile::directory() const { return impl_->directory(); }
SpillOptions SpillFile::options() const { return impl_->options(); }
SpillWindows SpillFile::windows() const { return impl_->windows(); }
void SpillFile::set_windows(SpillWindows windows) { impl_->set_windows(windows); }
std::int64_t SpillFile::used_bytes() const { return impl_->used_bytes(); }

namespace {
std::mutex g_process_mutex;
// Never destroyed: the I/O thread may still run at exit, and the unnamed file vanishes with the process.
SpillFile* g_process = nullptr;
}  // namespace

SpillFile& spill_file() {
  std::lock_guard<std::mutex> lock(g_process_mutex);
  if (g_process == nullptr) g_process = new SpillFile(SpillFile::open());
  return *g_process;
}

SpillWindowsScope::SpillWindowsScope(SpillWindows windows) : previous_(spill_file().windows()) { spill_file().set_windows(windows); }
SpillWindowsScope::~SpillWindowsScope() { spill_file().set_windows(previous_); }

void set_spill_options(SpillOptions options) {
  SpillFile opened = SpillFile::open(std::move(options));
  std::lock_guard<std::mutex> lock(g_process_mutex);
  if (g_process == nullptr) g_process = new SpillFile(std::move(opened));
  else *g_process = std::move(opened);
}

}  // namespace linum::storage
