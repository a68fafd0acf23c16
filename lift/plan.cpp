#include <linum/lift/plan.hpp>
#include <linum/lift/remat_rule.hpp>

#include <linum/core/memory.hpp>
#include <linum/core/memory_timeline.hpp>
#include <linum/core/files.hpp>
#include <linum/lift/remat.hpp>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <type_traits>
#include <sstream>
#include <nlohmann/json.hpp>

namespace linum::lift {

namespace {

// The policy for a call at `path` (nullopt: the call runs plainly).
using Rule = std::function<std::optional<Policy>(const std::vector<std::string>& path)>;

// How a plan, its printout and the profiling labels name a policy ("none": plain).
std::string policy_name(const std::optional<Policy>& p) { return p ? p->description() : std::string("none"); }

std::string prefix_at(const std::string& path, int depth) {
  if (path.empty() || depth <= 0) return {};
  std::size_t at = 0;
  for (int d = 0; d < depth; ++d) {
    const std::size_t slash = path.find('/', at);
    if (d + 1 == depth) return slash == std::string::npos ? path : path.substr(0, slash);
    if (slash == std::string::npos) return {};
    at = slash + 1;
  }
  return {};
}

}  // namespace

namespace {

// A plan's rule as the remat rule RematScope uses too (remat_rule.hpp): a call runs checkpointed
// under the policy the plan gives its path; none or no entry: plainly.
detail::RematRule remat_rule(Rule rule) {
  return [rule = std::move(rule)](const std::vector<std::string>& path) -> std::optional<detail::RematDecision> {
    std::optional<Policy> p = rule(path);
    if (!p) return std::nullopt;
    return detail::RematDecision{.policy = std::move(*p), .keep_plain = {}};
  };
}

Rule plan_rule(const RematPlan& plan) {
  auto policies = std::make_shared<std::map<std::string, std::optional<Policy>>>();
  for (const auto& c : plan.calls) (*policies)[c.path] = c.policy;
  return [policies](const std::vector<std::string>& path) -> std::optional<Policy> {
    auto it = policies->find(linum::detail::join_module_path(path));
    if (it == policies->end()) return std::nullopt;
    return it->second;
  };
}

Rule uniform_rule(int depth, std::optional<Policy> p) {
  return [depth, p](const std::vector<std::string>& path) -> std::optional<Policy> {
    if (static_cast<int>(path.size()) != depth) return std::nullopt;
    return p;
  };
}

// Calls at `outer` depth under p, and the calls inside them at `inner` depth under q (nested remat).
Rule nested_rule(int outer, std::optional<Policy> p, int inner, std::optional<Policy> q) {
  return [outer, p, inner, q](const std::vector<std::string>& path) -> std::optional<Policy> {
    if (static_cast<int>(path.size()) == outer) return p;
    if (static_cast<int>(path.size()) == inner) return q;
    return std::nullopt;
  };
}

// ---- profiling: what one recorded run says about each segment of the step ----------------------
//
// The candidate calls form a tree: calls at depth depths[0], inside them calls at depth depths[1],
// and so on. A run with every call of level l under one policy is cut into segments: the level-l
// calls ("units") and the ops between them ("gaps", keyed by the enclosing call of the level above,
// or the top, and by how many of its candidate children ran before). Per segment: kept (live bytes
// it leaves until its backward), own (its highest live bytes minus what earlier segments keep:
// forward, recomputation and the backward of its ops) and its recomputation time.

constexpr std::int64_t kNoPoint = std::numeric_limits<std::int64_t>::min();

struct SegmentStats {
  std::int64_t kept = 0;
  std::int64_t own = kNoPoint;
  double recompute = 0;
};

std::string unit_key(const std::string& path) { return "U:" + path; }
std::string gap_key(const std::string& parent, std::size_t index) {
  return "G:" + parent + "#" + std::to_string(index);
}

struct LevelRun {
  std::map<std::string, SegmentStats> segments;
  double step_seconds = 0;  // the whole recorded step (the fastest of the profiled ones)
  double transfer_seconds = 0;  // of which spent writing, reading and (de)compressing (its fastest)
  std::vector<std::string> units;  // level-l calls in forward order
  std::map<std::string, std::vector<std::string>> children;  // parent ("" = top) -> its level-l calls in order
};

LevelRun analyse(const memory::Timeline& t, const std::vector<int>& depths, std::size_t level) {
  LevelRun r;
  r.step_seconds = t.points.empty() ? 0.0 : t.points.back().seconds;
  const auto& pts = t.points;
  std::vector<std::string> seg(pts.size());
  std::map<std::string, std::set<std::string>> started;  // parent -> children (next level) started so far
  std::vector<std::string> order;                       // segments in order of their first forward point
  std::set<std::string> seen;
  auto parent_of = [&](const std::string& path, std::size_t l) { return l == 0 ? std::string() : prefix_at(path, depths[l - 1]); };
  std::string last_backward;
  for (std::size_t i = 0; i < pts.size(); ++i) {
    const auto& p = pts[i];
    if (p.phase == "backward") {
      if (p.forward_point >= 0 && static_cast<std::size_t>(p.forward_point) < i) seg[i] = seg[static_cast<std::size_t>(p.forward_point)];
      else seg[i] = last_backward.empty() ? (order.empty() ? gap_key("", 0) : order.back()) : last_backward;
      last_backward = seg[i];
      continue;
    }
    // Children started so far, at every level down to this one.
    for (std::size_t l = 0; l <= level; ++l) {
      const std::string child = prefix_at(p.path, depths[l]);
      if (child.empty()) break;
      started[parent_of(p.path, l)].insert(child);
    }
    const std::string unit = prefix_at(p.path, depths[level]);
    if (!unit.empty()) {
      seg[i] = unit_key(unit);
    } else {
      std::size_t l = 0;  // the deepest level whose call encloses this point: the gap's parent is there
      while (l < level && !prefix_at(p.path, depths[l]).empty()) ++l;
      const std::string parent = l == 0 ? std::string() : prefix_at(p.path, depths[l - 1]);
      seg[i] = gap_key(parent, started[parent].size());
    }
    if (p.phase == "forward" && seen.insert(seg[i]).second) {
      order.push_back(seg[i]);
      if (!unit.empty()) {
        r.units.push_back(unit);
        r.children[parent_of(p.path, level)].push_back(unit);
      }
    }
  }
  // kept: live bytes after a segment's last forward point minus before its first.
  std::map<std::string, std::pair<std::size_t, std::size_t>> span;
  for (std::size_t i = 0; i < pts.size(); ++i)
    if (pts[i].phase == "forward" && seen.count(seg[i])) {
      auto [it, fresh] = span.emplace(seg[i], std::make_pair(i, i));
      if (!fresh) it->second.second = i;
    }
  std::map<std::string, std::int64_t> before;
  std::int64_t prefix = 0;
  for (const auto& key : order) {
    const auto [first, last] = span.at(key);
    SegmentStats& s = r.segments[key];
    s.kept = pts[last].live_bytes - (first > 0 ? pts[first - 1].live_bytes : 0);
    before[key] = prefix;
    prefix += s.kept;
  }
  for (std::size_t i = 0; i < pts.size(); ++i) {
    auto it = before.find(seg[i]);
    if (it == before.end()) continue;  // a recomputation outside any forward segment (not expected)
    SegmentStats& s = r.segments[seg[i]];
    s.own = std::max(s.own, pts[i].peak_bytes - it->second);
    if (pts[i].phase == "recomputation" && i > 0) s.recompute += pts[i].seconds - pts[i - 1].seconds;
  }
  return r;
}

struct Profile {
  std::vector<int> depths;
  std::vector<std::optional<Policy>> policies;     // policies[0] is none (plain)
  std::vector<std::vector<LevelRun>> runs;        // [level][policy]
  // [level][(outer policy, inner policy)]: calls of the level rematted with every call inside them
  // (next level) rematted too: one of a call's options besides whole or planned inside.
  std::vector<std::vector<std::pair<std::pair<std::size_t, std::size_t>, LevelRun>>> nested;  // policy indices
  storage::TransferStats transfers;  // every transfer beyond RAM the profiling runs made
};

// ---- the solver --------------------------------------------------------------------------------

// Which calls a partial solution remats: a join tree, flattened once at the end.
struct Choice {
  std::shared_ptr<const Choice> left, right;
  std::string path;
  std::size_t policy = 0;  // index into Profile::policies
};
using ChoicePtr = std::shared_ptr<const Choice>;
ChoicePtr join(ChoicePtr a, ChoicePtr b) {
  if (!a) return b;
  if (!b) return a;
  auto c = std::make_shared<Choice>();
  c->left = std::move(a);
  c->right = std::move(b);
  return c;
}
void flatten(const ChoicePtr& c, std::map<std::string, std::size_t>& out) {
  if (!c) return;
  if (!c->path.empty()) out[c->path] = c->policy;
  flatten(c->left, out);
  flatten(c->right, out);
}

// A way to run a segment sequence: bytes it keeps, recomputation time, and its highest live bytes
// relative to what was kept before it began.
struct Option {
  std::int64_t kept = 0;
  double time = 0;
  std::int64_t need = kNoPoint;
  ChoicePtr choice;
  std::string peak_in;  // the call (or the ops between calls) where `need` is reached
};

// Keeps the options no other option beats in kept, time and need together.
std::vector<Option> pareto(std::vector<Option> v, std::size_t cap) {
  std::sort(v.begin(), v.end(), [](const Option& a, const Option& b) {
    if (a.kept != b.kept) return a.kept < b.kept;
    if (a.time != b.time) return a.time < b.time;
    return a.need < b.need;
  });
  std::vector<Option> out;
  for (const Option& o : v) {
    bool dominated = false;
    for (const Option& k : out)
      if (k.time <= o.time && k.need <= o.need) {  // k.kept <= o.kept by the order
        dominated = true;
        break;
      }
    if (!dominated) out.push_back(o);
  }
  if (out.size() > cap) {
    // Too many (very large call trees, many policies): an approximation that keeps the fastest
    // options and those of least peak and of fewest bytes kept, a third each, so the plan of the
    // smallest peak (what an impossible budget reports) is never cut.
    std::vector<Option> kept;
    std::vector<char> taken(out.size(), 0);
    auto take_best = [&](auto better) {
      std::vector<std::size_t> order(out.size());
      for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return better(out[a], out[b]); });
      for (std::size_t i = 0, n = 0; i < order.size() && n < cap / 3; ++i)
        if (!taken[order[i]]) {
          taken[order[i]] = 1;
          kept.push_back(out[order[i]]);
          ++n;
        }
    };
    take_best([](const Option& a, const Option& b) { return a.time < b.time; });
    take_best([](const Option& a, const Option& b) { return a.need < b.need; });
    take_best([](const Option& a, const Option& b) { return a.kept < b.kept; });
    out = std::move(kept);
  }
  return out;
}

