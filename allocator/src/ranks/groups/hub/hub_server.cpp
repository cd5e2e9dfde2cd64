// HubServer: see hub_server.hpp for the invariants.
#include "ranks/groups/hub/hub_server.hpp"

#include <fmt/core.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor::detail {

namespace {

std::string errno_text() { return std::strerror(errno); }

std::span<const std::byte> as_bytes(const std::vector<std::byte>& v) { return {v.data(), v.size()}; }

}  // namespace

HubServer::HubServer(std::unique_ptr<HubTransport> transport, int size, std::string secret)
    : transport_(std::move(transport)),
      name_(transport_->name()),
      protocol_(size, std::move(secret), ::getpid()),
      ranks_(static_cast<std::size_t>(size)),
      rank_deadlines_(static_cast<std::size_t>(size)) {
  wake_.reset(::eventfd(0, EFD_CLOEXEC));
  if (!wake_) throw error(fmt::format("eventfd failed: {}", errno_text()));
  thread_ = std::thread([this] { run(); });
}

HubServer::~HubServer() {
  if (!thread_.joinable()) return;
  std::uint64_t one = 1;
  if (::write(wake_.get(), &one, sizeof one) < 0) log::error("{}: could not signal the server thread to stop", name_);
  thread_.join();
}

void HubServer::run() noexcept {
  try {
    loop();
  } catch (const std::exception& e) {
    log::error("{} stopped: {}; every rank will see the group fail", name_, e.what());
  }
  for (auto& r : ranks_) r.reset();
}

// One poll over everything; then the ranks' traffic, the strangers' hellos, new connections.
void HubServer::loop() {
  std::vector<pollfd> fds;
  for (;;) {
    fds.clear();
    fds.push_back({wake_.get(), POLLIN, 0});
    fds.push_back({transport_->listening_fd(), POLLIN, 0});
    for (auto& r : ranks_) fds.push_back({r ? r->fd() : -1, POLLIN, 0});  // -1 is ignored by poll
    for (auto& s : strangers_) fds.push_back({s.link->fd(), POLLIN, 0});
    int n = ::poll(fds.data(), fds.size(), poll_timeout_ms());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw error(fmt::format("poll failed: {}", errno_text()));
    }
    if (fds[0].revents != 0) return;
    std::size_t at = 2;
    for (int r = 0; r < size(); ++r, ++at) {
      const auto& link = ranks_[static_cast<std::size_t>(r)];
      if (fds[at].fd >= 0 && fds[at].revents != 0 && link && link->fd() == fds[at].fd) serve(r);
    }
    drop_stalled_ranks();
    // Strangers as they were when polled; accepting below only appends.
    const std::size_t polled = strangers_.size();
    std::vector<bool> done(polled, false);
    for (std::size_t i = 0; i < polled; ++i, ++at) {
      Stranger& s = strangers_[i];
      if (fds[at].revents != 0) admit(s);
      // Also when it keeps sending: a hello that trickles in is no hello.
      if (s.link && clock_type::now() >= s.deadline) refuse(s, "no hello within the deadline");
      done[i] = !s.link;
    }
    for (std::size_t i = polled; i-- > 0;)
      if (done[i]) strangers_.erase(strangers_.begin() + static_cast<std::ptrdiff_t>(i));
    if (fds[1].revents & POLLIN) accept_some();
  }
}

int HubServer::poll_timeout_ms() const {
  std::optional<clock_type::time_point> next;
  for (auto& s : strangers_)
    if (!next || s.deadline < *next) next = s.deadline;
  for (auto& d : rank_deadlines_)
    if (d && (!next || *d < *next)) next = *d;
  if (!next) return -1;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*next - clock_type::now()).count();
  return static_cast<int>(std::clamp<long long>(left + 1, 0, 1 << 30));
}

void HubServer::accept_some() {
  for (int k = 0; k < accept_batch; ++k) {
    std::optional<HubTransport::Arrival> a = transport_->accept();
    if (!a) return;
    if (!a->link) {
      ++refused_;
      log::warn("{}: refused a connection: {}", name_, a->refusal);
      continue;
    }
    strangers_.push_back({std::move(a->link), clock_type::now() + hello_deadline});
    // The cap: the oldest stranger makes room (a rank says hello at once, so it is never the
    // oldest for long).
    if (strangers_.size() > max_strangers) {
      refuse(strangers_.front(), fmt::format("more than {} connections waiting to say hello", max_strangers),
             MessageType::busy);
      strangers_.erase(strangers_.begin());
    }
  }
}

void HubServer::refuse(Stranger& s, const std::string& why, MessageType type) {
  // Logged, but a flood of strangers must not flood the log: the first few, then every power
  // of two.
  const std::size_t n = ++refused_;
  const std::string peer = s.link->peer();
  if (n <= 8 || (n & (n - 1)) == 0)
    log::warn("{}: refused a connection from {}: {} ({} refused so far)", name_, peer, why, n);
  else
    log::debug("{}: refused a connection from {}: {}", name_, peer, why);
  try {
    Writer w;
    w.put_string(why.substr(0, 1024));
    auto body = w.take();
    (void)s.link->try_send(type, as_bytes(body));
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): refused either way
  }
  s.link.reset();
}

