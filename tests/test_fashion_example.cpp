// The main example end to end on a small synthetic dataset in the IDX format: it trains, writes
// its result line, resumes to the same result as an uninterrupted run, evaluates a saved model, and
// turns missing or corrupt data into a clear error (exit code 1), never a crash.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>
#include <linum/linum.hpp>


#include <nlohmann/json.hpp>

#include <array>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>

namespace fs = std::filesystem;
using namespace linum;

namespace {

std::string g_binary;  // path of the fashion_mnist executable (first command-line argument)

struct Run {
  int status;
  std::string output;
};

Run run_command(const std::string& command_line) {
  const std::string command = command_line + " 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command.c_str(), "r"), pclose);
  REQUIRE(pipe != nullptr);
  std::string out;
  std::array<char, 4096> buf{};
  while (std::fgets(buf.data(), buf.size(), pipe.get())) out += buf.data();
  const int status = pclose(pipe.release());
  return {WEXITSTATUS(status), out};
}

Run run(const std::string& args) { return run_command(g_binary + " " + args); }

nlohmann::json last_line(const std::string& output) {
  const auto end = output.find_last_not_of('\n');
  const auto start = output.rfind('\n', end);
  return nlohmann::json::parse(output.substr(start == std::string::npos ? 0 : start + 1, end - start));
}

// Class k: a bright horizontal band at rows 2k..2k+3, plus noise.
void make_split(const fs::path& dir, const std::string& prefix, std::int64_t n, unsigned seed) {
  Array labels = rng::randint(rng::key(seed), Shape{n}, 0, 10);
  Array noise = rng::uniform(rng::key(seed + 100), Shape{n, 28, 28}, 0.0f, 60.0f);
  Array images = Array::empty(Shape{n, 28, 28});
  for (std::int64_t i = 0; i < n; ++i)
    for (int r = 0; r < 28; ++r)
      for (int c = 0; c < 28; ++c) {
        const int k = labels.data_i32()[i];
        const float band = (r >= 2 * k + 2 && r < 2 * k + 6) ? 180.0f : 0.0f;
        images.mutable_data()[(i * 28 + r) * 28 + c] = std::floor(band + noise.data()[(i * 28 + r) * 28 + c]);
      }
  datasets::write_mnist(dir, prefix, images, labels);
}

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("linum_fashion_" + std::to_string(::getpid()));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

}  // namespace