constexpr std::size_t kFrontCap = 4000;

// The options of the segment sequence inside `parent` at `level` (level 0: the whole step).
// `budget` prunes only at the top, where what came before is nothing.
std::vector<Option> sequence_options(const Profile& pr, const std::string& parent, std::size_t level,
                                     std::int64_t budget);

// Bytes a run keeps of a call fewer than the plain run (what it moved out of RAM as it is).
std::int64_t moved_bytes(const LevelRun& plain, const LevelRun& run, const std::string& unit) {
  auto p = plain.segments.find(unit_key(unit));
  auto q = run.segments.find(unit_key(unit));
  if (p == plain.segments.end() || q == run.segments.end()) return 0;
  return std::max<std::int64_t>(0, p->second.kept - q->second.kept);
}

// A placing run's added step time, charged to `unit` by its share of the bytes the run moved out
// of RAM: the step's time beyond the plain step's, and at least the time its transfers took (the
// windows closed, they are on the critical path; this keeps timing noise from making them free).
double placing_cost(const LevelRun& plain, const LevelRun& run, const std::string& unit) {
  const double extra = std::max({0.0, run.step_seconds - plain.step_seconds, run.transfer_seconds});
  std::int64_t all = 0;
  for (const std::string& u : plain.units) all += moved_bytes(plain, run, u);
  if (all <= 0) return 0.0;
  return extra * static_cast<double>(moved_bytes(plain, run, unit)) / static_cast<double>(all);
}

