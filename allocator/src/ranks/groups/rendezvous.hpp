// The rendezvous directory of a Unix socket group (Rendezvous in group.hpp), and the checks both
// ends make before they trust it.
//
// A rendezvous directory (mode 0700, this user's) holds group.sock, the hub's socket;
// group.lock, flock'd by the hub for its life (whoever holds it serves the socket: flock locks
// die with their process, so a crashed hub's socket may be replaced, a live one never); and
// owner, the creating process's pid and start time. Rendezvous::create() removes the
// directories of this user whose creator is dead and whose lock is free (a crashed run's), and
// every path out of a group removes its own.
#pragma once

#include <sys/un.h>

#include <string>

namespace torpor::detail {

inline constexpr const char* rendezvous_lock_name = "group.lock";
inline constexpr const char* rendezvous_owner_name = "owner";

// Throws error unless `dir` is a directory of this user with mode 0700: exported GPU memory must
// never reach another user.
void check_private_directory(const std::string& dir);
// The address of the socket at `path`; invalid_argument when the path is too long for one.
sockaddr_un socket_address(const std::string& path);

}  // namespace torpor::detail
