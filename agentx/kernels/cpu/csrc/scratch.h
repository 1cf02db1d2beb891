// A thread-local scratch arena for the kernels' temporary buffers (quantized activations,
// a layer's intermediate rows): memory is taken per call and given back when the call's
// ScratchFrame ends, but stays with the thread, so a steady stream of calls of the same
// shapes allocates nothing after the first.
//
//   ScratchFrame frame;                   // marks this thread's arena
//   float* h = frame.take<float>(rows * hidden);
//   int8_t* xq = frame.take<int8_t>(rows * k);
//   ...                                   // ~ScratchFrame: all of it is free again
//
// Frames nest (a fused layer's frame around each linear layer's): a nested frame takes after
// its parent's buffers and never moves them, since the arena grows by adding a block, not by
// reallocating. When the outermost frame ends with more than one block, they are merged into
// one of the total size, so the next call of the same shape fits in one block again.
//
// Buffers are 64-byte aligned and uninitialized. The arena keeps the largest call's bytes
// until its thread ends. Header only: every kernel file may use it; they all share the one
// arena per thread (an inline function's thread_local is one object per thread).
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

namespace agentx {

class ScratchArena {
 public:
  static constexpr size_t kAlign = 64;

  // Where the arena stands; a frame returns it there when it ends.
  struct Mark {
    size_t block;
    size_t used;
  };

  Mark mark() const { return {current_, blocks_.empty() ? 0 : blocks_[current_].used}; }

  void enter() { ++depth_; }

  // Everything taken since `m` is free again; outside every frame, the blocks become one.
  void leave(Mark m) {
    if (!blocks_.empty()) {
      current_ = m.block;
      blocks_[current_].used = m.used;
    }
    if (--depth_ == 0 && blocks_.size() > 1) merge();
  }

  // `bytes` from the current block, else from the next one (blocks past the current one hold
  // nothing: frames end in the reverse order they began), else from a new block.
  void* take(size_t bytes) {
    bytes = (bytes + kAlign - 1) / kAlign * kAlign;
    while (!blocks_.empty() && !fits(blocks_[current_], bytes) && current_ + 1 < blocks_.size()) {
      blocks_[++current_].used = 0;
    }
    if (blocks_.empty() || !fits(blocks_[current_], bytes)) add_block(bytes);
    Block& block = blocks_[current_];
    void* p = block.data.get() + block.used;
    block.used += bytes;
    return p;
  }

  // Bytes held, and blocks allocated since the thread began (tests: steady calls add none).
  int64_t bytes() const {
    size_t total = 0;
    for (const Block& b : blocks_) total += b.size;
    return static_cast<int64_t>(total);
  }
  int64_t allocations() const { return allocations_; }

 private:
  struct Free {
    void operator()(char* p) const { ::operator delete[](p, std::align_val_t(kAlign)); }
  };
  struct Block {
    std::unique_ptr<char[], Free> data;
    size_t size;
    size_t used;
  };

  static bool fits(const Block& b, size_t bytes) { return b.used + bytes <= b.size; }

  void add_block(size_t bytes) {
    char* p = static_cast<char*>(::operator new[](bytes, std::align_val_t(kAlign)));
    blocks_.push_back(Block{std::unique_ptr<char[], Free>(p), bytes, 0});
    current_ = blocks_.size() - 1;
    ++allocations_;
  }

  void merge() {
    const size_t total = static_cast<size_t>(bytes());
    blocks_.clear();
    add_block(total);
  }

  std::vector<Block> blocks_;
  size_t current_ = 0;
  int depth_ = 0;
  int64_t allocations_ = 0;
};

inline ScratchArena& thread_scratch() {
  thread_local ScratchArena arena;
  return arena;
}

// One call's scratch: what take() hands out stays valid until the frame ends.
class ScratchFrame {
 public:
  ScratchFrame() : arena_(thread_scratch()), mark_(arena_.mark()) { arena_.enter(); }
  ~ScratchFrame() { arena_.leave(mark_); }
  ScratchFrame(const ScratchFrame&) = delete;
  ScratchFrame& operator=(const ScratchFrame&) = delete;

  // n uninitialized elements of T, 64-byte aligned
  template <typename T>
  T* take(int64_t n) {
    TORCH_CHECK(n >= 0, "scratch: negative size ", n);
    return static_cast<T*>(arena_.take(static_cast<size_t>(n) * sizeof(T)));
  }

 private:
  ScratchArena& arena_;
  ScratchArena::Mark mark_;
};

}  // namespace agentx