std::vector<Option> unit_options(const Profile& pr, const std::string& unit, std::size_t level) {
  std::vector<Option> out;
  for (std::size_t k = 0; k < pr.policies.size(); ++k) {
    const auto& segs = pr.runs[level][k].segments;
    auto it = segs.find(unit_key(unit));
    if (it == segs.end()) continue;
    auto c = std::make_shared<Choice>();
    c->path = unit;
    c->policy = k;
    // A remat policy costs its recomputation. One that offloads or compresses also costs what its
    // writes, reads and codecs add to the step, wherever that time lands (the I/O thread shares the
    // cores): the profiled step's time beyond the plain one's, shared among the calls by the bytes
    // each moved out of RAM as it is (measured, so the disk's bandwidth and the codecs' speed are in it).
    double time = k == 0 ? 0.0 : it->second.recompute;
    if (k != 0 && pr.policies[k]->places_beyond_ram()) time = std::max(time, placing_cost(pr.runs[level][0], pr.runs[level][k], unit));
    out.push_back({it->second.kept, time, it->second.own, k == 0 ? nullptr : ChoicePtr(c), unit});
  }
  if (level + 1 < pr.depths.size()) {
    const auto inner = sequence_options(pr, unit, level + 1, std::numeric_limits<std::int64_t>::max());
    out.insert(out.end(), inner.begin(), inner.end());
    // Nested: the call rematted, and every call inside it rematted too.
    const auto kids = pr.runs[level + 1][0].children.find(unit);
    if (kids != pr.runs[level + 1][0].children.end())
      for (const auto& [policies, run] : pr.nested[level]) {
        auto it = run.segments.find(unit_key(unit));
        if (it == run.segments.end()) continue;
        auto c = std::make_shared<Choice>();
        c->path = unit;
        c->policy = policies.first;
        ChoicePtr all = c;
        for (const auto& kid : kids->second) {
          auto k = std::make_shared<Choice>();
          k->path = kid;
          k->policy = policies.second;
          all = join(all, k);
        }
        double time = it->second.recompute;
        if (pr.policies[policies.first]->places_beyond_ram() || pr.policies[policies.second]->places_beyond_ram())
          time = std::max(time, placing_cost(pr.runs[level][0], run, unit));
        out.push_back({it->second.kept, time, it->second.own, all, unit});
      }
  }
  return pareto(std::move(out), kFrontCap);
}