TEST_CASE("fashion_mnist trains, resumes to the same result, evaluates, and reports bad data") {
  REQUIRE_MESSAGE(!g_binary.empty(), "pass the fashion_mnist binary as the first argument");
  TempDir tmp;
  const fs::path data = tmp.path / "data";
  fs::create_directories(data);
  make_split(data, "train", 256, 1);
  make_split(data, "t10k", 256, 2);
  const std::string common = "--data " + data.string() + " --batch 64 --lr 0.003 --depth 3 --width 12 --memory-plot none ";
  // The runs after the first only train: without the measurement (one epoch's worth of steps here).
  const std::string train_only = common + "--measure none ";

  Run full = run(common + "--epochs 2 --checkpoint " + (tmp.path / "full.msgpack").string());
  INFO(full.output);
  REQUIRE(full.status == 0);
  const auto result = last_line(full.output);
  CHECK(result["epochs"] == 2);
  CHECK(result["remat"] == "full");
  CHECK(result["test_accuracy"].get<double>() > 0.9);  // the bands are easy to learn
  // What remat buys, measured on one training step: less memory than the plain step.
  CHECK(result["peak_activation_bytes"].get<long>() > 0);
  CHECK(result["peak_activation_bytes"].get<long>() < result["peak_activation_bytes_plain"].get<long>());
  CHECK(result["step_seconds"].get<double>() > 0);
  CHECK(result["step_seconds_plain"].get<double>() > 0);

  // By default it draws the step's memory timeline, with and without remat, into the working directory.
  const fs::path plot_dir = tmp.path / "plot";
  fs::create_directories(plot_dir);
  Run plotted = run_command("cd " + plot_dir.string() + " && " + g_binary + " --data " + data.string() +
                            " --batch 64 --depth 3 --width 12 --epochs 0");
  INFO(plotted.output);
  REQUIRE(plotted.status == 0);
  CHECK(plotted.output.find("less activation memory for") != std::string::npos);
  std::ifstream svg(plot_dir / "fashion_mnist_memory.svg");
  const std::string picture((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  CHECK(picture.find("<svg") == 0);
  CHECK(picture.find("no remat") != std::string::npos);
  CHECK(picture.find("remat per block, full") != std::string::npos);

  // One epoch, then --resume for the second: the same model as the uninterrupted run, bit for bit.
  const std::string ck = (tmp.path / "resumed.msgpack").string();
  REQUIRE(run(train_only + "--epochs 1 --checkpoint " + ck).status == 0);
  Run resumed = run(train_only + "--epochs 2 --resume --checkpoint " + ck);
  INFO(resumed.output);
  REQUIRE(resumed.status == 0);
  CHECK(last_line(resumed.output)["test_accuracy"] == result["test_accuracy"]);
  CHECK(!last_line(resumed.output).contains("peak_activation_bytes"));  // --measure none: not measured
  CHECK(resumed.output.find("activation memory") == std::string::npos);
  CHECK(bitwise_equal(serialization::load(ck), serialization::load(tmp.path / "full.msgpack")));

  // The same through a CheckpointManager directory: one step per epoch, resumed from the latest.
  const std::string dir = (tmp.path / "managed").string();
  REQUIRE(run(train_only + "--epochs 1 --checkpoint-dir " + dir).status == 0);
  CHECK(CheckpointManager(dir).all_steps() == std::vector<std::int64_t>{1});
  Run managed = run(train_only + "--epochs 2 --resume --checkpoint-dir " + dir);
  INFO(managed.output);
  REQUIRE(managed.status == 0);
  CHECK(last_line(managed.output)["test_accuracy"] == result["test_accuracy"]);
  CHECK(CheckpointManager(dir).all_steps() == std::vector<std::int64_t>{1, 2});
  CHECK(bitwise_equal(CheckpointManager(dir).restore(2), serialization::load(tmp.path / "full.msgpack")));

  // --eval only evaluates the saved model.
  Run eval = run(train_only + "--eval --checkpoint " + ck);
  REQUIRE(eval.status == 0);
  CHECK(last_line(eval.output)["test_accuracy"] == result["test_accuracy"]);

  // Without remat the same training gives the same model (remat changes memory, not results).
  Run plain = run(train_only + "--epochs 2 --remat none --checkpoint " + (tmp.path / "plain.msgpack").string());
  REQUIRE(plain.status == 0);
  CHECK(bitwise_equal(serialization::load(tmp.path / "plain.msgpack"), serialization::load(tmp.path / "full.msgpack")));

  // Mixed precision: bf16 trains as well; remat none and full still give bitwise the same model.
  Run bf16 = run(train_only + "--epochs 2 --dtype bf16 --checkpoint " + (tmp.path / "bf16.msgpack").string());
  INFO(bf16.output);
  REQUIRE(bf16.status == 0);
  CHECK(last_line(bf16.output)["dtype"] == "bf16");
  CHECK(last_line(bf16.output)["test_accuracy"].get<double>() > 0.9);
  Run bf16_plain = run(train_only + "--epochs 2 --dtype bf16 --remat none --checkpoint " + (tmp.path / "bf16p.msgpack").string());
  REQUIRE(bf16_plain.status == 0);
  const Tree bf16_model = serialization::load(tmp.path / "bf16.msgpack");
  CHECK(bitwise_equal(serialization::load(tmp.path / "bf16p.msgpack"), bf16_model));
  CHECK(bf16_model.at_path("params/Head_0/Dense_0/kernel").array().dtype() == DType::f32);  // float32 masters

  // Pure bf16 (param_dtype=bf16, as Flax allows): bf16 parameters get their gradients and the model
  // learns as the float32 one does (before the one primitive path they got zeros and it did not).
  Run pure = run(train_only + "--epochs 2 --dtype bf16 --param-dtype bf16 --checkpoint " + (tmp.path / "pure.msgpack").string());
  INFO(pure.output);
  REQUIRE(pure.status == 0);
  const auto pure_result = last_line(pure.output);
  CHECK(pure_result["param_dtype"] == "bf16");
  CHECK(pure_result["test_accuracy"].get<double>() > 0.9);
  CHECK(pure_result["final_train_loss"].get<double>() < 1.5 * result["final_train_loss"].get<double>() + 0.05);
  CHECK(serialization::load(tmp.path / "pure.msgpack").at_path("params/Head_0/Dense_0/kernel").array().dtype() == DType::bf16);
  CHECK(run("--dtype f16").status == 2);

  // Missing data: a message saying how to get it, exit code 1.
  Run missing = run("--data " + (tmp.path / "nowhere").string());
  CHECK(missing.status == 1);
  CHECK(missing.output.find("apt-get install dataset-fashion-mnist") != std::string::npos);
  // A truncated file: an error naming it, no crash.
  {
    const fs::path f = data / "t10k-images-idx3-ubyte.gz";
    const auto size = fs::file_size(f);
    fs::resize_file(f, size / 2);
  }
  Run corrupt = run(train_only + "--epochs 1 --checkpoint " + (tmp.path / "c.msgpack").string());
  CHECK(corrupt.status == 1);
  CHECK(corrupt.output.find("t10k-images-idx3-ubyte.gz") != std::string::npos);
  // Bad flags: exit code 2 with usage.
  CHECK(run("--remat sometimes").status == 2);
  CHECK(run("--measure sometimes").status == 2);
}

TEST_CASE("fashion_mnist under mpirun: any rank count trains bitwise the same model, and resumes from any other") {
  const char* mpirun = std::getenv("LINUM_MPIRUN");
  if (mpirun == nullptr || *mpirun == '\0') {
    MESSAGE("LINUM_MPIRUN not set (Linum built without MPI): skipped");
    return;
  }
  TempDir tmp;
  const fs::path data = tmp.path / "data";
  fs::create_directories(data);
  make_split(data, "train", 192, 1);
  make_split(data, "t10k", 128, 2);
  const std::string common = "--data " + data.string() + " --batch 64 --lr 0.003 --depth 3 --width 12 --dropout 0.2 --memory-plot none ";
  auto on = [&](int ranks, const std::string& args) {
    // (Open MPI's own allocations are alive at exit: no leak report from the sanitizer build.)
    const std::string launcher = "ASAN_OPTIONS=detect_leaks=0 " + std::string(mpirun) + " --allow-run-as-root --oversubscribe -np " + std::to_string(ranks) + " ";
    return run_command(launcher + g_binary + " " + common + args);
  };
  Run single = run(common + "--measure none --epochs 2 --checkpoint " + (tmp.path / "single.msgpack").string());
  INFO(single.output);
  REQUIRE(single.status == 0);
  const auto expected = last_line(single.output);
  CHECK(expected["ranks"] == 1);
  for (int ranks : {1, 2, 3}) {
    CAPTURE(ranks);
    const fs::path ck = tmp.path / ("np" + std::to_string(ranks) + ".msgpack");
    // (the measurement before training runs collective steps too: once, on 2 ranks)
    Run r = on(ranks, std::string(ranks == 2 ? "" : "--measure none ") + "--epochs 2 --checkpoint " + ck.string());
    INFO(r.output);
    REQUIRE(r.status == 0);
    const auto got = last_line(r.output);
    CHECK(got["ranks"] == ranks);
    CHECK(got["params_checksum"] == expected["params_checksum"]);
    CHECK(got["test_accuracy"] == expected["test_accuracy"]);
    CHECK(bitwise_equal(serialization::load(ck), serialization::load(tmp.path / "single.msgpack")));  // rank 0's file
  }
  // One epoch on 3 ranks, the second resumed on 2: the uninterrupted single-process model.
  const std::string ck = (tmp.path / "switch.msgpack").string();
  REQUIRE(on(3, "--measure none --epochs 1 --checkpoint " + ck).status == 0);
  Run resumed = on(2, "--measure none --epochs 2 --resume --checkpoint " + ck);
  INFO(resumed.output);
  REQUIRE(resumed.status == 0);
  CHECK(last_line(resumed.output)["params_checksum"] == expected["params_checksum"]);
  // Fast mode trains too (other bits: its sum follows the rank count).
  Run fast = on(2, "--measure none --epochs 2 --reduction fast --checkpoint " + (tmp.path / "fast.msgpack").string());
  INFO(fast.output);
  REQUIRE(fast.status == 0);
  CHECK(last_line(fast.output)["test_accuracy"].get<double>() > 0.8);
  // Too few micro-batches for the ranks: a usage error on every rank, exit code 2.
  CHECK(on(3, "--micro-batches 2").status != 0);
}

int main(int argc, char** argv) {
  if (argc > 1 && argv[1][0] != '-') g_binary = argv[1];
  doctest::Context context(argc - (g_binary.empty() ? 0 : 1), argv + (g_binary.empty() ? 0 : 1));
  return context.run();
}
