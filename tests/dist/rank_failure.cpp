// A job whose rank 1 throws in its second step while the others wait in a collective call: the
// job must end (within seconds, with an error naming the rank), not hang.
#include <linum/linum.hpp>

#include <cstdio>
#include <string>

using namespace linum;

int main(int argc, char** argv) {
  dist::Session mpi(argc, argv);
  return dist::run_or_abort([&] {
    const Tree params{{"w", rng::normal(rng::key(0), Shape{256, 256})}};
    const std::string mode = argc > 1 ? argv[1] : "reproducible";
    const dist::DataParallelOptions options{.reduction = mode == "fast" ? dist::Reduction::fast : dist::Reduction::reproducible,
                                            .micro_batches = dist::size()};
    const Tree batch{{"x", rng::normal(rng::key(1), Shape{64, 256})}};
    int step = 0;
    const dist::Loss loss = [&](const Tree& p, const Tree& b, rng::Key) {
      if (step == 1 && dist::rank() == 1) throw ValueError("injected failure in the loss (step 2)");
      if (mode == "sharded") {  // read through a module, as stage 3 gathers parameters on module reads
        struct Linear {
          Array operator()(Scope& s, const Array& x) const {
            return matmul(x, s.param("w", initializers::zeros(), Shape{x.dim(1), x.dim(1)}));
          }
        };
        return mean(square(apply(Linear{}, Tree{{"params", p}}, b.at("x").array())));
      }
      return mean(square(matmul(b.at("x").array(), p.at("w").array())));
    };
    if (mode == "sharded") {  // ZeRO stage 3: the others wait in a parameter gather inside the forward pass
      dist::ShardedDataParallel zero(params, optim::adam(1e-3), {.stage = 3, .data = options});
      for (; step < 3; ++step) zero.step(loss, batch, rng::key(2));
    } else {
      dist::DataParallel dp(options);
      for (; step < 3; ++step) dp.value_and_grad(loss, params, batch, rng::key(2));
    }
    std::printf("rank %d finished (should not happen on rank 0 with 2+ ranks)\n", dist::rank());
    return 0;
  });
}
