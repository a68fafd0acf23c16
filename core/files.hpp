// Whole-file reads and atomic writes: every file Linum writes (variable files, checkpoints, plans,
// memory timelines) goes through write_file_atomic, so a crash or a full disk never leaves a torn
// file behind.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

namespace linum::files {

// Atomically replaces `path` with `bytes` (temp file in the same directory, fsync, rename).
// Throws IoError; on failure the old file is intact and no temporary file remains.
void write_file_atomic(const std::filesystem::path& path, std::span<const std::uint8_t> bytes);

// The whole content of a file. Throws IoError naming the file.
std::vector<std::uint8_t> read_file(const std::filesystem::path& path);

}  // namespace linum::files
