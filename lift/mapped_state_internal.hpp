// What lift::scan and lift::vmap share in building their bodies' state (scan.cpp, vmap.cpp): the
// subtree of a collection under the transform's path, and the streams a body gets (split into one
// key per slice or member, passed unchanged, or left out, per split_rngs).
#pragma once

#include <linum/lift/pack.hpp>
#include <linum/rng/key.hpp>

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace linum::lift::detail {

// The subtree of `collection` at `prefix` (a joined module path), if any.
inline const Tree* at_prefix(const Tree& collection, const std::string& prefix) {
  if (prefix.empty()) return &collection;
  return collection.contains_path(prefix) ? &collection.at_path(prefix) : nullptr;
}

inline void put_at_prefix(Tree& collection, const std::string& prefix, Tree value) {
  if (prefix.empty()) collection = std::move(value);
  else collection.set_path(prefix, std::move(value));
}

// The streams of a mapped body: split_rngs empty splits every stream; otherwise a listed stream is
// split (true) or passed unchanged (false), and an unlisted one does not reach the body.
struct BodyStreams {
  std::vector<std::pair<std::string, std::vector<rng::Key>>> split;  // one key per slice or member
  std::vector<std::pair<std::string, rng::Key>> broadcast;
};

inline BodyStreams body_streams(const Pack& pack, const std::map<std::string, bool>& split_rngs, std::int64_t n) {
  BodyStreams out;
  for (const std::string& stream : pack.streams().names()) {
    bool split = split_rngs.empty();
    if (!split_rngs.empty()) {
      auto it = split_rngs.find(stream);
      if (it == split_rngs.end()) continue;  // not lifted into the body
      split = it->second;
    }
    if (split) out.split.emplace_back(stream, rng::split(pack.streams().at(stream), n));
    else out.broadcast.emplace_back(stream, pack.streams().at(stream));
  }
  return out;
}

// The state a body runs on: `variables` and `streams` with the pack's mutability; when split_rngs
// lists streams, only those reach the body (`note` names the transform in errors about others).
inline linum::detail::ScopeState body_state(const Pack& pack, Tree variables, rng::Streams streams,
                                            const linum::detail::RngCounters& counters,
                                            const std::map<std::string, bool>& split_rngs, const BodyStreams& listed,
                                            std::string note) {
  if (split_rngs.empty()) return pack.state_on(std::move(variables), std::move(streams), counters);
  std::set<std::string, std::less<>> visible;
  for (const auto& [stream, _] : listed.split) visible.insert(stream);
  for (const auto& [stream, _] : listed.broadcast) visible.insert(stream);
  return pack.state_on(std::move(variables), std::move(streams), counters, std::move(visible), std::move(note));
}

}  // namespace linum::lift::detail
