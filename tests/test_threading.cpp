// The compute environment: subnormals flushed in every thread Linum computes in, and OpenMP
// threads that sleep instead of spinning unless the user says otherwise.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include <cmath>
#include <cstdlib>

using namespace linum;

TEST_CASE("subnormals are flushed in every thread Linum computes in, unless opted out") {
  REQUIRE(flush_denormals());
  const Array tiny = Array::full(Shape{1 << 19}, 1e-30f);  // large enough for the OpenMP threads to join
  const Array y = tiny * 1e-10f;                           // 1e-40 is subnormal in float32
  CHECK(thread_flushes_denormals());
  for (float v : y.to_vector()) {
    if (v != 0.0f) { CHECK(v == 0.0f); break; }
  }
  set_flush_denormals(false);
  const Array z = tiny * 1e-10f;
  CHECK_FALSE(thread_flushes_denormals());
  bool all_subnormal = true;
  for (float v : z.to_vector()) all_subnormal = all_subnormal && v != 0.0f && std::fpclassify(v) == FP_SUBNORMAL;
  CHECK(all_subnormal);
  set_flush_denormals(true);
  CHECK(thread_flushes_denormals());
  {
    IeeeSubnormalScope exact;
    CHECK_FALSE(thread_flushes_denormals());
  }
  CHECK(thread_flushes_denormals());
}

TEST_CASE("OpenMP threads wait passively by default, and a user's setting wins") {
  const bool user_set = std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr;
  if (!user_set) CHECK(openmp_wait_policy() == "passive (Linum's default)");
  else CHECK(openmp_wait_policy().find("Linum") == std::string::npos);
}
