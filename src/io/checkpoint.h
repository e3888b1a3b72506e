// Optimizer checkpoints: a layout-independent format (docs/CHECKPOINT.md). Each rank writes
// the pieces of the momentum buffers it holds with their place in the logical matrices; an
// index written last by rank 0 lists every piece. Loading reads, for each parameter, the
// pieces that overlap this rank's shard in whatever layout it has now.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/backend.h"
#include "core/muon_step.h"

namespace shardmuon {

// Checks parameter names (non-NULL, unique, 1-200 bytes of [A-Za-z0-9_.-]).
std::vector<std::string> validate_checkpoint_names(const char* const* names, int num_params);

// Collective; arguments validated and agreed on. Throws on every rank if any rank fails.
void save_muon_checkpoint(Backend& backend, Communicator& comm, const std::string& directory,
                          const ValidatedMuonStep& params, const std::vector<std::string>& names,
                          const shardmuon_muon_group* groups, int num_groups, int64_t step,
                          Stream stream);

// Collective. Reads and checks everything, agrees that every rank succeeded, and only then
// writes the momentum buffers, *step and (if not NULL) groups.
void load_muon_checkpoint(Backend& backend, Communicator& comm, const std::string& directory,
                          const ValidatedMuonStep& params, const std::vector<std::string>& names,
                          shardmuon_muon_group* groups, int num_groups, int64_t* step,
                          Stream stream);

}  // namespace shardmuon
