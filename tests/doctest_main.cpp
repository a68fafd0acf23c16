// The main function of the doctest programs. LINUM_TEST_BF16_PRODUCTS=dot_instructions|onednn|widened
// runs the program under that choice of bf16 products (engine.hpp; tests/meson.build runs the areas
// whose bf16 results go through products under each): exit code 77 (Meson's "skipped") where this
// CPU or build lacks the choice, or where it is the default, which the plain run already covers.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <linum/core/kernels/engine.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  if (const char* want = std::getenv("LINUM_TEST_BF16_PRODUCTS"); want != nullptr && *want != 0) {
    bool known = false;
    for (linum::Bf16Products p : {linum::Bf16Products::dot_instructions, linum::Bf16Products::onednn, linum::Bf16Products::widened}) {
      if (std::strcmp(want, linum::bf16_products_name(p)) != 0) continue;
      known = true;
      if (!linum::bf16_products_available(p) || p == linum::bf16_products()) {
        std::printf("skipped: bf16 products %s are %s here\n", want,
                    linum::bf16_products_available(p) ? "the default (the plain run covers them)" : "not available");
        return 77;
      }
      linum::set_bf16_products(p);
    }
    if (!known) {
      std::fprintf(stderr, "LINUM_TEST_BF16_PRODUCTS=%s: unknown; use dot_instructions, onednn or widened\n", want);
      return 2;
    }
  }
  doctest::Context context(argc, argv);
  return context.run();
}
