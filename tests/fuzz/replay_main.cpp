// The fuzz targets' main() when they are not built with libFuzzer (GCC, or clang without
// -Dfuzz=enabled): runs the target once on every file named on the command line, directories
// included (their files in name order), as `fuzz_x -runs=0 corpus/` does with libFuzzer. The test
// suite runs the kept corpus this way in every build, sanitizer builds included.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    const fs::path arg = argv[i];
    if (arg.string().starts_with("-")) continue;  // libFuzzer flags (e.g. -runs=0) mean nothing here
    if (fs::is_directory(arg)) {
      std::vector<fs::path> in_dir;
      for (const auto& entry : fs::directory_iterator(arg))
        if (entry.is_regular_file()) in_dir.push_back(entry.path());
      std::sort(in_dir.begin(), in_dir.end());
      files.insert(files.end(), in_dir.begin(), in_dir.end());
    } else {
      files.push_back(arg);
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "usage: %s FILE_OR_DIR...  (runs the fuzz target once on each input)\n", argv[0]);
    return 2;
  }
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "cannot read %s\n", file.c_str());
      return 2;
    }
    const std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
  }
  std::printf("ran %zu inputs\n", files.size());
  return 0;
}
