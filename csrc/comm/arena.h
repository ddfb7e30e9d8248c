// The shared-memory arena of the intra-machine reduction (tagps/comm/local_reduce.py): one file per tensor
// name, usually in /dev/shm, holding a row per participant (its slot) and a result row, all of `count`
// elements. Every participant maps the same file; each sums one shard of it with the kernels.
#pragma once

#include <cstddef>
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
  // Opens `path` (creating it, mode 0600, if absent), reserves its full size on the filesystem
  // (posix_fallocate, so that a later write can never SIGBUS on a full tmpfs) and maps it. Throws
  // ArenaFull, after removing the file, when the filesystem has no room, naming the bytes needed and free.
  explicit Arena(ArenaOptions options);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  const ArenaOptions& options() const { return o_; }
  size_t row_bytes() const { return o_.count * dtype_size(o_.dtype); }
  size_t bytes() const { return bytes_; }
  void* data() const { return base_; }
  // Row i: a participant's slot for i < slots, the result row for i == slots.
  char* row(size_t i) const;

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
  ArenaOptions o_;
  size_t bytes_ = 0;
  void* base_ = nullptr;
};

}  // namespace tagps::comm