std::vector<Option> sequence_options(const Profile& pr, const std::string& parent, std::size_t level,
                                     std::int64_t budget) {
  const LevelRun& plain = pr.runs[level][0];
  const auto kids = plain.children.find(parent);
  const std::vector<std::string> none;
  const std::vector<std::string>& children = kids == plain.children.end() ? none : kids->second;
  std::vector<Option> states{Option{}};
  auto add_gap = [&](std::size_t index) {
    auto it = plain.segments.find(gap_key(parent, index));
    if (it == plain.segments.end()) return;
    for (Option& s : states) {
      if (it->second.own != kNoPoint && it->second.own + s.kept > s.need) {
        s.need = it->second.own + s.kept;
        s.peak_in = parent.empty() ? std::string("the ops between the top-level calls") : "the ops of " + parent + " between its calls";
      }
      s.kept += it->second.kept;
    }
    std::erase_if(states, [&](const Option& s) { return s.need > budget; });
  };
  add_gap(0);
  for (std::size_t i = 0; i < children.size(); ++i) {
    const auto opts = unit_options(pr, children[i], level);
    std::vector<Option> next;
    for (const Option& s : states)
      for (const Option& o : opts) {
        const std::int64_t inside = o.need == kNoPoint ? kNoPoint : o.need + s.kept;
        Option n{s.kept + o.kept, s.time + o.time, std::max(s.need, inside), join(s.choice, o.choice),
                 inside > s.need ? o.peak_in : s.peak_in};
        if (n.need <= budget) next.push_back(std::move(n));
      }
    states = pareto(std::move(next), kFrontCap);
    add_gap(i + 1);
    if (states.empty()) return {};
  }
  return states;
}

// Records one step under `rule`; adds the transfers beyond RAM it made to `total` (the spill
// file's windows closed: all of them on the step's critical path) and says how long they took.
memory::Timeline record(const std::function<void()>& step, const Rule& rule, const std::string& label,
                        storage::TransferStats& total, double* transfer_seconds = nullptr) {
  detail::RematRuleScope scope(remat_rule(rule));
  const storage::TransferStats before = storage::transfer_stats();
  memory::TimelineRecorder recorder(label);
  step();
  memory::Timeline t = recorder.finish();
  const storage::TransferStats moved = storage::transfer_stats() - before;
  if (transfer_seconds != nullptr) *transfer_seconds = moved.seconds();
  total.written_bytes += moved.written_bytes;
  total.write_seconds += moved.write_seconds;
  total.read_bytes += moved.read_bytes;
  total.read_seconds += moved.read_seconds;
  total.encoded_bytes += moved.encoded_bytes;
  total.encode_seconds += moved.encode_seconds;
  total.decoded_bytes += moved.decoded_bytes;
  total.decode_seconds += moved.decode_seconds;
  return t;
}

