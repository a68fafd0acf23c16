#include <linum/train/io/checkpoint_manager.hpp>
#include <linum/train/io/serialization.hpp>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <system_error>

namespace linum {

namespace fs = std::filesystem;

namespace {

bool parse_step(const std::string& name, std::int64_t& step) {
  if (name.empty() || name.size() > 18) return false;
  for (char c : name)
    if (c < '0' || c > '9') return false;
  step = std::stoll(name);
  return true;
}

void fsync_path(const fs::path& p, bool directory) {
  const int fd = ::open(p.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

}  // namespace

CheckpointManager::CheckpointManager(fs::path root, CheckpointManagerOptions options)
    : root_(std::move(root)), options_(std::move(options)) {
  if (options_.max_to_keep < 0)
    throw ValueError(detail::cat("CheckpointManager: max_to_keep must be >= 0 (0 keeps all), got ", options_.max_to_keep));
  if (options_.save_interval_steps < 1)
    throw ValueError(detail::cat("CheckpointManager: save_interval_steps must be >= 1, got ", options_.save_interval_steps));
  std::error_code ec;
  fs::create_directories(root_, ec);
  if (!fs::is_directory(root_))
    throw IoError(detail::cat("CheckpointManager: '", root_.string(), "' is not a directory I can create or use",
                              ec ? ": " + ec.message() : std::string()));
  // Temporaries of writers that were killed mid-step.
  for (const auto& entry : fs::directory_iterator(root_, ec))
    if (entry.path().filename().string().rfind(".tmp-", 0) == 0) fs::remove_all(entry.path(), ec);
}

fs::path CheckpointManager::step_dir(std::int64_t step) const { return root_ / std::to_string(step); }

bool CheckpointManager::should_save(std::int64_t step) const {
  return step >= 0 && step % options_.save_interval_steps == 0 && !fs::exists(step_dir(step));
}

bool CheckpointManager::save(std::int64_t step, const Tree& state, const std::map<std::string, double>& metrics) {
  if (step < 0) throw ValueError(detail::cat("CheckpointManager::save: the step must be >= 0, got ", step));
  if (fs::exists(step_dir(step)))
    throw ValueError(detail::cat("CheckpointManager::save: step ", step, " is already saved in '", root_.string(),
                                 "'; save each step once (or remove that directory first)"));
  if (!should_save(step)) return false;
  const fs::path tmp = root_ / (".tmp-" + std::to_string(step) + "-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec))
    throw IoError(detail::cat("CheckpointManager::save: cannot create '", tmp.string(), "': ", ec.message()));
  try {
    serialization::save_msgpack(tmp / "state.msgpack", state);
    nlohmann::json m = nlohmann::json::object();
    for (const auto& [name, value] : metrics) {
      if (!std::isfinite(value))
        throw ValueError(detail::cat("CheckpointManager::save: metric '", name, "' is ", value, "; metrics must be finite"));
      m[name] = value;
    }
    const std::string text = m.dump();
    serialization::write_file_atomic(tmp / "metrics.json",
                                     std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
    fsync_path(tmp, true);
    fs::rename(tmp, step_dir(step));  // atomic: the step appears whole
    fsync_path(root_, true);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  cleanup();
  return true;
}

std::vector<std::int64_t> CheckpointManager::all_steps() const {
  std::vector<std::int64_t> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root_, ec)) {
    std::int64_t step = 0;
    if (entry.is_directory() && parse_step(entry.path().filename().string(), step) &&
        fs::exists(entry.path() / "state.msgpack"))
      steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::optional<std::int64_t> CheckpointManager::latest_step() const {
  const auto steps = all_steps();
  if (steps.empty()) return std::nullopt;
  return steps.back();
}

std::map<std::string, double> CheckpointManager::metrics(std::int64_t step) const {
  const fs::path file = step_dir(step) / "metrics.json";
  if (!fs::exists(file)) return {};
  const auto bytes = serialization::read_file(file);
  std::map<std::string, double> out;
  try {
    const auto j = nlohmann::json::parse(bytes.begin(), bytes.end());
    for (const auto& [name, value] : j.items()) out[name] = value.get<double>();
  } catch (const nlohmann::json::exception& e) {
    throw IoError(detail::cat("CheckpointManager: '", file.string(), "' is not a metrics file: ", e.what()));
  }
  return out;
}

std::optional<std::int64_t> CheckpointManager::best_step() const {
  if (options_.best_metric.empty()) return std::nullopt;
  std::optional<std::int64_t> best;
  double best_value = 0;
  for (std::int64_t step : all_steps()) {
    const auto m = metrics(step);
    const auto it = m.find(options_.best_metric);
    if (it == m.end()) continue;
    const bool better = options_.best_mode == BestMode::max ? it->second > best_value : it->second < best_value;
    if (!best || better) {
      best = step;
      best_value = it->second;
    }
  }
  return best;
}

void CheckpointManager::cleanup() const {
  if (options_.max_to_keep == 0) return;
  std::vector<std::int64_t> steps = all_steps();
  if (static_cast<int>(steps.size()) <= options_.max_to_keep) return;
  std::vector<std::int64_t> keep;
  if (options_.best_metric.empty()) {
    keep.assign(steps.end() - options_.max_to_keep, steps.end());
  } else {
    // Rank by the metric (steps without it last, newer first among equals), keep the best N and
    // the newest step.
    std::vector<std::pair<std::int64_t, std::optional<double>>> ranked;
    for (std::int64_t s : steps) {
      const auto m = metrics(s);
      const auto it = m.find(options_.best_metric);
      ranked.emplace_back(s, it == m.end() ? std::nullopt : std::optional<double>(it->second));
    }
    std::stable_sort(ranked.begin(), ranked.end(), [&](const auto& a, const auto& b) {
      if (a.second.has_value() != b.second.has_value()) return a.second.has_value();
      if (!a.second) return a.first > b.first;
      if (*a.second != *b.second)
        return options_.best_mode == BestMode::max ? *a.second > *b.second : *a.second < *b.second;
      return a.first > b.first;
    });
    for (int i = 0; i < options_.max_to_keep; ++i) keep.push_back(ranked[static_cast<std::size_t>(i)].first);
    keep.push_back(steps.back());
  }
  std::error_code ec;
  for (std::int64_t s : steps)
    if (std::find(keep.begin(), keep.end(), s) == keep.end()) fs::remove_all(step_dir(s), ec);
}

Tree CheckpointManager::restore(std::int64_t step) const {
  const fs::path file = step_dir(step) / "state.msgpack";
  if (!fs::exists(file)) {
    const auto steps = all_steps();
    std::string available;
    for (std::int64_t s : steps) available += (available.empty() ? "" : ", ") + std::to_string(s);
    throw IoError(detail::cat("CheckpointManager::restore: no step ", step, " in '", root_.string(), "' (saved steps: ",
                              available.empty() ? "none" : available, ")"));
  }
  return serialization::load_msgpack(file);
}

Tree CheckpointManager::restore(std::int64_t step, const Tree& target) const {
  Tree restored = restore(step);
  if (auto diff = structure_difference(target, restored))
    throw ValueError(detail::cat("CheckpointManager::restore: step ", step, " of '", root_.string(),
                                 "' does not fit the target: ", *diff,
                                 " (target first); restore into the model and optimizer that saved it"));
  return restored;
}

}  // namespace linum
