// Who is at the other end of a client's gRPC connection, for a client on
// this host: the uid that owns its TCP socket, from the kernel's socket
// tables (/proc/net/tcp, /proc/net/tcp6).
//
// The daemon maps a co-located client's shared-memory buffers (named by
// packed UCX keys the client sends) and copies blocks into and out of them.
// The segment a key names must then belong to the client's own user, or a
// client could make the daemon read or write another user's shared memory.
// A same-user process can already read and write that memory (ptrace), so
// the uid is the boundary that matters.
#ifndef KVDEPOT_SERVER_PEER_CREDENTIALS_H_
#define KVDEPOT_SERVER_PEER_CREDENTIALS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"

namespace kvdepot {

// The uid owning the local TCP socket at the address gRPC reports as a
// call's peer ("ipv4:127.0.0.1:41234", "ipv6:[::1]:41234",
// "ipv6:[::ffff:127.0.0.1]:41234"), found when that socket is connected to
// one of this process's own sockets: a process on this host, in this network
// namespace. Several sockets may share a local address (connected to
// different destinations, or bound with SO_REUSEADDR), so the peer's socket
// is the one whose other end is ours; when that is not exactly one socket,
// the answer is nullopt. Nullopt also for another host, a unix socket, an
// address that does not parse, or a connection that is gone.
std::optional<uint32_t> LocalPeerUid(absl::string_view grpc_peer);

// Whether gRPC peer `grpc_peer`'s address is this host's: loopback
// (127.0.0.0/8, ::1, their v4-mapped forms) or an address of one of its
// interfaces (getifaddrs). LocalPeerUid reads no socket table for another.
bool PeerIsOnThisHost(absl::string_view grpc_peer);

// The same, with the socket tables read from `proc_net` (a directory with
// files tcp and tcp6 in /proc/net's format) and this process's sockets given
// by their inodes, for tests.
std::optional<uint32_t> LocalPeerUid(absl::string_view grpc_peer,
                                     const std::string& proc_net,
                                     const absl::flat_hash_set<uint64_t>& own_inodes);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_PEER_CREDENTIALS_H_
