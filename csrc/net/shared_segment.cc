#include "net/shared_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "common/error.h"
#include "net/wire.h"

namespace tagps::net {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the descriptor is copied as little-endian fields");

std::string pack_ipc(const IpcDescriptor& d) {
  std::string out(kIpcDescriptorSize, '\0');
  std::memcpy(out.data(), &d.pid, 4);
  std::memcpy(out.data() + 4, &d.fd, 4);
  std::memcpy(out.data() + 8, &d.nonce, 8);
  std::memcpy(out.data() + 16, &d.segment_bytes, 8);
  std::memcpy(out.data() + 24, &d.offset, 8);
  return out;
}

IpcDescriptor unpack_ipc(const void* data, size_t size) {
  if (size != kIpcDescriptorSize) {
    throw ProtocolError(detail::concat("shared-memory descriptor of ", size, " bytes, expected ",
                                       kIpcDescriptorSize));
  }
  const auto* p = static_cast<const char*>(data);
  IpcDescriptor d;
  std::memcpy(&d.pid, p, 4);
  std::memcpy(&d.fd, p + 4, 4);
  std::memcpy(&d.nonce, p + 8, 8);
  std::memcpy(&d.segment_bytes, p + 16, 8);
  std::memcpy(&d.offset, p + 24, 8);
  return d;
}

SharedSegment::SharedSegment(size_t bytes) : size_(kSegmentHeaderBytes + bytes) {
  fd_ = ::memfd_create("tagps-ps-ipc", MFD_CLOEXEC);
  if (fd_ < 0) throw Error(detail::concat("memfd_create: ", std::strerror(errno)));
  // Reserve every page now: a segment the host cannot back fails here, with its reason, instead of a
  // SIGBUS when a page is first touched mid-step.
  const int err = ::posix_fallocate(fd_, 0, static_cast<off_t>(size_));
  if (err != 0) {
    ::close(fd_);
    throw Error(detail::concat("cannot reserve ", size_, " bytes of shared memory for the PS IPC path: ",
                               std::strerror(err), " (set TAGPS_PS_IPC=0 to send over TCP instead)"));
  }
  void* base = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (base == MAP_FAILED) {
    const int e = errno;
    ::close(fd_);
    throw Error(detail::concat("mmap of the PS IPC segment: ", std::strerror(e)));
  }
  base_ = static_cast<char*>(base);
  std::random_device random;
  nonce_ = (static_cast<uint64_t>(random()) << 32) ^ random();
  std::memcpy(base_, &nonce_, sizeof nonce_);
}

SharedSegment::~SharedSegment() {
  ::munmap(base_, size_);
  ::close(fd_);
}

IpcDescriptor SharedSegment::describe(size_t offset) const {
  IpcDescriptor d;
  d.pid = static_cast<uint32_t>(::getpid());
  d.fd = fd_;
  d.nonce = nonce_;
  d.segment_bytes = size_;
  d.offset = offset;
  return d;
}

SegmentMap::~SegmentMap() {
  for (auto& [id, m] : mappings_) ::munmap(m.base, m.size);
}

char* SegmentMap::map(const IpcDescriptor& d, size_t nbytes, std::string& why) {
  if (d.offset < kSegmentHeaderBytes || d.offset > d.segment_bytes || nbytes > d.segment_bytes - d.offset) {
    why = detail::concat("a chunk of ", nbytes, " bytes at offset ", d.offset, " does not fit in a segment of ",
                         d.segment_bytes);
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  const auto id = std::make_tuple(d.pid, d.fd, d.nonce);
  auto it = mappings_.find(id);
  if (it == mappings_.end()) {
    const std::string path = detail::concat("/proc/", d.pid, "/fd/", d.fd);
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      why = detail::concat("cannot open ", path, ": ", std::strerror(errno));
      return nullptr;
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < d.segment_bytes) {
      ::close(fd);
      why = detail::concat(path, " is not a segment of ", d.segment_bytes, " bytes");
      return nullptr;
    }
    void* base = ::mmap(nullptr, d.segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);  // the mapping keeps the memory
    if (base == MAP_FAILED) {
      why = detail::concat("mmap of ", path, ": ", std::strerror(errno));
      return nullptr;
    }
    uint64_t nonce = 0;
    std::memcpy(&nonce, base, sizeof nonce);
    if (nonce != d.nonce) {  // a reused pid or descriptor: not the worker's segment
      ::munmap(base, d.segment_bytes);
      why = detail::concat(path, " is not the segment the worker described (nonce differs)");
      return nullptr;
    }
    it = mappings_.emplace(id, Mapping{static_cast<char*>(base), d.segment_bytes}).first;
  } else if (d.segment_bytes > it->second.size) {
    why = detail::concat("the segment was mapped with ", it->second.size, " bytes, this descriptor says ",
                         d.segment_bytes);
    return nullptr;
  }
  return it->second.base + d.offset;
}

}  // namespace tagps::net
