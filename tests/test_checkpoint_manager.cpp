// CheckpointManager: steps saved atomically in their own directories, keep-last-N and keep-best-N,
// restore checked against a target, stale temporaries removed, a killed writer leaves no step.
#include <doctest/doctest.h>

#include <linum/linum.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

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

TEST_CASE("async_save: each step holds the state as it was at save(), written in the background; queries wait for it") {
  TempDir tmp;
  CheckpointManager ckpt(tmp.path, {.max_to_keep = 2, .async_save = true});
  Array w = Array::full(Shape{512, 1024}, 0.0f);  // 2 MiB: the write takes a while
  const Tree state{{"params", Tree{{"w", w}}}, {"opt_state", Tree{{"count", Array::full_i32(Shape{}, 1)}}}};
  for (int step = 0; step < 4; ++step) {
    CHECK(ckpt.save(step, state, {{"loss", 1.0 / (step + 1)}}));
    CHECK(ckpt.step_in_flight() == std::optional<std::int64_t>(step));
    CHECK_FALSE(ckpt.should_save(step));
    CHECK_THROWS_WITH_AS(ckpt.save(step, state), doctest::Contains("already saved"), ValueError);
    // Training goes on at once: an optimizer updating the parameters in place.
    std::fill_n(w.mutable_data(), w.numel(), static_cast<float>(step + 1));
  }
  ckpt.wait_until_finished();
  CHECK_FALSE(ckpt.step_in_flight());
  CHECK(ckpt.all_steps() == std::vector<std::int64_t>{2, 3});  // max_to_keep applied in the background
  for (std::int64_t step : {2, 3}) {
    const Tree restored = ckpt.restore(step, state);
    const Array& saved = restored.at("params").at("w").array();
    CHECK(saved.data()[0] == static_cast<float>(step));  // not the later in-place update
    CHECK(saved.data()[saved.numel() - 1] == static_cast<float>(step));
  }
  CHECK(ckpt.metrics(3).at("loss") == doctest::Approx(0.25));
  // A query right after a save sees that step (it waits), also through a moved manager.
  CHECK(ckpt.save(4, state));
  CheckpointManager moved = std::move(ckpt);
  CHECK(moved.latest_step() == std::optional<std::int64_t>(4));
  CHECK(bitwise_equal(moved.restore(4, state), state));
  // Invalid input is refused before anything is written or started.
  CHECK_THROWS_AS(moved.save(5, state, {{"loss", std::nan("")}}), ValueError);
  CHECK_FALSE(moved.step_in_flight());
  CHECK(moved.all_steps() == std::vector<std::int64_t>{3, 4});
}

TEST_CASE("async_save: a failed background write is thrown by the next call that waits, or warned about") {
  TempDir tmp;
  const Tree state = state_at(1);
  {
    CheckpointManager ckpt(tmp.path / "root", {.async_save = true});
    fs::remove_all(tmp.path / "root");
    { std::ofstream(tmp.path / "root") << "not a directory"; }  // the root is gone: the write must fail
    CHECK(ckpt.save(1, state));
    CHECK_THROWS_WITH_AS(ckpt.wait_until_finished(), doctest::Contains("cannot create"), IoError);
    CHECK_FALSE(ckpt.step_in_flight());  // reported once
    CHECK_NOTHROW(ckpt.wait_until_finished());
    // check_for_errors never blocks, and throws once the write has ended with an error.
    CHECK(ckpt.save(2, state));
    bool thrown = false;
    for (int i = 0; i < 2000 && !thrown; ++i) {
      try {
        ckpt.check_for_errors();
      } catch (const IoError&) {
        thrown = true;
      }
      if (!thrown) ::usleep(1000);
    }
    CHECK(thrown);
    // A save nobody waits for: its error goes to the warning handler when the manager ends.
    CHECK(ckpt.save(3, state));
    std::string warned;
    const WarningHandler before = set_warning_handler([&](const std::string& m) { warned = m; });
    { CheckpointManager ending = std::move(ckpt); }
    set_warning_handler(before);
    CHECK(warned.find("a background save failed") != std::string::npos);
    CHECK(warned.find("cannot create") != std::string::npos);
  }
}
