// The library's precompiled header (meson.build, `cpp_pch`): the standard headers and Linum's core
// headers that most of the library's sources include, parsed once per build instead of once per
// source (about 0.9 s of GCC's time per source, a fifth of a typical one). Each source still
// includes what it uses: the minimal build in .ci/run compiles with -Db_pch=false, so a missing
// include fails there. Eigen, OpenMP and MPI stay out (few sources use them, and a large header
// costs every source that loads it).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <linum/core/array.hpp>
#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/error.hpp>
#include <linum/core/ops/all.hpp>
#include <linum/core/threading.hpp>
