// A 64-byte aligned, fixed-size byte buffer that the server engine shares by reference count between a
// key's state, snapshots and zero-copy reply messages.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace tagps::net {

class AlignedBuffer {
 public:
  static constexpr size_t kAlign = 64;

  // `size` bytes, zeroed when `zero`.
  explicit AlignedBuffer(size_t size, bool zero = true) : size_(size) {
    const size_t rounded = (size + kAlign - 1) / kAlign * kAlign;
    data_ = std::aligned_alloc(kAlign, rounded == 0 ? kAlign : rounded);
    if (data_ == nullptr) throw std::bad_alloc();
    if (zero) std::memset(data_, 0, size);
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  void* data() { return data_; }
  const void* data() const { return data_; }
  size_t size() const { return size_; }

  // A new buffer holding a copy of this one.
  std::shared_ptr<AlignedBuffer> clone() const {
    auto copy = std::make_shared<AlignedBuffer>(size_, false);
    std::memcpy(copy->data(), data_, size_);
    return copy;
  }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

using SharedBuffer = std::shared_ptr<AlignedBuffer>;

}  // namespace tagps::net
