// Framing of the Unix socket group's messages; see group_wire.hpp.
#include "dist/group_wire.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

namespace torpor::detail {

namespace {

constexpr std::uint32_t frame_magic = 0x54525047;  // "TRPG"
constexpr std::size_t frame_data_limit = std::size_t{32} * 1024;
constexpr std::size_t frame_fd_limit = 64;
// A message's later frames are sent right after its first; waiting longer than this for one
// means the peer is stuck or gone.
constexpr auto continuation_wait = std::chrono::seconds(5);

struct FrameHeader {
  std::uint32_t magic;
  std::uint8_t type;
  std::uint8_t reserved[3];
  std::uint32_t frame_bytes;
  std::uint32_t frame_fds;
  std::uint64_t total_bytes;
  std::uint64_t total_fds;
};

std::string errno_text() { return std::strerror(errno); }

// Waits until fd is readable; false when the deadline passes.
bool wait_readable(int fd, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    int ms = static_cast<int>(std::clamp<long long>(left.count(), 0, 1 << 30));
    pollfd p{fd, POLLIN, 0};
    int n = ::poll(&p, 1, ms);
    if (n > 0) return true;
    if (n == 0) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      continue;
    }
    if (errno != EINTR) throw error(fmt::format("group socket: poll failed: {}", errno_text()));
  }
}

// One frame; appends its data and descriptors.
void recv_frame(int fd, FrameHeader& h, std::vector<std::byte>& body, std::vector<UniqueFd>& fds) {
  std::vector<std::byte> buf(sizeof(FrameHeader) + frame_data_limit);
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * frame_fd_limit)];
  iovec iov{buf.data(), buf.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) throw error(fmt::format("group socket: recvmsg failed: {}", errno_text()));
  // Descriptors first, so they are owned (and closed) whatever happens next.
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < count; ++i) {
      int d;
      std::memcpy(&d, CMSG_DATA(c) + i * sizeof(int), sizeof d);
      fds.emplace_back(d);
    }
  }
  if (n == 0) throw error("group socket: the other end closed the connection");
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) throw error("group socket: truncated frame");
  if (static_cast<std::size_t>(n) < sizeof(FrameHeader)) throw error("group socket: short frame");
  std::memcpy(&h, buf.data(), sizeof h);
  if (h.magic != frame_magic) throw error("group socket: bad frame (not a torpor group peer?)");
  if (h.frame_bytes != static_cast<std::size_t>(n) - sizeof(FrameHeader))
    throw error("group socket: frame size mismatch");
  body.insert(body.end(), buf.begin() + sizeof(FrameHeader), buf.begin() + n);
}

}  // namespace

void send_message(int sock, MessageType type, std::span<const std::byte> body, std::span<const int> fds) {
  std::size_t sent_bytes = 0, sent_fds = 0;
  do {
    std::size_t nb = std::min(frame_data_limit, body.size() - sent_bytes);
    std::size_t nf = std::min(frame_fd_limit, fds.size() - sent_fds);
    FrameHeader h{};
    h.magic = frame_magic;
    h.type = static_cast<std::uint8_t>(type);
    h.frame_bytes = static_cast<std::uint32_t>(nb);
    h.frame_fds = static_cast<std::uint32_t>(nf);
    h.total_bytes = body.size();
    h.total_fds = fds.size();
    iovec iov[2] = {{&h, sizeof h}, {const_cast<std::byte*>(body.data()) + sent_bytes, nb}};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = nb > 0 ? 2 : 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * frame_fd_limit)];
    if (nf > 0) {
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * nf);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * nf);
      for (std::size_t i = 0; i < nf; ++i) {
        int d = fds[sent_fds + i];
        std::memcpy(CMSG_DATA(c) + i * sizeof(int), &d, sizeof d);
      }
    }
    ssize_t n;
    do {
      n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0) throw error(fmt::format("group socket: sendmsg failed: {}", errno_text()));
    if (static_cast<std::size_t>(n) != sizeof h + nb) throw error("group socket: short send");
    sent_bytes += nb;
    sent_fds += nf;
  } while (sent_bytes < body.size() || sent_fds < fds.size());
}

std::optional<Message> recv_message(int fd, std::chrono::steady_clock::time_point deadline) {
  if (!wait_readable(fd, deadline)) return std::nullopt;
  Message m;
  FrameHeader first{};
  recv_frame(fd, first, m.body, m.fds);
  m.type = static_cast<MessageType>(first.type);
  if (first.total_bytes > (std::uint64_t{1} << 32) || first.total_fds > 4096)
    throw error("group socket: message larger than the protocol allows");
  while (m.body.size() < first.total_bytes || m.fds.size() < first.total_fds) {
    if (!wait_readable(fd, std::chrono::steady_clock::now() + continuation_wait))
      throw error("group socket: the rest of a message did not arrive");
    FrameHeader h{};
    recv_frame(fd, h, m.body, m.fds);
    if (h.type != first.type || h.total_bytes != first.total_bytes || h.total_fds != first.total_fds)
      throw error("group socket: frames of two messages interleaved");
  }
  if (m.body.size() != first.total_bytes || m.fds.size() != first.total_fds)
    throw error("group socket: message longer than announced");
  return m;
}

}  // namespace torpor::detail
