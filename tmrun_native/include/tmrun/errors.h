// Errors of the tmrun communicators, translated to Python exceptions at the binding boundary
// (bind_comm.cpp: tmrun_native.CommError and its subclasses). The NCCL transport has its own
// (tmrun::nccl::Error, TimeoutError, UnavailableError in nccl_types.h): they carry NCCL result
// codes and surface as NcclError / NcclTimeoutError / NcclUnavailableError.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace tmrun {

class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A peer died, reset its connection, stopped answering, or was reported lost by a neighbour.
class PeerLostError : public CommError {
 public:
  PeerLostError(int peer_, uint64_t epoch_, int reporter_, const std::string& what)
      : CommError(what), peer(peer_), epoch(epoch_), reporter(reporter_) {}
  int peer;
  uint64_t epoch;
  int reporter;  // rank that observed the loss (this rank, or the neighbour that reported it)
};

// A malformed or foreign frame arrived on the link to `peer`; that link was closed.
class ProtocolError : public CommError {
 public:
  ProtocolError(int peer_, const std::string& what) : CommError(what), peer(peer_) {}
  int peer;
};

// A connection failed the job token's challenge-response (a different token, or none).
class AuthError : public CommError {
 public:
  using CommError::CommError;
};

// An operation exceeded op_timeout (or an epoch switch its deadline).
class CommTimeoutError : public CommError {
 public:
  using CommError::CommError;
};

}  // namespace tmrun