Profile profile(const std::function<void()>& step, const PlanOptions& o) {
  Profile pr;
  pr.depths = o.depths;
  std::sort(pr.depths.begin(), pr.depths.end());
  pr.depths.erase(std::unique(pr.depths.begin(), pr.depths.end()), pr.depths.end());
  pr.policies = {std::nullopt};
  for (const Policy& p : o.policies)
    if (std::none_of(pr.policies.begin() + 1, pr.policies.end(), [&](const auto& q) { return q->description() == p.description(); }))
      pr.policies.push_back(p);
  const memory::Timeline plain = record(step, [](const std::vector<std::string>&) { return std::nullopt; }, "none", pr.transfers);
  double plain_seconds = plain.points.empty() ? 0.0 : plain.points.back().seconds;
  for (int s = 1; s < o.profile_steps; ++s) {
    const memory::Timeline again = record(step, [](const std::vector<std::string>&) { return std::nullopt; }, "none", pr.transfers);
    if (!again.points.empty()) plain_seconds = std::min(plain_seconds, again.points.back().seconds);
  }
  for (std::size_t level = 0; level < pr.depths.size(); ++level) {
    std::vector<LevelRun> runs{analyse(plain, pr.depths, level)};
    runs[0].step_seconds = plain_seconds;
    for (std::size_t k = 1; k < pr.policies.size(); ++k) {
      LevelRun best;
      for (int s = 0; s < std::max(1, o.profile_steps); ++s) {
        double moved_s = 0;
        LevelRun r = analyse(record(step, uniform_rule(pr.depths[level], pr.policies[k]), policy_name(pr.policies[k]), pr.transfers, &moved_s),
                             pr.depths, level);
        r.transfer_seconds = moved_s;
        if (r.units != runs[0].units)
          throw ValueError(linum::detail::cat("lift::plan_remat: the step made different module calls at depth ",
                                              pr.depths[level], " under policy ", policy_name(pr.policies[k]),
                                              " than without remat; the step must make the same calls every time"));
        if (s == 0) best = std::move(r);
        else {
          best.step_seconds = std::min(best.step_seconds, r.step_seconds);
          best.transfer_seconds = std::min(best.transfer_seconds, r.transfer_seconds);
          for (auto& [key, stats] : best.segments)
            if (auto it = r.segments.find(key); it != r.segments.end()) stats.recompute = std::min(stats.recompute, it->second.recompute);
        }
      }
      runs.push_back(std::move(best));
    }
    pr.runs.push_back(std::move(runs));
  }
  for (std::size_t level = 0; level + 1 < pr.depths.size(); ++level) {
    pr.nested.emplace_back();
    for (std::size_t a = 1; a < pr.policies.size(); ++a)
      for (std::size_t b = 1; b < pr.policies.size(); ++b) {
        LevelRun best;
        for (int s = 0; s < std::max(1, o.profile_steps); ++s) {
          double moved_s = 0;
          LevelRun r = analyse(record(step, nested_rule(pr.depths[level], pr.policies[a], pr.depths[level + 1], pr.policies[b]),
                                     "nested", pr.transfers, &moved_s),
                               pr.depths, level);
          r.transfer_seconds = moved_s;
          if (s == 0) best = std::move(r);
          else {
            best.step_seconds = std::min(best.step_seconds, r.step_seconds);
            best.transfer_seconds = std::min(best.transfer_seconds, r.transfer_seconds);
            for (auto& [key, stats] : best.segments)
              if (auto it = r.segments.find(key); it != r.segments.end()) stats.recompute = std::min(stats.recompute, it->second.recompute);
          }
        }
        pr.nested.back().push_back({{a, b}, std::move(best)});
      }
  }
  return pr;
}

RematPlan make_plan(const Profile& pr, const Option& best, std::int64_t budget) {
  RematPlan plan;
  plan.budget_bytes = budget;
  plan.depths = pr.depths;
  plan.predicted_peak_bytes = best.need;
  plan.predicted_peak_in = best.peak_in;
  plan.predicted_extra_s = best.time;
  std::map<std::string, std::size_t> chosen;
  flatten(best.choice, chosen);
  // Every candidate call in forward order, with its policy, what it keeps and its predicted time.
  std::function<void(const std::string&, std::size_t)> walk = [&](const std::string& parent, std::size_t level) {
    const LevelRun& plain = pr.runs[level][0];
    auto kids = plain.children.find(parent);
    if (kids == plain.children.end()) return;
    for (const auto& unit : kids->second) {
      auto it = chosen.find(unit);
      const bool inside = std::any_of(chosen.begin(), chosen.end(), [&](const auto& c) { return c.first.starts_with(unit + "/"); });
      if (it != chosen.end()) {
        const std::size_t k = it->second;
        const SegmentStats& s = pr.runs[level][k].segments.at(unit_key(unit));
        plan.calls.push_back({unit, pr.policies[k], s.kept, s.recompute});
        if (inside && level + 1 < pr.depths.size()) walk(unit, level + 1);  // nested: its insides are rematted too
      } else if (level + 1 < pr.depths.size() && pr.runs[level + 1][0].children.count(unit) &&
                 std::any_of(chosen.begin(), chosen.end(), [&](const auto& c) { return c.first.starts_with(unit + "/"); })) {
        walk(unit, level + 1);  // planned inside
      } else {
        plan.calls.push_back({unit, std::nullopt, pr.runs[level][0].segments.at(unit_key(unit)).kept, 0.0});
      }
    }
  };
  walk("", 0);
  return plan;
}

