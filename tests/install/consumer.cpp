// Compiled by .ci/run against an installed (staged) Linum through pkg-config, as a user would.
#include <linum/linum.hpp>
#include <cstdio>
int main(int argc, char** argv) {
  using namespace linum;
  dist::Session mpi(argc, argv);  // links the data-parallel part (and MPI, when Linum has it)
  Array x = Array::from(Shape{3}, {1, 2, 3});
  auto g = grad([](const Array& a) { return sum(checkpoint([](const Array& b) { return b * b; })(a)); })(x);
  g = dist::allreduce_mean(Tree(g)).array();  // one process: g itself
  std::printf("%g %g %g\n", g.to_vector()[0], g.to_vector()[1], g.to_vector()[2]);
}
