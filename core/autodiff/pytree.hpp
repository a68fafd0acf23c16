// Pytrees: the arrays inside a value, in a fixed order, and the same value rebuilt around other
// arrays. Arrays, Trees, std::vector, std::pair and std::tuple of these nest, and so do user
// structs registered once (below); any other type (bool, int, options structs) is a leafless
// constant that passes through unchanged. Function transformations (grad, vjp, checkpoint,
// custom_vjp) use this to treat "whatever f takes or returns" uniformly.
//
// Registering a struct (JAX's register_pytree_node / a registered dataclass): list its members,
// arrays and nested pytrees, in a fixed order; other members are carried along unchanged.
//
//   struct State { Array w; Tree extra; int step; };
//   template <> struct linum::pytree::Fields<State> {
//     static auto of(State& s) { return std::tie(s.w, s.extra); }
//   };
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/tree.hpp>

#include <cstddef>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace linum::pytree {

// Specialize with `static auto of(T&)` returning std::tie of the members that hold arrays.
template <class T>
struct Fields;

template <class T>
concept RegisteredStruct = requires(T& t) { Fields<T>::of(t); };

template <class T>
void flatten_into(const T& value, std::vector<Array>& out);
template <class T>
T rebuild_from(const T& like, std::span<const Array> arrays, std::size_t& pos);

namespace detail {
template <class T>
struct Impl {
  static void flatten(const T&, std::vector<Array>&) {}
  static T rebuild(const T& like, std::span<const Array>, std::size_t&) { return like; }
};
template <>
struct Impl<Array> {
  static void flatten(const Array& a, std::vector<Array>& out) { out.push_back(a); }
  static Array rebuild(const Array&, std::span<const Array> arrays, std::size_t& pos) { return arrays[pos++]; }
};
template <>
struct Impl<Tree> {
  static void flatten(const Tree& t, std::vector<Array>& out) {
    for (const Array& a : leaves(t)) out.push_back(a);
  }
  static Tree rebuild(const Tree& like, std::span<const Array> arrays, std::size_t& pos) {
    const std::size_t n = leaf_count(like);
    Tree t = with_leaves(like, arrays.subspan(pos, n));
    pos += n;
    return t;
  }
};
template <class E>
struct Impl<std::vector<E>> {
  static void flatten(const std::vector<E>& v, std::vector<Array>& out) {
    for (const E& e : v) flatten_into(e, out);
  }
  static std::vector<E> rebuild(const std::vector<E>& like, std::span<const Array> arrays, std::size_t& pos) {
    std::vector<E> v;
    v.reserve(like.size());
    for (const E& e : like) v.push_back(rebuild_from(e, arrays, pos));
    return v;
  }
};
template <RegisteredStruct T>
struct Impl<T> {
  static void flatten(const T& value, std::vector<Array>& out) {
    T copy = value;  // Fields::of takes a mutable reference; copies of arrays share their buffers
    std::apply([&](auto&... member) { (flatten_into(member, out), ...); }, Fields<T>::of(copy));
  }
  static T rebuild(const T& like, std::span<const Array> arrays, std::size_t& pos) {
    T out = like;
    std::apply([&](auto&... member) { ((member = rebuild_from(member, arrays, pos)), ...); }, Fields<T>::of(out));
    return out;
  }
};
template <class A, class B>
struct Impl<std::pair<A, B>> {
  static void flatten(const std::pair<A, B>& p, std::vector<Array>& out) {
    flatten_into(p.first, out);
    flatten_into(p.second, out);
  }
  static std::pair<A, B> rebuild(const std::pair<A, B>& like, std::span<const Array> arrays, std::size_t& pos) {
    A a = rebuild_from(like.first, arrays, pos);
    B b = rebuild_from(like.second, arrays, pos);
    return {std::move(a), std::move(b)};
  }
};
template <class... Ts>
struct Impl<std::tuple<Ts...>> {
  static void flatten(const std::tuple<Ts...>& t, std::vector<Array>& out) {
    std::apply([&](const auto&... e) { (flatten_into(e, out), ...); }, t);
  }
  static std::tuple<Ts...> rebuild(const std::tuple<Ts...>& like, std::span<const Array> arrays, std::size_t& pos) {
    return std::apply([&](const auto&... e) { return std::tuple<Ts...>{rebuild_from(e, arrays, pos)...}; }, like);
  }
};
}  // namespace detail

// Whether T holds arrays as a pytree (Array, Tree, a registered struct, or a std container of
// pytrees); other types are constants to pytree functions and cannot be differentiated.
template <class T>
struct is_pytree : std::bool_constant<std::is_same_v<T, Array> || std::is_same_v<T, Tree> || RegisteredStruct<T>> {};
template <class E>
struct is_pytree<std::vector<E>> : is_pytree<E> {};
template <class A, class B>
struct is_pytree<std::pair<A, B>> : std::bool_constant<is_pytree<A>::value || is_pytree<B>::value> {};
template <class... Ts>
struct is_pytree<std::tuple<Ts...>> : std::bool_constant<(is_pytree<Ts>::value || ...)> {};
template <class T>
inline constexpr bool is_pytree_v = is_pytree<T>::value;

// Appends the arrays inside `value` to `out` (depth first, in order).
template <class T>
void flatten_into(const T& value, std::vector<Array>& out) {
  detail::Impl<T>::flatten(value, out);
}

// The arrays inside `value`.
template <class T>
std::vector<Array> flatten(const T& value) {
  std::vector<Array> out;
  flatten_into(value, out);
  return out;
}

// `like` with its arrays replaced, in flatten order, by arrays[pos...]; advances pos.
template <class T>
T rebuild_from(const T& like, std::span<const Array> arrays, std::size_t& pos) {
  return detail::Impl<T>::rebuild(like, arrays, pos);
}

// `like` with its arrays replaced by `arrays` (as many as flatten(like) returns).
template <class T>
T rebuild(const T& like, std::span<const Array> arrays) {
  std::size_t pos = 0;
  return rebuild_from(like, arrays, pos);
}

}  // namespace linum::pytree