// Processes planning together (PlanOptions::agree): every figure the solver reads becomes its maximum
// over them (an upper bound of each one's peak, so the plan fits all), and all solve the same.
template <class F>
void each_figure(Profile& pr, F&& f) {
  auto run = [&](LevelRun& r) {
    f(r.step_seconds);
    f(r.transfer_seconds);
    for (auto& [key, s] : r.segments) {
      f(s.kept);
      f(s.own);
      f(s.recompute);
    }
  };
  for (auto& level : pr.runs)
    for (LevelRun& r : level) run(r);
  for (auto& level : pr.nested)
    for (auto& entry : level) run(entry.second);
  storage::TransferStats& t = pr.transfers;
  for (std::int64_t* bytes : {&t.written_bytes, &t.read_bytes, &t.encoded_bytes, &t.decoded_bytes}) f(*bytes);
  for (double* seconds : {&t.write_seconds, &t.read_seconds, &t.encode_seconds, &t.decode_seconds}) f(*seconds);
}

void agree_on(Profile& pr, std::int64_t& plain_peak, const PlanOptions& o) {
  if (!o.agree) return;
  std::vector<double> figures{static_cast<double>(plain_peak)};
  each_figure(pr, [&](auto& x) { figures.push_back(static_cast<double>(x)); });
  std::string what;
  for (const auto& level : pr.runs)
    for (const auto& unit : level.front().units) what += unit + ";";
  o.agree(what, figures);
  std::size_t at = 0;
  plain_peak = static_cast<std::int64_t>(figures.at(at++));
  each_figure(pr, [&](auto& x) { x = static_cast<std::remove_reference_t<decltype(x)>>(figures.at(at++)); });
}

std::int64_t agreed(std::int64_t value, const char* what, const PlanOptions& o) {
  if (!o.agree) return value;
  std::vector<double> figure{static_cast<double>(value)};
  o.agree(what, figure);
  return static_cast<std::int64_t>(figure.at(0));
}

std::int64_t measured_peak(const std::function<void()>& step, const Rule& rule) {
  detail::RematRuleScope scope(remat_rule(rule));
  memory::PeakScope peak;
  step();
  return peak.peak_bytes();
}

}  // namespace

PlanScope::PlanScope(const RematPlan& plan)
    : scope_(std::make_unique<detail::RematRuleScope>(remat_rule(plan_rule(plan)))) {
  if (plan.spill_windows) windows_.emplace(*plan.spill_windows);
}
PlanScope::~PlanScope() = default;

