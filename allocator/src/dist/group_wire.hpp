// The Unix socket group's wire: messages over SOCK_SEQPACKET (boundaries kept, so descriptors
// passed with SCM_RIGHTS always arrive with the frame they were sent with). A message is one or
// more frames: each frame is a FrameHeader, up to frame_data_limit bytes of body and up to
// frame_fd_limit descriptors; the first frame's header carries the totals.
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
  hello = 1,       // rank -> hub: version, rank, size, secret, pid
  welcome = 2,     // hub -> rank
  refused = 3,     // hub -> rank: reason, then the hub closes the connection
  contribute = 4,  // rank -> hub: generation, sequence, kind, bytes (+ fds)
  give_up = 5,     // rank -> hub: generation, sequence, seconds waited
  recover = 6,     // rank -> hub: generation
  give_up_recovery = 7,
  reply = 8,  // hub -> rank: an encoded Reply (+ fds of every part, in order)
};

struct Message {
  MessageType type = MessageType::hello;
  std::vector<std::byte> body;
  std::vector<UniqueFd> fds;
};

inline constexpr std::uint32_t wire_version = 1;

// Sends a whole message; `fds` stay owned by the caller. Throws error on failure (a closed peer
// included: MSG_NOSIGNAL, no SIGPIPE).
void send_message(int sock, MessageType type, std::span<const std::byte> body, std::span<const int> fds = {});
// The next whole message, or nothing when `deadline` passes before its first frame. Throws
// error on end of stream ("closed") or a malformed frame.
std::optional<Message> recv_message(int fd, std::chrono::steady_clock::time_point deadline);

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

 private:
  void need(std::size_t n) const {
    if (in_.size() - at_ < n) throw error("group wire: truncated message body");
  }
  const std::vector<std::byte>& in_;
  std::size_t at_ = 0;
};

}  // namespace torpor::detail