// The stranger's first frame, read once: one hello of a fixed size, or a refusal. Frames that
// came with it (a stream may carry them) are the new rank's first traffic.
void HubServer::admit(Stranger& s) {
  std::vector<Datagram> frames;
  RecvStatus st;
  try {
    st = s.link->receive(frames, /*hello=*/true);
  } catch (const std::exception& e) {
    return refuse(s, fmt::format("unreadable hello ({})", e.what()));
  }
  if (frames.empty()) {
    if (st == RecvStatus::closed) return refuse(s, "closed the connection without a hello");
    return;  // part of a hello (a stream's); the deadline bounds the wait for the rest
  }
  HubProtocol::Admission a = protocol_.admit(frames.front(), s.link->pid());
  if (a.rank < 0) return refuse(s, a.refusal);
  if (!s.link->try_send(MessageType::welcome, {})) {
    log::warn("{}: rank {} vanished while joining", name_, a.rank);
    s.link.reset();
    deliver(protocol_.leave(a.rank));
    return;
  }
  log::debug("{}: rank {} joined ({})", name_, a.rank, s.link->peer());
  ranks_[static_cast<std::size_t>(a.rank)] = std::move(s.link);
  Deliveries out;
  try {
    take(a.rank, frames, 1, out);
    note_mid_message(a.rank);
  } catch (const std::exception& e) {
    log::debug("{}: rank {} disconnected: {}", name_, a.rank, e.what());
    drop(a.rank, out);
  }
  deliver(std::move(out));
}

void HubServer::take(int rank, std::vector<Datagram>& frames, std::size_t from, Deliveries& out) {
  for (std::size_t i = from; i < frames.size(); ++i) {
    Deliveries more = protocol_.receive(rank, std::move(frames[i]));
    for (auto& m : more) out.push_back(std::move(m));
  }
}

// What a rank has sent, as much as is there (a bounded number of reads per turn, so one busy
// rank cannot starve the others).
void HubServer::serve(int rank) {
  Deliveries out;
  try {
    for (int k = 0; k < rounds_per_turn; ++k) {
      auto& link = ranks_[static_cast<std::size_t>(rank)];
      if (!link) return;
      std::vector<Datagram> frames;
      RecvStatus st = link->receive(frames, /*hello=*/false);
      take(rank, frames, 0, out);
      if (st == RecvStatus::closed) throw error("the connection closed");
      if (st == RecvStatus::would_block) break;
    }
    note_mid_message(rank);
  } catch (const std::exception& e) {
    // End of stream is how a rank leaves; anything else is a broken peer. Either way it is out.
    log::debug("{}: rank {} disconnected: {}", name_, rank, e.what());
    drop(rank, out);
  }
  deliver(std::move(out));
}

// A rank in the middle of a message has continuation_wait to send the rest.
void HubServer::note_mid_message(int rank) {
  const auto& link = ranks_[static_cast<std::size_t>(rank)];
  auto& deadline = rank_deadlines_[static_cast<std::size_t>(rank)];
  if (!link || !(protocol_.mid_message(rank) || link->partial()))
    deadline.reset();
  else if (!deadline)
    deadline = clock_type::now() + continuation_wait;
}

// A rank that started a message and stopped sending it is stuck or hostile: it leaves.
void HubServer::drop_stalled_ranks() {
  const auto now = clock_type::now();
  for (int r = 0; r < size(); ++r) {
    auto& d = rank_deadlines_[static_cast<std::size_t>(r)];
    if (!d || now < *d) continue;
    log::warn("{}: rank {} sent part of a message and nothing more for {} s; it leaves the group", name_, r,
              std::chrono::duration_cast<std::chrono::seconds>(continuation_wait).count());
    Deliveries out;
    drop(r, out);
    deliver(std::move(out));
  }
}

void HubServer::drop(int rank, Deliveries& out) {
  ranks_[static_cast<std::size_t>(rank)].reset();
  rank_deadlines_[static_cast<std::size_t>(rank)].reset();
  for (auto& d : protocol_.leave(rank)) out.push_back(std::move(d));
}

void HubServer::deliver(Deliveries out) {
  while (!out.empty()) {
    Deliveries next;
    for (auto& [rank, reply] : out) {
      auto& link = ranks_[static_cast<std::size_t>(rank)];
      if (!link) continue;
      try {
        EncodedReply e = encode_reply(reply);
        link->send(MessageType::reply, as_bytes(e.body), e.fds);
      } catch (const std::exception& e) {
        log::warn("{}: rank {} cannot be reached ({}); it leaves the group", name_, rank, e.what());
        drop(rank, next);
      }
    }
    out = std::move(next);
  }
}

}  // namespace torpor::detail