RematPlan plan_remat(const std::function<void()>& step, std::int64_t budget_bytes, const PlanOptions& options) {
  if (budget_bytes <= 0) throw ValueError(linum::detail::cat("lift::plan_remat: budget_bytes must be positive, got ", budget_bytes));
  if (options.depths.empty()) throw ValueError("lift::plan_remat: options.depths is empty; give at least one depth (1: the top module's children)");
  for (int d : options.depths)
    if (d < 1) throw ValueError(linum::detail::cat("lift::plan_remat: depth ", d, " is not >= 1"));
  step();  // warm-up: caches, lazily created state
  for (const Policy& p : options.policies) (void)policies::from_description(p.description());  // a plan must be storable
  // Policies that offload: profile and verify with the spill file's windows closed, so the RAM a
  // step takes does not depend on the I/O thread's timing; the plan gets windows that fit after.
  const bool places = std::any_of(options.policies.begin(), options.policies.end(), [](const Policy& p) { return p.places_beyond_ram(); });
  storage::SpillWindows user_windows = places ? storage::spill_file().windows() : storage::SpillWindows{};
  if (places) {  // processes planning together: the smallest windows any of them has
    user_windows.read_ahead_bytes = -agreed(-user_windows.read_ahead_bytes, "read-ahead window", options);
    user_windows.write_behind_bytes = -agreed(-user_windows.write_behind_bytes, "write-behind window", options);
  }
  std::optional<storage::SpillWindowsScope> closed;
  if (places) closed.emplace(storage::SpillWindows{0, 0});
  std::int64_t plain_peak = measured_peak(step, [](const std::vector<std::string>&) { return std::nullopt; });
  Profile pr = profile(step, options);
  agree_on(pr, plain_peak, options);
  const storage::TransferStats& profiled = pr.transfers;
  if (pr.runs[0][0].units.empty())
    throw ValueError(linum::detail::cat("lift::plan_remat: the step made no module calls at depth ", pr.depths[0],
                                        "; nothing to remat (is the model a module whose children are modules?)"));
  std::int64_t target = budget_bytes;
  RematPlan best;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const auto options_found = sequence_options(pr, "", 0, target);
    if (options_found.empty()) {
      Option smallest;
      smallest.need = std::numeric_limits<std::int64_t>::max();
      for (const Option& o : sequence_options(pr, "", 0, std::numeric_limits<std::int64_t>::max()))
        if (o.need < smallest.need) smallest = o;
      throw ValueError(linum::detail::cat(
          "lift::plan_remat: no plan keeps the step's peak within ", budget_bytes, " bytes (",
          static_cast<double>(budget_bytes) / 1048576.0, " MiB); the smallest peak a plan reaches is ", smallest.need,
          " bytes (", static_cast<double>(smallest.need) / 1048576.0, " MiB, reached in ", smallest.peak_in, ") against ", plain_peak,
          " without remat. Raise the budget, give the planner finer calls there (options.depths, e.g. {1, 2}; "
          "module calls inside it) or more options (policies::offload, policies::residuals), or split the batch"));
    }
    const Option* pick = &options_found.front();
    for (const Option& o : options_found)
      if (o.time < pick->time || (o.time == pick->time && o.need < pick->need)) pick = &o;
    best = make_plan(pr, *pick, budget_bytes);
    best.plain_peak_bytes = plain_peak;
    best.transfer_rates = {profiled.write_bytes_per_s(), profiled.read_bytes_per_s(), profiled.encode_bytes_per_s(),
                           profiled.decode_bytes_per_s()};
    if (!options.verify) break;
    best.measured_peak_bytes = agreed(measured_peak(step, plan_rule(best)), "measured peak", options);
    if (best.measured_peak_bytes <= budget_bytes) break;
    target -= best.measured_peak_bytes - budget_bytes;  // the model missed this much: plan with less
  }
  const bool plan_places = std::any_of(best.calls.begin(), best.calls.end(), [](const PlannedCall& c) { return c.policy && c.policy->places_beyond_ram(); });
  if (plan_places) {
    // What the budget leaves above the peak, half to each window (each at most what it was).
    const std::int64_t peak = best.measured_peak_bytes > 0 ? best.measured_peak_bytes : best.predicted_peak_bytes;
    const std::int64_t slack = std::max<std::int64_t>(0, budget_bytes - peak);
    storage::SpillWindows w;
    w.read_ahead_bytes = std::min(user_windows.read_ahead_bytes, slack / 2);
    w.write_behind_bytes = std::min(user_windows.write_behind_bytes, slack - w.read_ahead_bytes);
    best.spill_windows = w;
  }
  return best;
}

// ---- the plan as text and JSON -------------------------------------------------------------------

std::string RematPlan::str() const {
  std::ostringstream os;
  auto mib = [](std::int64_t b) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / 1048576.0);
    return std::string(buf);
  };
  std::string ds;
  for (int d : depths) ds += (ds.empty() ? "" : ", ") + std::to_string(d);
  os << "remat plan (depths " << ds << "): budget " << mib(budget_bytes) << ", predicted peak "
     << mib(predicted_peak_bytes);
  if (!predicted_peak_in.empty()) os << " (in " << predicted_peak_in << ")";
  if (measured_peak_bytes > 0) os << ", measured " << mib(measured_peak_bytes);
  os << ", without remat " << mib(plain_peak_bytes) << ", predicted extra time " << predicted_extra_s * 1e3 << " ms";
  if (transfer_rates.spill_write > 0 || transfer_rates.encode > 0)
    os << "; measured: spill write " << transfer_rates.spill_write / 1e6 << " MB/s, read " << transfer_rates.spill_read / 1e6
       << " MB/s, compress " << transfer_rates.encode / 1e6 << " MB/s, decompress " << transfer_rates.decode / 1e6 << " MB/s";
  if (spill_windows)
    os << "; spill windows: write-behind " << mib(spill_windows->write_behind_bytes) << ", read-ahead " << mib(spill_windows->read_ahead_bytes);
  os << "\n";
  for (const auto& c : calls)
    os << "  " << c.path << ": " << policy_name(c.policy) << " (keeps " << mib(c.kept_bytes)
       << (c.policy ? ", recompute " + std::to_string(c.recompute_s * 1e3) + " ms" : "") << ")\n";
  return os.str();
}

