// Framing of the hub's messages as datagrams; see group_wire.hpp.
#include "ranks/groups/hub/group_wire.hpp"

#include <fmt/core.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

namespace torpor::detail {

namespace {

std::string errno_text() { return std::strerror(errno); }

FrameHeader header_of(const Datagram& d) {
  if (d.truncated) throw error("group socket: truncated frame");
  if (d.bytes.size() < sizeof(FrameHeader)) throw error("group socket: short frame");
  FrameHeader h{};
  std::memcpy(&h, d.bytes.data(), sizeof h);
  if (h.magic != frame_magic) throw error("group socket: bad frame (not a torpor group peer?)");
  if (h.frame_bytes != d.bytes.size() - sizeof(FrameHeader)) throw error("group socket: frame size mismatch");
  if (h.frame_fds != d.fds.size()) throw error("group socket: frame descriptor count mismatch");
  if (h.frame_bytes > frame_data_limit || h.frame_fds > frame_fd_limit)
    throw error("group socket: frame larger than the protocol allows");
  return h;
}

}  // namespace

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

std::vector<std::byte> encode_hello(int rank, int size, std::string_view secret) {
  if (secret.size() != sizeof(HelloBody::secret))
    throw invalid_argument(fmt::format("group hello: the secret must be {} characters", sizeof(HelloBody::secret)));
  FrameHeader h{};
  h.magic = frame_magic;
  h.type = static_cast<std::uint8_t>(MessageType::hello);
  h.frame_bytes = sizeof(HelloBody);
  h.total_bytes = sizeof(HelloBody);
  HelloBody b{};
  b.version = wire_version;
  b.rank = rank;
  b.size = size;
  std::memcpy(b.secret, secret.data(), sizeof b.secret);
  std::vector<std::byte> out(hello_frame_bytes);
  std::memcpy(out.data(), &h, sizeof h);
  std::memcpy(out.data() + sizeof h, &b, sizeof b);
  return out;
}

std::optional<HelloFields> parse_hello(const Datagram& d, std::string& why) {
  if (!d.fds.empty()) {
    why = "a hello must not carry descriptors";
    return std::nullopt;
  }
  if (d.truncated || d.bytes.size() != hello_frame_bytes) {
    why = fmt::format("the first message was not a hello of {} bytes", hello_frame_bytes);
    return std::nullopt;
  }
  FrameHeader h{};
  std::memcpy(&h, d.bytes.data(), sizeof h);
  if (h.magic != frame_magic || h.type != static_cast<std::uint8_t>(MessageType::hello) ||
      h.frame_bytes != sizeof(HelloBody) || h.total_bytes != sizeof(HelloBody) || h.frame_fds != 0 ||
      h.total_fds != 0) {
    why = "the first message was not a hello";
    return std::nullopt;
  }
  HelloBody b{};
  std::memcpy(&b, d.bytes.data() + sizeof h, sizeof b);
  HelloFields f;
  f.version = b.version;
  f.rank = b.rank;
  f.size = b.size;
  f.secret.assign(b.secret, sizeof b.secret);
  return f;
}

std::optional<Message> MessageAssembler::add(Datagram d) {
  FrameHeader h = header_of(d);
  if (!first_) {
    if (h.total_bytes > message_byte_limit || h.total_fds > message_fd_limit)
      throw error("group socket: message larger than the protocol allows");
    first_ = h;
    m_ = Message{};
    m_.type = static_cast<MessageType>(h.type);
  } else if (h.type != first_->type || h.total_bytes != first_->total_bytes || h.total_fds != first_->total_fds) {
    throw error("group socket: frames of two messages interleaved");
  }
  for (auto& f : d.fds) m_.fds.push_back(std::move(f));
  if (m_.body.size() + h.frame_bytes > first_->total_bytes || m_.fds.size() > first_->total_fds)
    throw error("group socket: message longer than announced");
  m_.body.insert(m_.body.end(), d.bytes.begin() + sizeof(FrameHeader), d.bytes.end());
  if (m_.body.size() < first_->total_bytes || m_.fds.size() < first_->total_fds) {
    if (h.frame_bytes == 0 && h.frame_fds == 0) throw error("group socket: empty continuation frame");
    return std::nullopt;
  }
  first_.reset();
  return std::move(m_);
}

RecvStatus recv_datagram(int sock, std::size_t limit, Datagram& out) {
  out = Datagram{};
  out.bytes.resize(limit);
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * frame_fd_limit)];
  iovec iov{out.bytes.data(), out.bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    out.bytes.clear();
    if (errno == EAGAIN || errno == EWOULDBLOCK) return RecvStatus::would_block;
    if (errno == ECONNRESET) return RecvStatus::closed;
    throw error(fmt::format("group socket: recvmsg failed: {}", errno_text()));
  }
  // Descriptors first, so they are owned (and closed) whatever happens next.
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      out.fds.emplace_back(fd);
    }
  }
  out.bytes.resize(static_cast<std::size_t>(n));
  out.truncated = (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0;
  // A zero-length datagram is not a frame; with nothing else received it is the end of stream.
  if (n == 0 && out.fds.empty() && !out.truncated) return RecvStatus::closed;
  return RecvStatus::ok;
}

std::vector<std::byte> encode_frame(MessageType type, std::span<const std::byte> body) {
  if (body.size() > frame_data_limit) throw invalid_argument("group wire: a single frame holds at most 32 KiB");
  FrameHeader h{};
  h.magic = frame_magic;
  h.type = static_cast<std::uint8_t>(type);
  h.frame_bytes = static_cast<std::uint32_t>(body.size());
  h.total_bytes = body.size();
  std::vector<std::byte> out(sizeof h + body.size());
  std::memcpy(out.data(), &h, sizeof h);
  if (!body.empty()) std::memcpy(out.data() + sizeof h, body.data(), body.size());
  return out;
}

bool try_send_datagram(int sock, std::span<const std::byte> datagram) noexcept {
  ssize_t n;
  do {
    n = ::send(sock, datagram.data(), datagram.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(datagram.size());
}

void send_message(int sock, MessageType type, std::span<const std::byte> body, std::span<const int> fds) {
  if (body.size() > message_byte_limit || fds.size() > message_fd_limit)
    throw invalid_argument(fmt::format("group message of {} bytes and {} descriptors exceeds the protocol's limits "
                                       "({} bytes, {} descriptors)",
                                       body.size(), fds.size(), message_byte_limit, message_fd_limit));
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
  MessageAssembler assembler;
  for (;;) {
    auto until = assembler.in_progress() ? std::chrono::steady_clock::now() + continuation_wait : deadline;
    if (!wait_readable(fd, until)) {
      if (assembler.in_progress()) throw error("group socket: the rest of a message did not arrive");
      return std::nullopt;
    }
    Datagram d;
    RecvStatus s = recv_datagram(fd, sizeof(FrameHeader) + frame_data_limit, d);
    if (s == RecvStatus::would_block) continue;
    if (s == RecvStatus::closed) throw error("group socket: the other end closed the connection");
    if (std::optional<Message> m = assembler.add(std::move(d))) return m;
  }
}

}  // namespace torpor::detail
