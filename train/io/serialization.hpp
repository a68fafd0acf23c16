// Saving and loading Trees, as MessagePack (compatible with Flax) and as JSON.
//
// MessagePack layout (the layout of flax.serialization.msgpack_serialize / msgpack_restore):
//   - a dict is a msgpack map with str keys, entries in tree order;
//   - an array is an ext record with type code 1 whose payload is itself msgpack: a 3-element
//     array [shape as an array of non-negative ints, dtype name as str ("float32", "bfloat16" or
//     "int32"),
//     the C-order little-endian element bytes as bin];
//   - an array above 2^30 bytes is written the way Flax chunks it: a map
//     {"__msgpack_chunked_array__": true, "shape": {"0": d0, "1": d1, ...},
//      "chunks": {"0": <ext 1, 1-D>, "1": ...}} with chunks of 2^30 / itemsize elements.
//   Every length uses the smallest msgpack encoding, as Python's msgpack does, so a Tree written
//   here is byte-identical to msgpack_serialize of the same nested dict of numpy arrays.
//   Reading also accepts ext code 3 (numpy scalars; same payload) and dtype names or data given as
//   str or bin. Other dtypes are converted when that is lossless and rejected otherwise:
//     bool, int8, uint8, int16, uint16           -> int32 (always exact)
//     int64, uint32, uint64                      -> int32 if every value fits, else IoError
//     bfloat16                                   -> bfloat16 (kept, 2 bytes per element, as Flax wrote it)
//     float16                                    -> float32 (always exact)
//     float64                                    -> float32 if every value converts exactly
//                                                   (NaN and +-inf included), else IoError
//   Anything else (complex, strings, other Python values, non-str keys, unknown ext codes) is an
//   IoError naming the path of the entry.
//
// JSON layout: a dict is a JSON object with the same keys in the same order; a leaf is
//   {"shape": [2, 3], "dtype": "float32", "data": [0.5, -1, ...]}
// with the elements in C order. A JSON object is a leaf exactly when it has a "dtype" entry whose
// value is a string (a dict entry named "dtype" always holds an object). Float elements are
// written so that they read back bit-exactly: finite values as JSON numbers (the shortest decimal
// that reads back as the same float32 when there is one, else the exact double value), and the
// non-finite values as strings "inf", "-inf", "nan" (the default quiet NaN 0x7fc00000) or
// "nan(0xXXXXXXXX)" with the bit pattern for any other NaN. int32 elements are JSON integers.
//
// Loading validates everything and throws IoError naming the source (file name) and the path of
// the bad entry inside the tree; a truncated or corrupt input is an error, never a crash, and
// no allocation is larger than the input justifies.
//
// Writing files is atomic: the data goes to a temporary file in the same directory, which is
// flushed, fsync'ed and renamed over the target. On failure the previous file is untouched and
// the temporary file is removed. The temporary file is anonymous (O_TMPFILE) until it is complete,
// so a process killed mid-write leaves nothing behind; on file systems without O_TMPFILE it is a
// named ".<name>.tmp-<pid>-<n>" file, which the next save removes once its writer is dead.
#pragma once

#include <linum/core/files.hpp>
#include <linum/core/tree.hpp>

// Declarations only (nlohmann::json, ordered_json): the full json.hpp costs every includer
// about 2.8 s of compile time; the .cpp files that build or read JSON include it themselves.
#include <nlohmann/json_fwd.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string_view>
#include <vector>

namespace linum::serialization {

// Flax's MAX_CHUNK_SIZE: arrays with more bytes than this are written in chunks.
inline constexpr std::size_t kFlaxMaxChunkBytes = std::size_t{1} << 30;

// The tree as MessagePack bytes in Flax's layout. `max_chunk_bytes` is the chunking threshold
// (leave the default for Flax compatibility; tests lower it to exercise chunking).
std::vector<std::uint8_t> to_msgpack(const Tree& tree, std::size_t max_chunk_bytes = kFlaxMaxChunkBytes);

// Reads MessagePack bytes in Flax's layout. `source` names the data in error messages (a file
// name, say). Throws IoError on anything malformed or unsupported.
Tree from_msgpack(std::span<const std::uint8_t> bytes, std::string_view source = "<msgpack bytes>");

// The tree in the JSON layout above. Uses ordered_json so key order is the tree's order.
nlohmann::ordered_json to_json(const Tree& tree);

// Reads the JSON layout above. Throws IoError naming `source` and the path of a bad entry.
Tree from_json(const nlohmann::ordered_json& json, std::string_view source = "<json>");
// The same for a std::map-backed nlohmann::json (whose keys come back sorted alphabetically).
Tree from_json(const nlohmann::json& json, std::string_view source = "<json>");

// Atomically writes the tree as MessagePack (Flax layout) to `path`. Throws IoError.
void save_msgpack(const std::filesystem::path& path, const Tree& tree);
// Atomically writes the tree as JSON (indented by 1 space per level) to `path`. Throws IoError.
void save_json(const std::filesystem::path& path, const Tree& tree);
// Reads a MessagePack file. Throws IoError naming the file.
Tree load_msgpack(const std::filesystem::path& path);
// Reads a JSON file. Throws IoError naming the file.
Tree load_json(const std::filesystem::path& path);

// save_msgpack for a ".msgpack" extension, save_json for ".json"; IoError for anything else.
void save(const std::filesystem::path& path, const Tree& tree);
// load_msgpack for a ".msgpack" extension, load_json for ".json"; IoError for anything else.
Tree load(const std::filesystem::path& path);

// Reading whole files and writing them atomically (core/files.hpp), also under this namespace.
using files::read_file;
using files::write_file_atomic;

}  // namespace linum::serialization
