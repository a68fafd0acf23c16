#include <linum/core/threading.hpp>

#include <cstdlib>
#include <cstring>
#include <string>

namespace linum {
namespace {

bool g_default_applied = false;

bool has_variable(char** envp, const char* name) {
  const std::size_t n = std::strlen(name);
  for (char** e = envp; e != nullptr && *e != nullptr; ++e)
    if (std::strncmp(*e, name, n) == 0 && (*e)[n] == '=') return true;
  return false;
}

// Runs before libgomp's constructor reads its environment (pre-initialisation functions of the
// executable run before the initialisers of any shared library). At this point glibc has not yet
// set up `environ`, so the user's settings are looked up in `envp`.
void apply_default_wait_policy(int, char**, char** envp) {
  if (has_variable(envp, "OMP_WAIT_POLICY") || has_variable(envp, "GOMP_SPINCOUNT")) return;
  setenv("OMP_WAIT_POLICY", "passive", 0);
  g_default_applied = true;
}

#if defined(LINUM_STATIC_LIBRARY) && defined(__ELF__)
// Only an executable may have pre-initialisation functions, so this is compiled into the static
// library (whose objects become part of the executable) and not into a shared one.
__attribute__((section(".preinit_array"), used)) void (*const linum_wait_policy_preinit)(int, char**, char**) =
    &apply_default_wait_policy;
#endif

}  // namespace

namespace detail {
// Called when a thread first computes (core/fp_mode.cpp), so the linker always keeps this object,
// and its pre-initialisation entry, in programs that use Linum.
void keep_threading_linked() {}
}  // namespace detail

std::string openmp_wait_policy() {
  // glibc restores the process environment after pre-initialisation, so the default set above was
  // seen by libgomp but is not visible to getenv (nor to child processes) afterwards.
  if (g_default_applied) return "passive (Linum's default)";
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  if (policy != nullptr) return policy;
  if (spin != nullptr) return std::string("GOMP_SPINCOUNT=") + spin;
  return "unset (libgomp spins, then sleeps)";
}

}  // namespace linum
