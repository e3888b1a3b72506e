// A group of one rank: every collective is the identity.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace shardmuon {

std::unique_ptr<Communicator> make_self_communicator();

// MPI and NCCL communicators; when the library is built without them these throw NOT_BUILT.
// mpi_comm is the address of an MPI_Comm; nccl_comm is an ncclComm_t.
std::unique_ptr<Communicator> make_mpi_communicator(const void* mpi_comm);
std::unique_ptr<Communicator> make_nccl_communicator(void* nccl_comm);

// Collectives implemented by the caller (see shardmuon_comm_callbacks).
std::unique_ptr<Communicator> make_callback_communicator(const shardmuon_comm_callbacks& callbacks,
                                                         shardmuon_backend backend);

}  // namespace shardmuon
