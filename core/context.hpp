// Per-thread context: the one mechanism behind every "while this object is alive, on this thread"
// setting in Linum, as Flax's ThreadLocalStack and Python's contextvars: recording on or off,
// saved-value hooks, record hooks (checkpoint regions, residual traces), the threefry mode, the
// debug phase, the module path, module-call hooks.
//
//   struct Recording { using Value = bool; };            // a tag names one context
//   ContextStack<Recording>::Entry off(false);           // pushed for this block
//   const bool* on = ContextStack<Recording>::top();     // the innermost value, or null
//
// Entries form a stack per thread: top() is the innermost value, innermost()/below() walk from the
// inner to the outer entries (for hooks that all see an event). An entry may be destroyed out of
// order (an outer lift::RematScope before an inner one, as happens with unique_ptrs or scopes kept
// in objects): it then leaves the stack wherever it is and the others stay valid. Destroy an entry
// on the thread that created it.
#pragma once

#include <utility>

namespace linum::detail {

template <class Tag>
class ContextStack {
 public:
  using Value = typename Tag::Value;

  class Entry {
   public:
    explicit Entry(Value value) : value_(std::move(value)), below_(top_) { top_ = this; }
    ~Entry() {
      if (top_ == this) {
        top_ = below_;
        return;
      }
      for (Entry* e = top_; e != nullptr; e = e->below_)
        if (e->below_ == this) {
          e->below_ = below_;
          return;
        }
    }
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;

    const Value& value() const noexcept { return value_; }
    Entry* below() const noexcept { return below_; }

   private:
    Value value_;
    Entry* below_;
  };

  // The innermost entry's value, or null when no entry is alive on this thread.
  static const Value* top() noexcept { return top_ != nullptr ? &top_->value() : nullptr; }
  static Entry* innermost() noexcept { return top_; }

 private:
  static inline thread_local Entry* top_ = nullptr;
};

}  // namespace linum::detail
