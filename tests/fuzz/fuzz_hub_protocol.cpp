// Fuzz target: the Unix socket group's hub protocol (ranks/groups/hub/hub_protocol.hpp) without
// sockets. The input is read as datagrams from four connections of a 3-rank group: hellos (right or wrong
// secret, any rank, size, version), raw bytes, well-formed frames of any type with fuzzed bodies
// (contributions of every collective kind, give-ups, recoveries), datagrams carrying
// descriptors, and connections that go away. What the server does with each is what
// hub_server.cpp does: a connection's first datagram goes to admit(), later ones to receive(),
// and a torpor::error from receive() drops that rank (leave()).
//
// Oracle: no crash or sanitizer report; only torpor::error escapes the protocol; every delivery
// goes to a rank of the group, and its encoded reply decodes back to the same header.
#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ranks/groups/hub/hub_protocol.hpp"

namespace {

using namespace torpor;
using namespace torpor::detail;

constexpr int group_size = 3;
const std::string secret(64, 'a');

class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : p_(data), end_(data + size) {}
  bool done() const { return p_ >= end_; }
  std::uint8_t byte() { return p_ < end_ ? *p_++ : 0; }
  std::uint64_t u64(int bytes) {
    std::uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v = v << 8 | byte();
    return v;
  }
  std::vector<std::byte> bytes(std::size_t max) {
    std::vector<std::byte> v(std::min<std::size_t>(byte() % (max + 1), static_cast<std::size_t>(end_ - p_)));
    for (auto& b : v) b = static_cast<std::byte>(byte());
    return v;
  }

 private:
  const std::uint8_t* p_;
  const std::uint8_t* end_;
};

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_hub_protocol: %s\n", what.c_str());
  std::abort();
}

void check_deliveries(Deliveries& ds) {
  for (auto& [rank, reply] : ds) {
    if (rank < 0 || rank >= group_size) fail("a delivery to rank " + std::to_string(rank));
    EncodedReply e = encode_reply(reply);
    Message m;
    m.type = MessageType::reply;
    m.body = e.body;
    for (int fd : e.fds) m.fds.emplace_back(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    Received r = decode_reply(m);
    if (r.type != reply.type || r.generation != reply.generation || r.sequence != reply.sequence ||
        r.missing != reply.missing || r.message != reply.message)
      fail("a reply does not decode to what was encoded");
  }
}

Datagram datagram(std::vector<std::byte> bytes, int fds = 0) {
  Datagram d;
  d.bytes = std::move(bytes);
  for (int i = 0; i < fds; ++i) d.fds.emplace_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  return d;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const pid_t hub_pid = ::getpid();
  HubProtocol hub(group_size, secret, hub_pid);
  std::array<int, 4> rank_of{-1, -1, -1, -1};  // per connection: its rank once welcomed
  std::array<bool, 4> open{true, true, true, true};
  Input in(data, size);
  try {
    for (int step = 0; step < 256 && !in.done(); ++step) {
      const std::uint8_t op = in.byte();
      const std::size_t c = (op >> 4) % 4;
      if (!open[c]) continue;
      Datagram d;
      switch (op % 6) {
        case 0: {  // a hello, mostly well-formed
          const std::uint8_t how = in.byte();
          const int rank = static_cast<int>(in.byte() % 5) - 1;
          const int claimed_size = how & 1 ? group_size : static_cast<int>(in.byte()) - 1;
          std::vector<std::byte> h = encode_hello(rank, claimed_size, how & 2 ? secret : std::string(64, 'b'));
          if (how & 4) h[in.byte() % h.size()] ^= static_cast<std::byte>(in.byte() | 1);
          if (how & 8) h.resize(in.byte() % (h.size() + 8));
          d = datagram(std::move(h), how & 16 ? 1 : 0);
          break;
        }
        case 1: d = datagram(in.bytes(255)); break;
        case 2:
        case 3: {  // one frame of a message, body from the input
          const auto type = static_cast<MessageType>(in.byte() % 11);
          Writer w;
          w.put<std::uint64_t>(in.u64(1)).put<std::uint64_t>(in.u64(1));
          if (type == MessageType::contribute) {
            w.put<std::uint8_t>(in.byte() % 6);
            auto b = in.bytes(64);
            w.put_bytes(b.data(), b.size());
          } else if (type == MessageType::give_up) {
            w.put<double>(static_cast<double>(in.byte()));
          }
          std::vector<std::byte> body = w.take();
          if (in.byte() % 8 == 0) body.resize(in.byte() % (body.size() + 1));
          d = datagram(encode_frame(type, body), type == MessageType::contribute ? in.byte() % 3 : 0);
          break;
        }
        case 4: {  // a frame header announcing more than it holds: the start of a long message
          FrameHeader h{frame_magic, static_cast<std::uint8_t>(MessageType::contribute), {}, 0, 0, 0, 0};
          auto b = in.bytes(32);
          h.frame_bytes = static_cast<std::uint32_t>(b.size());
          h.total_bytes = b.size() + in.u64(3);
          h.total_fds = in.byte() % 4;
          std::vector<std::byte> frame(sizeof h);
          std::memcpy(frame.data(), &h, sizeof h);
          frame.insert(frame.end(), b.begin(), b.end());
          d = datagram(std::move(frame));
          break;
        }
        default: {  // the connection goes away
          open[c] = false;
          if (rank_of[c] >= 0) {
            Deliveries ds = hub.leave(rank_of[c]);
            check_deliveries(ds);
          }
          continue;
        }
      }
      if (rank_of[c] < 0) {
        HubProtocol::Admission a = hub.admit(d, c == 0 ? hub_pid : hub_pid + 1 + static_cast<pid_t>(c));
        if (a.rank >= 0)
          rank_of[c] = a.rank;
        else if (a.refusal.empty())
          fail("neither a rank nor a refusal");
        continue;
      }
      Deliveries ds;
      try {
        ds = hub.receive(rank_of[c], std::move(d));
      } catch (const error&) {
        open[c] = false;
        ds = hub.leave(rank_of[c]);
      }
      check_deliveries(ds);
    }
  } catch (const error& e) {
    fail(std::string("an error escaped the server's handling: ") + e.what());
  } catch (const std::exception& e) {
    fail(std::string("not a torpor::error: ") + e.what());
  }
  return 0;
}
