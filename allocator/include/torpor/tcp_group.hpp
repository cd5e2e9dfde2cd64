// TcpGroup: a Group whose ranks share no Unix socket and meet only over TCP: ranks of several
// nodes (the multi-node NVLink layout, launched by torchrun or Slurm), or a loopback stand-in for
// them in tests. It carries bytes only (carries_fds() is false): a symmetric heap over it shares
// memory as fabric handles.
//
// Rank 0 listens on (host, port) and serves the group's rendezvous (the same hub as
// UnixSocketGroup: collectives matched by order, a timeout on every wait naming the ranks that did
// not arrive, recover(), a rank whose connection closed is named at once by group_rank_left).
// Every rank, rank 0 included, connects to it. The hello carries a 64-hex-digit secret; the
// default (from tcp_group_from_env) is all zeros, which authenticates nothing: like
// torch.distributed's TCPStore, the group trusts its network. Pass a secret shared by the
// launcher when it does not.
#pragma once

#include <memory>
#include <string>

#include "torpor/group.hpp"

namespace torpor {

struct TcpEndpoint {
  std::string host = "127.0.0.1";  // a name or an IPv4/IPv6 address rank 0 listens on
  int port = 0;                    // 1..65535; 0 on rank 0: any free port (port() tells which)
  std::string secret;              // 64 hex digits; "" = all zeros
};

class TcpGroup final : public Group {
 public:
  // Returns once every rank has joined, or throws group_timeout naming the ranks that never came.
  // rank in [0, size), size in [1, 65536], a port in [0, 65535] (0 only on rank 0): else
  // invalid_argument. A port rank 0 cannot bind is an error naming host and port.
  TcpGroup(const TcpEndpoint& endpoint, int rank, int size, const GroupOptions& options = {});
  ~TcpGroup() override;
  TcpGroup(const TcpGroup&) = delete;
  TcpGroup& operator=(const TcpGroup&) = delete;

  int rank() const noexcept override;
  int size() const noexcept override;
  std::string_view kind() const noexcept override { return "tcp"; }
  bool carries_fds() const noexcept override { return false; }
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override;
  // Always invalid_state: descriptors cannot travel over TCP (share memory as fabric handles).
  std::vector<std::vector<UniqueFd>> all_gather_fds(std::span<const int> mine) override;
  void barrier() override;
  void recover() override;

  // The port rank 0 listens on (the one it was given, or the one the kernel chose for 0).
  int port() const noexcept;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// A TcpGroup from the launcher's environment: MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE
// (torchrun's; set them from SLURM_* under srun). Rank 0 listens on MASTER_PORT + 1, because
// torch.distributed's own store holds MASTER_PORT itself. Throws invalid_argument naming a
// missing or malformed variable.
std::unique_ptr<TcpGroup> tcp_group_from_env(const GroupOptions& options = {});

// What the launcher says about this process's place (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE); nothing when RANK or WORLD_SIZE is unset. The local values default to the
// global ones (one node); nodes = world_size / local_world_size.
struct LauncherLayout {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node() const noexcept { return rank / local_world_size; }
  int nodes() const noexcept { return world_size / local_world_size; }
};
// Throws invalid_argument when the values contradict each other (LOCAL_RANK >= LOCAL_WORLD_SIZE,
// WORLD_SIZE not a multiple of LOCAL_WORLD_SIZE, ...).
std::unique_ptr<LauncherLayout> launcher_layout_from_env();

}  // namespace torpor
