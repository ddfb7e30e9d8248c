// Shared memory between a worker and a summation server on the same host (TAGPS_PS_IPC; BytePS's IPC mode):
// the worker keeps a chunk's bytes in a memfd segment the server maps, so a PUSH and its PULL_REPLY carry
// only a header over the socket, and the bytes cross no TCP stack.
//
// The worker creates the segment (memfd_create, every page reserved with posix_fallocate, so a host out of
// memory is an error at declaration, not a SIGBUS mid-step) and names it in its INIT by pid, descriptor
// and a random nonce written at the segment's start. The server opens /proc/<pid>/fd/<fd>, maps it and
// checks the nonce; if any of that fails (another host, another pid namespace, no permission) it declines
// and the chunk travels over TCP. A memfd has no name in any file system: nothing is left behind when
// either process dies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

namespace tagps::net {

// Where a chunk's bytes live in a worker's segment (the INIT's descriptor frame, kIpcDescriptorSize bytes).
struct IpcDescriptor {
  uint32_t pid = 0;
  int32_t fd = -1;
  uint64_t nonce = 0;
  uint64_t segment_bytes = 0;  // the whole segment, header included
  uint64_t offset = 0;         // of the chunk's bytes
};

inline constexpr size_t kIpcDescriptorSize = 32;
// Bytes before the first chunk: the nonce, then padding to a page.
inline constexpr size_t kSegmentHeaderBytes = 4096;
// Chunks start on a cache line.
inline constexpr size_t kSegmentAlign = 64;

// Little-endian encoding of a descriptor; unpack throws ProtocolError on a frame of the wrong size.
std::string pack_ipc(const IpcDescriptor& d);
IpcDescriptor unpack_ipc(const void* data, size_t size);

// The worker's side: a mapped memfd of `bytes` (plus the header), owned until destruction.
class SharedSegment {
 public:
  // Throws Error naming the cause (memfd_create, or posix_fallocate when the host lacks the memory).
  explicit SharedSegment(size_t bytes);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  // The descriptor of the bytes at `offset` (from the segment's start, past the header).
  IpcDescriptor describe(size_t offset) const;
  char* at(size_t offset) const { return base_ + offset; }

 private:
  char* base_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
  uint64_t nonce_ = 0;
};

// The server's side: every segment it mapped, unmapped at destruction. Thread-safe.
class SegmentMap {
 public:
  SegmentMap() = default;
  ~SegmentMap();
  SegmentMap(const SegmentMap&) = delete;
  SegmentMap& operator=(const SegmentMap&) = delete;

  // The address of `nbytes` at the descriptor's offset, mapping its segment on first use; nullptr with
  // the reason in `why` when the segment cannot be mapped or the chunk does not fit in it.
  char* map(const IpcDescriptor& d, size_t nbytes, std::string& why);

 private:
  struct Mapping {
    char* base;
    size_t size;
  };
  std::mutex mu_;
  std::map<std::tuple<uint32_t, int32_t, uint64_t>, Mapping> mappings_;
};

}  // namespace tagps::net
