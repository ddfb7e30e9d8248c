#include "comm/arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "common/parallel.h"
#include "kernels/sum.h"

namespace tagps::comm {
namespace {

// Below this many bytes a copy runs on the calling thread (the OpenMP fork costs more).
constexpr size_t kMinParallelCopy = size_t{1} << 20;

std::string os_error(const char* what, const std::string& path, int err) {
  return detail::concat(what, " ", path, ": ", std::strerror(err));
}

// Free bytes for an unprivileged writer on the filesystem of `fd` (0 when statvfs fails).
unsigned long long free_bytes(int fd) {
  struct statvfs st {};
  if (fstatvfs(fd, &st) != 0) return 0;
  return static_cast<unsigned long long>(st.f_bavail) * st.f_frsize;
}

// RAII for the descriptor, which is only needed until the file is mapped.
struct Fd {
  int fd;
  ~Fd() { ::close(fd); }
};

void parallel_copy(void* dst, const void* src, size_t nbytes) {
  parallel_for(nbytes, kMinParallelCopy, [&](size_t begin, size_t end) {
    std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, end - begin);
  });
}

}  // namespace

Arena::Arena(ArenaOptions options) : o_(std::move(options)) {
  TAGPS_ENFORCE_GT(o_.slots, size_t{0}, "arena ", o_.path, ": slots");
  TAGPS_ENFORCE_GT(o_.count, size_t{0}, "arena ", o_.path, ": count");
  const size_t rows = o_.slots + 1;
  TAGPS_ENFORCE(o_.count <= std::numeric_limits<size_t>::max() / dtype_size(o_.dtype) / rows, "arena ",
                o_.path, ": ", rows, " rows of ", o_.count, " elements overflow the address space");
  bytes_ = rows * row_bytes();

  const int fd = ::open(o_.path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) throw Error(os_error("cannot open the shared-memory arena", o_.path, errno));
  Fd guard{fd};
  int err;
  do {
    err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes_));
  } while (err == EINTR);
  if (err == ENOSPC || err == EFBIG) {
    const unsigned long long available = free_bytes(fd);
    ::unlink(o_.path.c_str());
    throw ArenaFull(detail::concat(
        "no room for the shared-memory arena ", o_.path, ": it needs ", bytes_, " bytes (", rows,
        " rows of ", row_bytes(), ") but its filesystem has ", available, " bytes free (", std::strerror(err),
        "); free space there or enlarge it (for /dev/shm in docker: --shm-size)"));
  }
  if (err != 0) {
    ::unlink(o_.path.c_str());
    throw Error(os_error("cannot reserve space for the shared-memory arena", o_.path, err));
  }
  void* base = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) throw Error(os_error("cannot map the shared-memory arena", o_.path, errno));
  base_ = base;
}

Arena::~Arena() { ::munmap(base_, bytes_); }

char* Arena::row(size_t i) const {
  TAGPS_ENFORCE_LE(i, o_.slots, "arena ", o_.path, ": row");
  return static_cast<char*>(base_) + i * row_bytes();
}

void Arena::copy_in(size_t slot, const void* src, size_t nbytes) {
  TAGPS_ENFORCE(slot < o_.slots, "arena ", o_.path, ": slot ", slot, " of ", o_.slots);
  TAGPS_ENFORCE_EQ(nbytes, row_bytes(), "arena ", o_.path, ": bytes copied into a slot");
  parallel_copy(row(slot), src, nbytes);
}

void Arena::copy_out(void* dst, size_t nbytes) const {
  TAGPS_ENFORCE_EQ(nbytes, row_bytes(), "arena ", o_.path, ": bytes copied out of the result");
  parallel_copy(dst, row(o_.slots), nbytes);
}

void Arena::reduce_shard(const std::vector<std::vector<size_t>>& groups, size_t begin, size_t end) {
  TAGPS_ENFORCE(begin <= end && end <= o_.count, "arena ", o_.path, ": shard [", begin, ", ", end,
                ") outside its ", o_.count, " elements");
  for (const auto& group : groups) {
    TAGPS_ENFORCE(!group.empty(), "arena ", o_.path, ": an empty group");
    for (size_t member : group) {
      TAGPS_ENFORCE(member < o_.slots, "arena ", o_.path, ": group member ", member, " of ", o_.slots);
    }
  }
  if (begin == end) return;
  const size_t offset = begin * dtype_size(o_.dtype);
  const auto at = [&](size_t r) { return row(r) + offset; };
  kernels::SumOptions sum;
  sum.dtype = o_.dtype;
  sum.count = end - begin;
  const auto members = [&](const std::vector<size_t>& group) {
    sum.srcs.clear();
    for (size_t k = 1; k < group.size(); ++k) sum.srcs.push_back(at(group[k]));
  };
  for (size_t g = 1; g < groups.size(); ++g) {
    sum.dst = at(groups[g][0]);
    members(groups[g]);
    kernels::sum_into(sum);
  }
  // The result has its own row: the root refills slot 0 for its next round while others still copy out.
  // The first group sums straight into it (out of place: one row less than a sum into slot 0 and a copy).
  sum.dst = at(o_.slots);
  sum.first = at(groups[0][0]);
  members(groups[0]);
  kernels::sum_into(sum);
  sum.first = nullptr;
  sum.srcs.clear();
  for (size_t g = 1; g < groups.size(); ++g) sum.srcs.push_back(at(groups[g][0]));
  kernels::sum_into(sum);
}

}  // namespace tagps::comm
