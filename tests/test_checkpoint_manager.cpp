// CheckpointManager: steps saved atomically in their own directories, keep-last-N and keep-best-N,
// restore checked against a target, stale temporaries removed, a killed writer leaves no step.
#include <doctest/doctest.h>

#include <linum/linum.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

using namespace linum;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() : path(fs::temp_directory_path() / ("linum_ckpt_" + std::to_string(::getpid()))) { fs::remove_all(path); }
  ~TempDir() { fs::remove_all(path); }
};

Tree state_at(float v) {
  return Tree{{"params", Tree{{"w", Array::full(Shape{2, 3}, v)}}}, {"opt_state", Tree{{"count", Array::full_i32(Shape{}, 1)}}}};
}

}  // namespace

TEST_CASE("keep the last N; latest_step; restore checks the target's structure and shapes") {
  TempDir tmp;
  CheckpointManager ckpt(tmp.path, {.max_to_keep = 2});
  CHECK_FALSE(ckpt.latest_step());
  for (int step = 0; step < 5; ++step) CHECK(ckpt.save(step, state_at(static_cast<float>(step))));
  CHECK(ckpt.all_steps() == std::vector<std::int64_t>{3, 4});
  CHECK(*ckpt.latest_step() == 4);
  const Tree restored = ckpt.restore(4, state_at(0));
  CHECK(bitwise_equal(restored, state_at(4)));
  Tree other = state_at(0);
  other.at("params").set("w", Array::zeros(Shape{3, 2}));
  CHECK_THROWS_WITH_AS(ckpt.restore(4, other), doctest::Contains("params/w"), ValueError);
  CHECK_THROWS_WITH_AS(ckpt.restore(1), doctest::Contains("saved steps: 3, 4"), IoError);
  CHECK_THROWS_WITH_AS(ckpt.save(4, state_at(9)), doctest::Contains("already saved"), ValueError);
  // A second manager on the same directory sees the same steps (resume after a restart).
  CHECK(CheckpointManager(tmp.path).all_steps() == std::vector<std::int64_t>{3, 4});
}

TEST_CASE("keep the best N by a metric, plus the newest; save intervals") {
  TempDir tmp;
  CheckpointManager ckpt(tmp.path, {.max_to_keep = 2, .best_metric = "accuracy", .best_mode = BestMode::max,
                                    .save_interval_steps = 10});
  const double acc[] = {0.5, 0.9, 0.7, 0.8, 0.6};
  for (int i = 0; i < 5; ++i) CHECK(ckpt.save(10 * i, state_at(static_cast<float>(i)), {{"accuracy", acc[i]}}));
  CHECK_FALSE(ckpt.save(15, state_at(0)));  // not a multiple of 10
  CHECK(ckpt.all_steps() == std::vector<std::int64_t>{10, 30, 40});  // best two (0.9, 0.8) and the newest
  CHECK(*ckpt.best_step() == 10);
  CHECK(ckpt.metrics(30).at("accuracy") == doctest::Approx(0.8));
  CheckpointManager lowest(tmp.path / "loss", {.max_to_keep = 1, .best_metric = "loss", .best_mode = BestMode::min});
  lowest.save(1, state_at(1), {{"loss", 2.0}});
  lowest.save(2, state_at(2), {{"loss", 1.0}});
  lowest.save(3, state_at(3), {{"loss", 3.0}});
  CHECK(lowest.all_steps() == std::vector<std::int64_t>{2, 3});
  CHECK_THROWS_AS(lowest.save(4, state_at(4), {{"loss", std::nan("")}}), ValueError);
  CHECK(lowest.all_steps() == std::vector<std::int64_t>{2, 3});  // the refused step left nothing
}

TEST_CASE("a writer killed mid-save leaves no step, and its temporary is cleaned up") {
  TempDir tmp;
  { CheckpointManager(tmp.path).save(1, state_at(1)); }
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    CheckpointManager ckpt(tmp.path);
    const Tree big{{"w", Array::zeros(Shape{64, 1024, 1024})}};  // 256 MiB: long enough to be killed
    ckpt.save(2, big);
    ::_exit(0);
  }
  ::usleep(150 * 1000);
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  CheckpointManager after(tmp.path);
  const auto steps = after.all_steps();
  // Either the kill came first (only step 1) or the save finished; never a partial step 2.
  CHECK((steps == std::vector<std::int64_t>{1} || steps == std::vector<std::int64_t>{1, 2}));
  for (const auto& entry : fs::directory_iterator(tmp.path)) CHECK(entry.path().filename().string().rfind(".tmp-", 0) != 0);
}
