// How fast values move beyond RAM on this machine: bytes and wall time of the spill file's writes
// and reads, and of compression and decompression (process-wide counters since start). The
// planner reads them around its profiling runs to report the spill directory's bandwidth and the
// codecs' throughput, and to charge a placing option at least the time its transfers took.
//
//   const storage::TransferStats before = storage::transfer_stats();
//   ... a step that offloads ...
//   const storage::TransferStats moved = storage::transfer_stats() - before;
//   double write_mb_per_s = moved.written_bytes / moved.write_seconds / 1e6;
#pragma once

#include <cstdint>

namespace linum::storage {

struct TransferStats {
  std::int64_t written_bytes = 0;  // to the spill file
  double write_seconds = 0;
  std::int64_t read_bytes = 0;  // back from the spill file
  double read_seconds = 0;
  std::int64_t encoded_bytes = 0;  // uncompressed bytes compressed
  double encode_seconds = 0;
  std::int64_t decoded_bytes = 0;  // uncompressed bytes decompressed
  double decode_seconds = 0;

  // Time spent on all of it.
  double seconds() const { return write_seconds + read_seconds + encode_seconds + decode_seconds; }
  // Bytes per second of each (0 when nothing was measured).
  double write_bytes_per_s() const { return write_seconds > 0 ? static_cast<double>(written_bytes) / write_seconds : 0.0; }
  double read_bytes_per_s() const { return read_seconds > 0 ? static_cast<double>(read_bytes) / read_seconds : 0.0; }
  double encode_bytes_per_s() const { return encode_seconds > 0 ? static_cast<double>(encoded_bytes) / encode_seconds : 0.0; }
  double decode_bytes_per_s() const { return decode_seconds > 0 ? static_cast<double>(decoded_bytes) / decode_seconds : 0.0; }

  TransferStats operator-(const TransferStats& o) const {
    return {written_bytes - o.written_bytes, write_seconds - o.write_seconds, read_bytes - o.read_bytes,
            read_seconds - o.read_seconds,   encoded_bytes - o.encoded_bytes, encode_seconds - o.encode_seconds,
            decoded_bytes - o.decoded_bytes, decode_seconds - o.decode_seconds};
  }
};

TransferStats transfer_stats();

namespace detail {
enum class Transfer { write, read, encode, decode };
// Counts one transfer (thread-safe).
void on_transfer(Transfer kind, std::int64_t bytes, double seconds);

// Times a transfer from construction to destruction.
class TransferTimer {
 public:
  TransferTimer(Transfer kind, std::int64_t bytes);
  ~TransferTimer();
  TransferTimer(const TransferTimer&) = delete;
  TransferTimer& operator=(const TransferTimer&) = delete;

 private:
  Transfer kind_;
  std::int64_t bytes_;
  std::int64_t start_ns_;
};
}  // namespace detail

}  // namespace linum::storage
