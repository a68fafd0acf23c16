// The spill file: where offloaded residuals go (RAM's next level on a CPU machine is the disk).
//
//   storage::SpillFile spill = storage::SpillFile::open({.directory = "/mnt/nvme"});
//   auto entry = spill.put(x);      // queued; a background thread writes it, then drops its RAM
//   ...
//   Array back = spill.get(entry);  // bit for bit x; reads ahead the entries put before it
//
// One file per process (see spill_file()), unlinked from the moment it is created: it has no name
// in the directory, so a process that exits or is killed leaves nothing behind. Writes happen
// behind the caller on one I/O thread; put() waits only when more than `write_behind_bytes` are
// queued. A backward pass reads residuals in the reverse order the forward pass stored them, so
// each get() starts reading ahead the newest entries still on disk that were put before it (up to
// `read_ahead_bytes`), overlapping the transfer with the backward pass's compute. Under a live-byte
// cap (memory::set_live_limit) the store keeps headroom: put() waits for queued writes once half the
// cap is in use, and read-ahead stops at three quarters of it.
//
// A failed write (a full disk, a file size limit) is not lost: the entry keeps its array in RAM and
// get() returns it; the next put() throws IoError naming the directory. Space of freed entries is
// reused from the end of the file (residuals are freed in reverse order); the file keeps its
// largest size until the process ends.
#pragma once

#include <linum/core/array.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>

namespace linum::storage {

struct SpillOptions {
  // Where the file lives. Empty: $LINUM_SPILL_DIR, else $TMPDIR, else /tmp.
  std::filesystem::path directory;
  std::int64_t write_behind_bytes = std::int64_t{16} << 20;  // queued bytes before put() waits
  std::int64_t read_ahead_bytes = std::int64_t{16} << 20;    // bytes read back ahead of need
  // (write_behind_bytes 0: each put() returns once written; read_ahead_bytes 0: nothing is read
  // before get() asks for it, prefetch() included. Both 0: the RAM a step takes does not depend on
  // the I/O thread's timing, as a planner's profile wants.)
};

// How much RAM the I/O thread may use to overlap transfers with compute: values waiting to be
// written (write-behind) and values read back before they are asked for (read-ahead, hinted
// prefetches included). A step's peak with windows W and R is at most its peak with both 0 plus
// W + R, which is how lift::plan_remat sizes them to fit a budget.
struct SpillWindows {
  std::int64_t write_behind_bytes = std::int64_t{16} << 20;
  std::int64_t read_ahead_bytes = std::int64_t{16} << 20;
};

class SpillFile {
 public:
  class Impl;
  // One array in the file; dropping the last reference frees its space (and its RAM copy, if any).
  class Entry {
   public:
    ~Entry();
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    const Shape& shape() const { return shape_; }
    DType dtype() const { return dtype_; }
    std::int64_t bytes() const;
    // The array back, bit for bit (the same as SpillFile::get).
    Array read() const;
    // Starts reading it back in the background (read() then finds it in RAM).
    void prefetch() const;

   private:
    friend class SpillFile;
    friend class Impl;
    Entry(std::shared_ptr<Impl> impl, std::uint64_t id, Shape shape, DType dtype)
        : impl_(std::move(impl)), id_(id), shape_(std::move(shape)), dtype_(dtype) {}
    std::shared_ptr<Impl> impl_;
    std::uint64_t id_;
    Shape shape_;
    DType dtype_;
  };

  // Creates the (unnamed) file in the directory. IoError names the directory when it is missing,
  // not a directory, or not writable.
  static SpillFile open(SpillOptions options = {});

  // Queues `a` for writing and returns its entry. Throws IoError if an earlier write failed.
  std::shared_ptr<Entry> put(const Array& a);
  // The entry's array, bit for bit (see the header comment for where it comes from).
  Array get(const Entry& entry);
  // Waits until every queued write has finished (or failed).
  void flush();

  const std::filesystem::path& directory() const;
  SpillOptions options() const;
  SpillWindows windows() const;
  // Changes the windows from the next transfer on (ValueError if one is negative).
  void set_windows(SpillWindows windows);
  // Bytes of the file in use now (up to the end of the last live entry).
  std::int64_t used_bytes() const;

 private:
  explicit SpillFile(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

// The process's spill file, opened on first use with the options set below (default options first).
SpillFile& spill_file();
// Opens a new process spill file with these options; entries of the previous one stay readable.
// Call it between steps, not while another thread is offloading.
void set_spill_options(SpillOptions options);

// Sets the process spill file's windows while alive and restores the previous ones after.
class SpillWindowsScope {
 public:
  explicit SpillWindowsScope(SpillWindows windows);
  ~SpillWindowsScope();
  SpillWindowsScope(const SpillWindowsScope&) = delete;
  SpillWindowsScope& operator=(const SpillWindowsScope&) = delete;

 private:
  SpillWindows previous_;
};

}  // namespace linum::storage
