#include <linum/core/fp_mode.hpp>
#include <linum/core/threading.hpp>

#include <cfenv>
#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define LINUM_FP_X86 1
#elif defined(__aarch64__)
#define LINUM_FP_ARM64 1
#endif

namespace linum {
namespace {

std::atomic<bool> g_flush{true};

void read_environment_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* v = std::getenv("LINUM_FLUSH_DENORMALS");
    if (v != nullptr && (std::strcmp(v, "0") == 0 || std::strcmp(v, "false") == 0 || std::strcmp(v, "off") == 0))
      g_flush.store(false);
  });
}

#if LINUM_FP_X86
constexpr unsigned kFtz = 0x8000;  // MXCSR bit 15: flush results to zero
constexpr unsigned kDaz = 0x0040;  // MXCSR bit 6: treat subnormal inputs as zero
#elif LINUM_FP_ARM64
constexpr unsigned long kFz = 1ul << 24;  // FPCR.FZ
#endif

void set_thread_mode(bool flush) {
#if LINUM_FP_X86
  const unsigned csr = _mm_getcsr();
  const unsigned want = flush ? (csr | kFtz | kDaz) : (csr & ~(kFtz | kDaz));
  if (want != csr) _mm_setcsr(want);
#elif LINUM_FP_ARM64
  unsigned long fpcr;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
  const unsigned long want = flush ? (fpcr | kFz) : (fpcr & ~kFz);
  if (want != fpcr) __asm__ __volatile__("msr fpcr, %0" : : "r"(want));
#else
  (void)flush;
#endif
}

}  // namespace

namespace detail {
// Generation 1 is "the initial setting"; threads start at 0, so their first op applies it.
std::atomic<unsigned> g_fp_mode_generation{1};
thread_local unsigned t_fp_mode_generation = 0;

void apply_fp_mode() {
  read_environment_once();
  const unsigned generation = g_fp_mode_generation.load(std::memory_order_acquire);
  set_thread_mode(g_flush.load(std::memory_order_relaxed));
  t_fp_mode_generation = generation;
}
}  // namespace detail

bool flush_denormals() {
  read_environment_once();
  return g_flush.load();
}

void set_flush_denormals(bool on) {
  read_environment_once();
  g_flush.store(on);
  detail::g_fp_mode_generation.fetch_add(1, std::memory_order_acq_rel);
  detail::apply_fp_mode();  // the calling thread at once; others at their next op or parallel region
}

IeeeSubnormalScope::IeeeSubnormalScope() : saved_(0) {
#if LINUM_FP_X86
  saved_ = _mm_getcsr();
#elif LINUM_FP_ARM64
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
#endif
  set_thread_mode(false);
}

IeeeSubnormalScope::~IeeeSubnormalScope() {
#if LINUM_FP_X86
  _mm_setcsr(static_cast<unsigned>(saved_));
#elif LINUM_FP_ARM64
  __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
}

namespace detail {
unsigned fp_state_key() {
#if LINUM_FP_X86
  const unsigned csr = _mm_getcsr();
  return ((csr >> 15) & 1u) | (((csr >> 6) & 1u) << 1) | (((csr >> 13) & 3u) << 2);  // FTZ, DAZ, RC
#elif LINUM_FP_ARM64
  unsigned long fpcr;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
  // FZ, RMode, DN (default NaN), and FEAT_AFP's FIZ and AH
  return static_cast<unsigned>(((fpcr >> 24) & 1ul) | (((fpcr >> 22) & 3ul) << 1) | (((fpcr >> 25) & 1ul) << 3) |
                               ((fpcr & 3ul) << 4));
#else
  switch (std::fegetround()) {  // the rounding mode, the one control standard C++ can read
    case FE_TONEAREST: return 0;
#ifdef FE_DOWNWARD
    case FE_DOWNWARD: return 1;
#endif
#ifdef FE_UPWARD
    case FE_UPWARD: return 2;
#endif
#ifdef FE_TOWARDZERO
    case FE_TOWARDZERO: return 3;
#endif
    default: return 4;
  }
#endif
}
}  // namespace detail

bool thread_flushes_denormals() {
#if LINUM_FP_X86
  return (_mm_getcsr() & (kFtz | kDaz)) == (kFtz | kDaz);
#elif LINUM_FP_ARM64
  unsigned long fpcr;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
  return (fpcr & kFz) != 0;
#else
  return false;
#endif
}

}  // namespace linum