nlohmann::json RematPlan::to_json() const {
  nlohmann::json cs = nlohmann::json::array();
  for (const auto& c : calls)
    cs.push_back({{"path", c.path}, {"policy", policy_name(c.policy)}, {"kept_bytes", c.kept_bytes},
                  {"recompute_s", c.recompute_s}});
  nlohmann::json j = {{"budget_bytes", budget_bytes},           {"predicted_peak_bytes", predicted_peak_bytes},
                      {"measured_peak_bytes", measured_peak_bytes}, {"plain_peak_bytes", plain_peak_bytes},
                      {"predicted_extra_s", predicted_extra_s}, {"depths", depths}, {"calls", cs},
                      {"predicted_peak_in", predicted_peak_in}};
  if (transfer_rates.spill_write > 0 || transfer_rates.encode > 0)
    j["transfer_bytes_per_s"] = {{"spill_write", transfer_rates.spill_write}, {"spill_read", transfer_rates.spill_read},
                                 {"encode", transfer_rates.encode}, {"decode", transfer_rates.decode}};
  if (spill_windows)
    j["spill_windows"] = {{"write_behind_bytes", spill_windows->write_behind_bytes}, {"read_ahead_bytes", spill_windows->read_ahead_bytes}};
  return j;
}

RematPlan RematPlan::from_json(const nlohmann::json& j) {
  try {
    RematPlan p;
    p.budget_bytes = j.at("budget_bytes").get<std::int64_t>();
    p.predicted_peak_bytes = j.at("predicted_peak_bytes").get<std::int64_t>();
    p.measured_peak_bytes = j.value("measured_peak_bytes", std::int64_t{0});
    p.plain_peak_bytes = j.value("plain_peak_bytes", std::int64_t{0});
    p.predicted_extra_s = j.value("predicted_extra_s", 0.0);
    p.predicted_peak_in = j.value("predicted_peak_in", std::string());
    p.depths = j.value("depths", std::vector<int>{1});
    // Plans written before policies were stored by description name them "full", "dots",
    // "dots_no_batch" or "names" (with the names in "saved_names").
    const auto saved_names = j.value("saved_names", std::vector<std::string>{});
    auto policy_of = [&](const std::string& name) -> std::optional<Policy> {
      if (name == "none") return std::nullopt;
      if (name == "full") return Policy(policies::nothing_saveable{});
      if (name == "dots") return Policy(policies::dots_saveable{});
      if (name == "dots_no_batch") return Policy(policies::dots_with_no_batch_dims_saveable{});
      if (name == "names") return policies::save_only_these_names(saved_names);
      return policies::from_description(name);
    };
    if (j.contains("transfer_bytes_per_s")) {
      const auto& t = j.at("transfer_bytes_per_s");
      p.transfer_rates = {t.value("spill_write", 0.0), t.value("spill_read", 0.0), t.value("encode", 0.0), t.value("decode", 0.0)};
    }
    if (j.contains("spill_windows") && !j.at("spill_windows").is_null())
      p.spill_windows = storage::SpillWindows{j.at("spill_windows").at("write_behind_bytes").get<std::int64_t>(),
                                              j.at("spill_windows").at("read_ahead_bytes").get<std::int64_t>()};
    for (const auto& c : j.at("calls"))
      p.calls.push_back({c.at("path").get<std::string>(), policy_of(c.at("policy").get<std::string>()),
                         c.value("kept_bytes", std::int64_t{0}), c.value("recompute_s", 0.0)});
    return p;
  } catch (const nlohmann::json::exception& e) {
    throw ValueError(linum::detail::cat("lift::RematPlan::from_json: not a plan (", e.what(),
                                        "); expected {\"budget_bytes\", \"predicted_peak_bytes\", \"calls\": [{\"path\", "
                                        "\"policy\"}, ...]}"));
  }
}

void RematPlan::save_json(const std::filesystem::path& path) const {
  const std::string text = to_json().dump(1) + "\n";
  files::write_file_atomic(path, std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
}

RematPlan RematPlan::load_json(const std::filesystem::path& path) {
  const auto bytes = files::read_file(path);
  const auto j = nlohmann::json::parse(bytes.begin(), bytes.end(), nullptr, false);
  if (j.is_discarded()) throw IoError(linum::detail::cat("lift::RematPlan::load_json: '", path.string(), "' is not JSON"));
  return from_json(j);
}

}  // namespace linum::lift
