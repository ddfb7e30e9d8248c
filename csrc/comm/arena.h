// The shared-memory arena of the intra-machine reduction (tagps/comm/local_reduce.py): one file per tensor
// name, usually in /dev/shm, holding a control block, a row per participant (its slot) and a result row,
// all of `count` elements. Every participant maps the same file; each sums one shard of it with the kernels.
//
// The control block carries the rounds of a tensor the root sums alone, without a message per participant:
// each participant marks its slot ready for round `seq` after writing it (with the dtype and count it
// mapped, which the root compares), the root publishes `seq` when the result row holds that round's sum,
// and participants wait for it on a futex. Rounds count from 1; 0 means never.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/error.h"

namespace tagps::comm {

// The arena's filesystem has no room for it (a full /dev/shm): Python tagps._core.ArenaFull (an OSError).
class ArenaFull : public Error {
 public:
  using Error::Error;
};

struct ArenaOptions {
  std::string path;
  DType dtype = DType::kFloat32;
  size_t slots = 0;  // participants; row `slots` is the result
  size_t count = 0;  // elements per row
};

// One participant's view of an arena file; the mapping lives as long as the object.
class Arena {
 public:
  // What all_ready() finds.
  enum class Ready { kNotYet = 0, kAll = 1, kShapesDiffer = 2 };
  // What wait_done() returns.
  enum class Done { kDone = 0, kFailed = 1, kTimedOut = 2 };

  // Opens `path` (creating it, mode 0600, if absent), reserves its full size on the filesystem
  // (posix_fallocate, so that a later write can never SIGBUS on a full tmpfs) and maps it. Throws
  // ArenaFull, after removing the file, when the filesystem has no room, naming the bytes needed and free.
  explicit Arena(ArenaOptions options);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  const ArenaOptions& options() const { return o_; }
  size_t row_bytes() const { return o_.count * dtype_size(o_.dtype); }
  // Bytes of the control block before the rows (a multiple of 64).
  size_t header_bytes() const { return header_bytes_; }
  size_t bytes() const { return bytes_; }
  void* data() const { return base_; }
  // Row i: a participant's slot for i < slots, the result row for i == slots.
  char* row(size_t i) const;

  // Marks slot `slot` written for round `seq` (a release store: the slot's bytes are visible first).
  void mark_ready(size_t slot, uint32_t seq);
  // Whether every slot is marked ready for round `seq`, and if so whether all mapped this dtype and count.
  Ready all_ready(uint32_t seq) const;
  // The result row holds round `seq`'s sum: tells and wakes the waiters.
  void publish(uint32_t seq);
  // The reduction failed for good: every wait_done(), now and later, returns kFailed.
  void fail();
  // Whether round `seq` was published.
  bool done(uint32_t seq) const;
  // Blocks until round `seq` is published (kDone), the arena failed (kFailed) or `timeout_s` passed.
  Done wait_done(uint32_t seq, double timeout_s) const;

  // Copies `nbytes` (== row_bytes()) from `src` into slot `slot`.
  void copy_in(size_t slot, const void* src, size_t nbytes);
  // Copies the result row into `dst` (`nbytes` == row_bytes()).
  void copy_out(void* dst, size_t nbytes) const;

  // One participant's shard [begin, end) of the reduction: first, for each group after the first, its
  // members groups[g][1..] into its leader's slot groups[g][0] (kernels::sum_into, in that order); then
  // the result row = the first group's members (summed out of place, slot 0 left as it was), then + the
  // leaders of groups[1..]. Every element is rounded as that chain of sum_into calls rounds it
  // (float16/bfloat16 once per call). Groups hold slot indices and must not be empty.
  void reduce_shard(const std::vector<std::vector<size_t>>& groups, size_t begin, size_t end);

 private:
  struct SlotState;
  struct Control;
  Control* control() const;
  SlotState* slot_state(size_t slot) const;

  ArenaOptions o_;
  size_t header_bytes_ = 0;
  size_t bytes_ = 0;
  void* base_ = nullptr;
};

}  // namespace tagps::comm
