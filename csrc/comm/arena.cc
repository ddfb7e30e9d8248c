#include "comm/arena.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
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

// Whether round `got` is at or past round `want` (sequence numbers wrap around).
bool reached(uint32_t got, uint32_t want) { return static_cast<int32_t>(got - want) >= 0; }

// Futexes on a MAP_SHARED mapping, so not FUTEX_PRIVATE: waiters and wakers are different processes.
long futex_wait(uint32_t* word, uint32_t expected, const struct timespec* timeout) {
  return ::syscall(SYS_futex, word, FUTEX_WAIT, expected, timeout, nullptr, 0);
}

void futex_wake_all(uint32_t* word) { ::syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

void parallel_copy(void* dst, const void* src, size_t nbytes) {
  parallel_for(nbytes, kMinParallelCopy, [&](size_t begin, size_t end) {
    std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, end - begin);
  });
}

}  // namespace

// The control block's layout, shared by every process that maps the file (plain words, accessed with
// __atomic builtins: the futex needs a plain uint32_t address).
struct Arena::SlotState {
  uint32_t ready;  // the last round this slot was written for
  uint32_t dtype;  // what its writer mapped
  uint64_t count;
};

struct Arena::Control {
  uint32_t done;    // the last round published
  uint32_t failed;  // non-zero once the reduction failed
  uint64_t reserved;
  SlotState slots[1];  // `slots` of them
};

Arena::Control* Arena::control() const { return static_cast<Control*>(base_); }

Arena::SlotState* Arena::slot_state(size_t slot) const { return &control()->slots[0] + slot; }

Arena::Arena(ArenaOptions options) : o_(std::move(options)) {
  TAGPS_ENFORCE_GT(o_.slots, size_t{0}, "arena ", o_.path, ": slots");
  TAGPS_ENFORCE_GT(o_.count, size_t{0}, "arena ", o_.path, ": count");
  const size_t rows = o_.slots + 1;
  header_bytes_ = (offsetof(Control, slots) + o_.slots * sizeof(SlotState) + 63) / 64 * 64;
  TAGPS_ENFORCE(o_.count <= (std::numeric_limits<size_t>::max() - header_bytes_) / dtype_size(o_.dtype) / rows,
                "arena ", o_.path, ": ", rows, " rows of ", o_.count, " elements overflow the address space");
  bytes_ = header_bytes_ + rows * row_bytes();

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
  return static_cast<char*>(base_) + header_bytes_ + i * row_bytes();
}

void Arena::mark_ready(size_t slot, uint32_t seq) {
  TAGPS_ENFORCE(slot < o_.slots, "arena ", o_.path, ": slot ", slot, " of ", o_.slots);
  SlotState* s = slot_state(slot);
  s->dtype = static_cast<uint32_t>(o_.dtype);
  s->count = o_.count;
  __atomic_store_n(&s->ready, seq, __ATOMIC_RELEASE);
}

Arena::Ready Arena::all_ready(uint32_t seq) const {
  bool same = true;
  for (size_t i = 0; i < o_.slots; ++i) {
    const SlotState* s = slot_state(i);
    if (!reached(__atomic_load_n(&s->ready, __ATOMIC_ACQUIRE), seq)) return Ready::kNotYet;
    same = same && s->dtype == static_cast<uint32_t>(o_.dtype) && s->count == o_.count;
  }
  return same ? Ready::kAll : Ready::kShapesDiffer;
}

void Arena::publish(uint32_t seq) {
  __atomic_store_n(&control()->done, seq, __ATOMIC_RELEASE);
  futex_wake_all(&control()->done);
}

void Arena::fail() {
  __atomic_store_n(&control()->failed, 1u, __ATOMIC_RELEASE);
  futex_wake_all(&control()->done);
}

bool Arena::done(uint32_t seq) const { return reached(__atomic_load_n(&control()->done, __ATOMIC_ACQUIRE), seq); }

Arena::Done Arena::wait_done(uint32_t seq, double timeout_s) const {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(std::max(0.0, timeout_s));
  uint32_t* word = &control()->done;
  while (true) {
    const uint32_t now_done = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    if (reached(now_done, seq)) return Done::kDone;
    if (__atomic_load_n(&control()->failed, __ATOMIC_ACQUIRE) != 0) return Done::kFailed;
    const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now()).count();
    if (left <= 0) return Done::kTimedOut;
    struct timespec ts {};
    ts.tv_sec = static_cast<time_t>(left / 1000000000);
    ts.tv_nsec = static_cast<long>(left % 1000000000);
    futex_wait(word, now_done, &ts);  // EAGAIN (changed meanwhile), EINTR, ETIMEDOUT: look again
  }
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
