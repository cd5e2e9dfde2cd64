// The hub's wire: every transport carries the same frames. A message is one or more frames: each
// frame is a FrameHeader, up to frame_data_limit bytes of body and up to frame_fd_limit
// descriptors; the first frame's header carries the totals. Over the Unix socket group's
// SOCK_SEQPACKET a frame is one datagram (boundaries kept, so descriptors passed with SCM_RIGHTS
// always arrive with the frame they were sent with: the functions below); over TcpGroup's stream
// a frame is its header and exactly frame_bytes of body, without descriptors (tcp_group.cpp).
//
// Every connection opens with a hello: one frame of exactly hello_frame_bytes holding the
// protocol version, the rank, the group size and the secret. Its size is fixed so that the hub
// authenticates a stranger with one bounded read (never a continuation, never a buffer sized by
// what the stranger announced); only an authenticated rank may send multi-frame messages.
//
// Reassembly (MessageAssembler) and the hello's parsing know nothing of sockets, so the hub can
// read without blocking (one datagram at a time, whichever connection is ready) and the fuzz
// target can drive them with arbitrary bytes.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "torpor/error.hpp"
#include "torpor/group.hpp"

namespace torpor::detail {

enum class MessageType : std::uint8_t {
  hello = 1,       // rank -> hub: version, rank, size, secret (one fixed-size frame)
  welcome = 2,     // hub -> rank
  refused = 3,     // hub -> rank: reason, then the hub closes the connection
  contribute = 4,  // rank -> hub: generation, sequence, kind, bytes (+ fds)
  give_up = 5,     // rank -> hub: generation, sequence, seconds waited
  recover = 6,     // rank -> hub: generation
  give_up_recovery = 7,
  reply = 8,  // hub -> rank: an encoded Reply (+ fds of every part, in order)
  busy = 9,   // hub -> connection: too many connections waiting to say hello; try again
};

struct Message {
  MessageType type = MessageType::hello;
  std::vector<std::byte> body;
  std::vector<UniqueFd> fds;
};

// 2: the fixed-size hello.
inline constexpr std::uint32_t wire_version = 2;

// A message's later frames are sent right after its first; waiting longer than this for one
// means the peer is stuck or gone (the hub then drops the rank, a rank loses the hub).
inline constexpr auto continuation_wait = std::chrono::seconds(5);

inline constexpr std::uint32_t frame_magic = 0x54525047;  // "TRPG"
inline constexpr std::size_t frame_data_limit = std::size_t{32} * 1024;
inline constexpr std::size_t frame_fd_limit = 64;
// What one message may carry: the hub buffers at most this much for one rank.
inline constexpr std::uint64_t message_byte_limit = std::uint64_t{1} << 32;
inline constexpr std::uint64_t message_fd_limit = 4096;

struct FrameHeader {
  std::uint32_t magic;
  std::uint8_t type;
  std::uint8_t reserved[3];
  std::uint32_t frame_bytes;
  std::uint32_t frame_fds;
  std::uint64_t total_bytes;
  std::uint64_t total_fds;
};

// The hello's body. The secret travels as its 64 hex digits.
struct HelloBody {
  std::uint32_t version;
  std::int32_t rank;
  std::int32_t size;
  char secret[64];
};
inline constexpr std::size_t hello_frame_bytes = sizeof(FrameHeader) + sizeof(HelloBody);

// One datagram as received: its bytes and the descriptors that came with it (owned).
struct Datagram {
  std::vector<std::byte> bytes;
  std::vector<UniqueFd> fds;
  bool truncated = false;  // longer than the buffer, or more descriptors than it had room for
};

// The hello datagram of (rank, size, secret); the secret must be 64 characters.
std::vector<std::byte> encode_hello(int rank, int size, std::string_view secret);

struct HelloFields {
  std::uint32_t version = 0;
  int rank = -1;
  int size = -1;
  std::string secret;
};
// The hello in `d`, or nothing with the reason in `why` (wrong size, descriptors, not a hello).
// Checks the form only; the version, secret, rank and size are the hub's to judge.
std::optional<HelloFields> parse_hello(const Datagram& d, std::string& why);

// Reassembles one message at a time from its frames.
class MessageAssembler {
 public:
  // Adds one datagram; returns the message it completes, if any. Throws error on a malformed
  // frame (bad magic, sizes that disagree, totals over the limits, frames of two messages).
  std::optional<Message> add(Datagram d);
  bool in_progress() const noexcept { return first_.has_value(); }

 private:
  std::optional<FrameHeader> first_;
  Message m_;
};

enum class RecvStatus { ok, would_block, closed };
// One recvmsg that does not wait (MSG_DONTWAIT), into a buffer of `limit` bytes. Throws error on
// a socket error other than "would block".
RecvStatus recv_datagram(int sock, std::size_t limit, Datagram& out);

// Sends a whole message; `fds` stay owned by the caller. Throws error on failure (a closed peer
// included: MSG_NOSIGNAL, no SIGPIPE).
void send_message(int sock, MessageType type, std::span<const std::byte> body, std::span<const int> fds = {});
// Sends one datagram without waiting; false when the peer is gone or its buffer is full.
bool try_send_datagram(int sock, std::span<const std::byte> datagram) noexcept;
// A single-frame message (at most frame_data_limit bytes of body) as one datagram.
std::vector<std::byte> encode_frame(MessageType type, std::span<const std::byte> body);
// The next whole message, or nothing when `deadline` passes before its first frame. Throws
// error on end of stream ("closed") or a malformed frame.
std::optional<Message> recv_message(int fd, std::chrono::steady_clock::time_point deadline);
// Waits until fd is readable; false when the deadline passes first. Throws error when poll fails.
bool wait_readable(int fd, std::chrono::steady_clock::time_point deadline);

// Body encoding: fixed-width native integers (both ends are on one machine), length-prefixed
// byte strings.
class Writer {
 public:
  template <typename T>
  Writer& put(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out_.insert(out_.end(), p, p + sizeof v);
    return *this;
  }
  Writer& put_bytes(const void* data, std::size_t n) {
    put<std::uint64_t>(n);
    const auto* p = static_cast<const std::byte*>(data);
    out_.insert(out_.end(), p, p + n);
    return *this;
  }
  Writer& put_string(std::string_view s) { return put_bytes(s.data(), s.size()); }
  std::vector<std::byte> take() { return std::move(out_); }

 private:
  std::vector<std::byte> out_;
};

class Reader {
 public:
  explicit Reader(const std::vector<std::byte>& in) : in_(in) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, in_.data() + at_, sizeof v);
    at_ += sizeof v;
    return v;
  }
  std::vector<std::byte> get_bytes() {
    auto n = get<std::uint64_t>();
    need(n);
    std::vector<std::byte> v(in_.begin() + static_cast<std::ptrdiff_t>(at_),
                             in_.begin() + static_cast<std::ptrdiff_t>(at_ + n));
    at_ += n;
    return v;
  }
  std::string get_string() {
    auto b = get_bytes();
    return std::string(reinterpret_cast<const char*>(b.data()), b.size());
  }
  bool done() const noexcept { return at_ == in_.size(); }

 private:
  void need(std::uint64_t n) const {
    if (in_.size() - at_ < n) throw error("group wire: truncated message body");
  }
  const std::vector<std::byte>& in_;
  std::size_t at_ = 0;
};

}  // namespace torpor::detail
