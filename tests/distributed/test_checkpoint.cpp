// Optimizer checkpoints: a round trip, loading on another number of ranks and another
// layout (saved on 2 ranks, loaded on 3 and on 1), the step count and hyperparameters, and
// damaged checkpoints, which must fail on every rank with the running state untouched.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "../common/harness.h"
#include "../common/ns_runner.h"
#include "../common/reference.h"

namespace shardmuon_test {
namespace {

// A directory every rank of the world sees (they share a machine), made by rank 0.
std::string shared_temporary_directory() {
  char path[256] = {0};
  if (Harness::get().world_rank() == 0) {
    std::snprintf(path, sizeof path, "%s/shardmuon-checkpoint-XXXXXX",
                  std::filesystem::temp_directory_path().c_str());
    if (mkdtemp(path) == nullptr) path[0] = '\0';
  }
  MPI_Bcast(path, sizeof path, MPI_CHAR, 0, MPI_COMM_WORLD);
  return path;
}

// The state of an optimizer over three parameters, with its momentum in the backend's memory.
struct State {
  struct Param {
    std::string name;
    Matrix momentum;  // the logical matrix
    shardmuon_dtype dtype;
    shardmuon_partition partition;
    std::vector<int64_t> sizes;
    Buffer param_buffer, momentum_buffer;
  };
  std::vector<Param> params;
  std::vector<shardmuon_muon_param> api;
  std::vector<const char*> names;

  // The same logical matrices (from the seeds) under a layout chosen by `layout_kind`.
  State(const Group& group, int layout_kind, bool zero_momentum) {
    const int64_t shapes[3][2] = {{37, 53}, {64, 17}, {29, 31}};
    const shardmuon_dtype dtypes[3] = {SHARDMUON_FLOAT32, SHARDMUON_BFLOAT16, SHARDMUON_FLOAT32};
    const char* param_names[3] = {"layers.0.qkv.weight", "layers.0.out.weight", "head-proj_2"};
    for (int i = 0; i < 3; ++i) {
      Param p;
      p.name = param_names[i];
      p.dtype = dtypes[i];
      p.momentum = rounded_to(random_gaussian(shapes[i][0], shapes[i][1], 40 + i), p.dtype);
      // kind 0: dim 1, uneven; kind 1: dim 0, balanced; kind 2: replicated; kind 3: flat,
      // uneven (element ranges that start and end inside rows).
      const int kind = (layout_kind + i) % 4;
      p.partition = kind == 0   ? SHARDMUON_SHARDED_DIM1
                    : kind == 1 ? SHARDMUON_SHARDED_DIM0
                    : kind == 2 ? SHARDMUON_REPLICATED
                                : SHARDMUON_SHARDED_FLAT;
      if (kind == 0) p.sizes = uneven_sizes(shapes[i][1], group.size);
      if (kind == 1) p.sizes = balanced_sizes(shapes[i][0], group.size);
      if (kind == 3) p.sizes = uneven_sizes(shapes[i][0] * shapes[i][1], group.size);
      std::vector<double> shard = extract_shard(p.momentum, p.partition, p.sizes, group.rank);
      p.param_buffer = Harness::get().upload(to_bytes(shard, p.dtype));
      if (zero_momentum) shard.assign(shard.size(), 0.0);
      p.momentum_buffer = Harness::get().upload(to_bytes(shard, p.dtype));
      params.push_back(std::move(p));
    }
    for (Param& p : params) {
      shardmuon_muon_param a{};
      a.param = p.param_buffer.data();
      a.momentum = p.momentum_buffer.data();
      a.dtype = p.dtype;
      a.layout = make_layout(p.momentum, p.partition, group.size, p.sizes);
      a.no_grad = 1;
      api.push_back(a);
      names.push_back(p.name.c_str());
    }
  }

  std::vector<std::vector<unsigned char>> momentum_bytes() const {
    std::vector<std::vector<unsigned char>> bytes;
    for (const Param& p : params) bytes.push_back(Harness::get().download(p.momentum_buffer));
    return bytes;
  }
};

// Rewrites a safetensors file's JSON header with `edit` (the 8-byte length in front follows).
template <typename Edit>
void edit_safetensors_header(const std::string& file, Edit edit) {
  std::ifstream in(file, std::ios::binary);
  unsigned char length_bytes[8];
  in.read(reinterpret_cast<char*>(length_bytes), 8);
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | length_bytes[i];
  std::string header(length, ' ');
  in.read(header.data(), static_cast<std::streamsize>(length));
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  nlohmann::json parsed = nlohmann::json::parse(header);
  edit(parsed);
  header = parsed.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  length = header.size();
  for (unsigned char& byte : length_bytes) {
    byte = static_cast<unsigned char>(length & 0xff);
    length >>= 8;
  }
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(length_bytes), 8);
  out << header << data;
}

// The file rank 0 wrote in the directory.
std::string first_rank_file(const std::string& directory) {
  for (const auto& entry : std::filesystem::directory_iterator(directory)) {
    if (entry.path().filename().string().rfind("shardmuon-rank-00000", 0) == 0) {
      return entry.path().string();
    }
  }
  return std::string();
}

shardmuon_muon_group some_group(double lr) {
  shardmuon_muon_group group;
  shardmuon_muon_group_default(&group);
  group.lr = lr;
  group.momentum = 0.9;
  group.weight_decay_mode = SHARDMUON_WEIGHT_DECAY_L2;
  group.scale_mode = SHARDMUON_SCALE_UNIT_RMS_NORM;
  group.ns.schedule = SHARDMUON_SCHEDULE_POLAR_EXPRESS;
  group.ns.num_iterations = 8;
  group.ns_storage = SHARDMUON_NS_STORAGE_BFLOAT16;
  return group;
}

shardmuon_status save(const Group& group, State& state, const std::string& directory,
                      const shardmuon_muon_group& hyper, int64_t step) {
  return shardmuon_muon_save(
      Harness::get().context(), group.comm, directory.c_str(), state.api.data(), state.names.data(),
      static_cast<int>(state.api.size()), &hyper, 1, step, Harness::get().stream());
}

shardmuon_status load(const Group& group, State& state, const std::string& directory,
                      shardmuon_muon_group* hyper, int64_t* step) {
  return shardmuon_muon_load(
      Harness::get().context(), group.comm, directory.c_str(), state.api.data(), state.names.data(),
      static_cast<int>(state.api.size()), hyper, hyper ? 1 : 0, step, Harness::get().stream());
}

class Checkpoint : public DistributedTest {
 protected:
  void SetUp() override { directory_ = shared_temporary_directory(); }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (Harness::get().world_rank() == 0 && !directory_.empty()) {
      std::filesystem::remove_all(directory_);
    }
    DistributedTest::TearDown();
  }
  // Saves State(group, 0) with some_group(0.02) at `step` on the group's members. Every rank
  // of the world waits for the files and learns whether they were written, so that all stop
  // together if not (an early return on the savers alone would leave the others in the next
  // collective).
  bool saved_on(const Group& group, int64_t step) const {
    bool saved = true;
    if (group.member) {
      State state(group, 0, false);
      saved = save(group, state, directory_, some_group(0.02), step) == SHARDMUON_SUCCESS;
      EXPECT_TRUE(saved) << shardmuon_last_error();
    }
    return group_all(saved, MPI_COMM_WORLD);
  }

  std::string directory_;
};

// Saved on the largest group up to 2 ranks (flat, dim 1 and dim 0 shards); loaded on every
// group size (1..4 on the CPU), each time with other layouts, and compared with the logical
// momentum.
TEST_F(Checkpoint, LoadsOnAnyNumberOfRanksAndLayouts) {
  ASSERT_FALSE(directory_.empty());
  const int saver_size = std::min(2, Harness::get().max_group_size());
  const Group& saver = Harness::get().group(saver_size);
  bool saved = true;
  if (saver.member) {
    State state(saver, 3, false);
    const shardmuon_muon_group hyper = some_group(0.0123);
    saved = save(saver, state, directory_, hyper, 17) == SHARDMUON_SUCCESS;
    EXPECT_TRUE(saved) << shardmuon_last_error();
  }
  // Every rank waits for the files, and all stop together if they were not written (an early
  // return on the savers alone would leave the others in the next collective).
  if (!group_all(saved, MPI_COMM_WORLD)) return;
  for_each_group(1, [&](const Group& group) {
    const int p = group.size;
    for (int layout_kind = 0; layout_kind <= 2; ++layout_kind) {
      State state(group, layout_kind, /*zero_momentum=*/true);
      shardmuon_muon_group hyper;
      shardmuon_muon_group_default(&hyper);
      int64_t step = -1;
      ASSERT_TRUE(
          group_all(load(group, state, directory_, &hyper, &step) == SHARDMUON_SUCCESS, group.mpi))
          << shardmuon_last_error();
      EXPECT_EQ(step, 17);
      EXPECT_EQ(hyper.lr, 0.0123);
      EXPECT_EQ(hyper.momentum, 0.9);
      EXPECT_EQ(hyper.weight_decay_mode, SHARDMUON_WEIGHT_DECAY_L2);
      EXPECT_EQ(hyper.scale_mode, SHARDMUON_SCALE_UNIT_RMS_NORM);
      EXPECT_EQ(hyper.ns.schedule, SHARDMUON_SCHEDULE_POLAR_EXPRESS);
      EXPECT_EQ(hyper.ns.num_iterations, 8);
      EXPECT_EQ(hyper.ns_storage, SHARDMUON_NS_STORAGE_BFLOAT16);
      const auto loaded = state.momentum_bytes();
      for (size_t i = 0; i < state.params.size(); ++i) {
        const State::Param& param = state.params[i];
        // Saved in this dtype from the same (rounded) values: the round trip is exact.
        const std::vector<double> expected =
            extract_shard(param.momentum, param.partition, param.sizes, group.rank);
        EXPECT_EQ(from_bytes(loaded[i], param.dtype), expected)
            << param.name << " on " << p << " ranks, layout kind " << layout_kind;
      }
    }
  });
}

// Ranks that read two different saves of the same parameters (file systems that are not
// shared, here one relative path resolved from two working directories) are refused on every
// rank, with the running state untouched, instead of each loading its own.
TEST_F(Checkpoint, RanksThatReadDifferentSavesAreRefused) {
  ASSERT_FALSE(directory_.empty());
  const Group& group = Harness::get().group(Harness::get().max_group_size());
  if (!group.member) return;
  if (group.size < 2) GTEST_SKIP() << "needs 2 ranks";
  State state(group, 0, false);
  for (const char* copy : {"/a", "/b"}) {  // two saves of the same state: two tokens
    if (group.rank == 0) std::filesystem::create_directory(directory_ + copy);
    MPI_Barrier(group.mpi);
    ASSERT_EQ(save(group, state, directory_ + copy + "/checkpoint", some_group(0.01), 5),
              SHARDMUON_SUCCESS)
        << shardmuon_last_error();
  }
  const std::filesystem::path working = std::filesystem::current_path();
  std::filesystem::current_path(directory_ + (group.rank == 0 ? "/a" : "/b"));
  State loaded(group, 0, true);
  const auto before = loaded.momentum_bytes();
  int64_t step = -1;
  const shardmuon_status status = load(group, loaded, "checkpoint", nullptr, &step);
  const std::string error = shardmuon_last_error();
  std::filesystem::current_path(working);
  EXPECT_EQ(status, SHARDMUON_ERROR_RANK_MISMATCH) << error;
  EXPECT_NE(error.find("the checkpoint of token"), std::string::npos) << error;
  EXPECT_EQ(step, -1);
  EXPECT_EQ(loaded.momentum_bytes(), before);
}

// Loading without the groups leaves hyperparameters to the caller; into another dtype, the
// values are converted.
TEST_F(Checkpoint, LoadsWithoutGroupsAndIntoAnotherDtype) {
  const Group& group = Harness::get().group(1);
  if (group.member) {
    State state(group, 0, false);
    ASSERT_EQ(save(group, state, directory_, some_group(0.01), 3), SHARDMUON_SUCCESS)
        << shardmuon_last_error();
    State other(group, 0, true);
    // The first parameter was saved as float32; load it as bf16.
    std::vector<double> zeros(other.params[0].momentum.values.size(), 0.0);
    other.params[0].momentum_buffer = Harness::get().upload(to_bytes(zeros, SHARDMUON_BFLOAT16));
    other.api[0].momentum = other.params[0].momentum_buffer.data();
    other.params[0].param_buffer = Harness::get().upload(to_bytes(zeros, SHARDMUON_BFLOAT16));
    other.api[0].param = other.params[0].param_buffer.data();
    other.api[0].dtype = SHARDMUON_BFLOAT16;
    int64_t step = 0;
    ASSERT_EQ(load(group, other, directory_, nullptr, &step), SHARDMUON_SUCCESS)
        << shardmuon_last_error();
    EXPECT_EQ(step, 3);
    const auto loaded = other.momentum_bytes();
    EXPECT_EQ(from_bytes(loaded[0], SHARDMUON_BFLOAT16),
              rounded_to(state.params[0].momentum, SHARDMUON_BFLOAT16).values);
  }
}

// A group whose learning rate lives in device memory (lr_on_device) may leave lr NaN: the
// checkpoint records no lr and loading keeps the caller's, the pointer included.
TEST_F(Checkpoint, ADeviceLearningRateIsNotSavedAndLoadingKeepsTheCallers) {
  const Group& group = Harness::get().group(1);
  if (!group.member) return;
  const std::vector<unsigned char> bytes(sizeof(float), 0);
  const Buffer rate = Harness::get().upload(bytes);
  State state(group, 0, false);
  shardmuon_muon_group hyper = some_group(std::numeric_limits<double>::quiet_NaN());
  hyper.lr_on_device = static_cast<const float*>(rate.data());
  ASSERT_EQ(save(group, state, directory_, hyper, 5), SHARDMUON_SUCCESS) << shardmuon_last_error();
  State other(group, 0, true);
  shardmuon_muon_group loaded = some_group(0.25);
  loaded.lr_on_device = static_cast<const float*>(rate.data());
  loaded.momentum = 0.5;  // replaced by the saved 0.9
  int64_t step = 0;
  ASSERT_EQ(load(group, other, directory_, &loaded, &step), SHARDMUON_SUCCESS)
      << shardmuon_last_error();
  EXPECT_EQ(step, 5);
  EXPECT_EQ(loaded.lr, 0.25);
  EXPECT_EQ(loaded.momentum, 0.9);
  EXPECT_EQ(loaded.lr_on_device, static_cast<const float*>(rate.data()));
}

// A load replaces the caller's groups with the saved ones, so it checks them against the
// parameters as a step would: GRAM_ALLREDUCE, saved with shards along dim 0 and 1, cannot step
// the flat shard the last parameter has now. Every rank refuses, and nothing changes.
TEST_F(Checkpoint, SavedGroupsTheNewLayoutsCannotStepAreRefusedOnEveryRank) {
  const Group& group = Harness::get().group(std::min(2, Harness::get().max_group_size()));
  if (!group.member) return;
  State state(group, 0, false);
  shardmuon_muon_group saved = some_group(0.02);
  saved.ns.algorithm = SHARDMUON_NS_GRAM_ALLREDUCE;
  ASSERT_TRUE(group_all(save(group, state, directory_, saved, 6) == SHARDMUON_SUCCESS, group.mpi))
      << shardmuon_last_error();
  State flat(group, 1, true);
  ASSERT_EQ(flat.params[2].partition, SHARDMUON_SHARDED_FLAT);
  // What a step with the saved group says of these layouts.
  ASSERT_EQ(shardmuon_muon_plan(Harness::get().context(), group.comm, flat.api.data(),
                                static_cast<int>(flat.api.size()), &saved, 1, nullptr, nullptr),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  const auto before = flat.momentum_bytes();
  shardmuon_muon_group hyper = some_group(0.5);
  int64_t step = -7;
  const shardmuon_status status = load(group, flat, directory_, &hyper, &step);
  const std::string error = shardmuon_last_error();
  EXPECT_EQ(status, SHARDMUON_ERROR_INVALID_ARGUMENT) << error;
  EXPECT_NE(error.find("GRAM_ALLREDUCE needs shards along dim 0 or 1"), std::string::npos) << error;
  EXPECT_TRUE(group_all(status == SHARDMUON_ERROR_INVALID_ARGUMENT, group.mpi));
  EXPECT_EQ(flat.momentum_bytes(), before);
  EXPECT_EQ(step, -7);
  EXPECT_EQ(hyper.lr, 0.5);
  EXPECT_EQ(hyper.ns.algorithm, SHARDMUON_NS_AUTO);
}

// groups is output only: a zero-initialized array, which no step would accept, receives the
// saved groups.
TEST_F(Checkpoint, LoadsIntoAZeroInitializedGroupsArray) {
  const Group& group = Harness::get().group(std::min(2, Harness::get().max_group_size()));
  if (!group.member) return;
  State state(group, 0, false);
  const shardmuon_muon_group saved = some_group(0.0123);
  ASSERT_TRUE(group_all(save(group, state, directory_, saved, 11) == SHARDMUON_SUCCESS, group.mpi))
      << shardmuon_last_error();
  State other(group, 2, true);
  shardmuon_muon_group hyper{};
  int64_t step = 0;
  ASSERT_TRUE(
      group_all(load(group, other, directory_, &hyper, &step) == SHARDMUON_SUCCESS, group.mpi))
      << shardmuon_last_error();
  EXPECT_EQ(step, 11);
  EXPECT_EQ(hyper.lr, saved.lr);
  EXPECT_EQ(hyper.momentum, saved.momentum);
  EXPECT_EQ(hyper.nesterov, saved.nesterov);
  EXPECT_EQ(hyper.weight_decay, saved.weight_decay);
  EXPECT_EQ(hyper.weight_decay_mode, saved.weight_decay_mode);
  EXPECT_EQ(hyper.scale_mode, saved.scale_mode);
  EXPECT_EQ(hyper.extra_scale_factor, saved.extra_scale_factor);
  EXPECT_EQ(hyper.ns.num_iterations, saved.ns.num_iterations);
  EXPECT_EQ(hyper.ns.schedule, saved.ns.schedule);
  EXPECT_EQ(hyper.ns.eps, saved.ns.eps);
  EXPECT_EQ(hyper.ns.algorithm, saved.ns.algorithm);
  EXPECT_EQ(hyper.lr_on_device, nullptr);
  EXPECT_EQ(hyper.ns_storage, saved.ns_storage);
  const auto loaded = other.momentum_bytes();
  for (size_t i = 0; i < other.params.size(); ++i) {
    const State::Param& param = other.params[i];
    EXPECT_EQ(from_bytes(loaded[i], param.dtype),
              extract_shard(param.momentum, param.partition, param.sizes, group.rank))
        << param.name;
  }
}

// The index records each parameter's group: a load with groups refuses a parameter the caller
// now puts in another group than the one it was saved in (its momentum would step under the
// other group's hyperparameters), naming it and both groups. Without groups, or from an index
// written before the field existed, the assignment is the caller's and is not checked.
TEST_F(Checkpoint, AParameterSavedInAnotherGroupIsRefused) {
  const Group& group = Harness::get().group(std::min(2, Harness::get().max_group_size()));
  if (!group.member) return;
  State state(group, 0, false);
  state.api[1].group = 1;
  const shardmuon_muon_group saved[2] = {some_group(0.02), some_group(0.03)};
  ASSERT_TRUE(
      group_all(shardmuon_muon_save(Harness::get().context(), group.comm, directory_.c_str(),
                                    state.api.data(), state.names.data(), 3, saved, 2, 8,
                                    Harness::get().stream()) == SHARDMUON_SUCCESS,
                group.mpi))
      << shardmuon_last_error();
  State moved(group, 0, true);
  moved.api[2].group = 1;  // and params[1] in group 0
  const auto before = moved.momentum_bytes();
  shardmuon_muon_group hyper[2] = {some_group(0.5), some_group(0.5)};
  int64_t step = -7;
  auto load_moved = [&](shardmuon_muon_group* groups) {
    return shardmuon_muon_load(Harness::get().context(), group.comm, directory_.c_str(),
                               moved.api.data(), moved.names.data(), 3, groups,
                               groups != nullptr ? 2 : 0, &step, Harness::get().stream());
  };
  const shardmuon_status status = load_moved(hyper);
  const std::string error = shardmuon_last_error();
  EXPECT_EQ(status, SHARDMUON_ERROR_INVALID_ARGUMENT) << error;
  EXPECT_NE(error.find("params[1] \"layers.0.out.weight\" was saved in groups[1] but is now in "
                       "groups[0]"),
            std::string::npos)
      << error;
  EXPECT_TRUE(group_all(status == SHARDMUON_ERROR_INVALID_ARGUMENT, group.mpi));
  EXPECT_EQ(moved.momentum_bytes(), before);
  EXPECT_EQ(step, -7);
  EXPECT_EQ(hyper[0].lr, 0.5);
  // Without groups the caller's assignment stands.
  EXPECT_TRUE(group_all(load_moved(nullptr) == SHARDMUON_SUCCESS, group.mpi))
      << shardmuon_last_error();
  EXPECT_EQ(step, 8);
  // An index without the field (written before it existed) loads, unchecked.
  MPI_Barrier(group.mpi);
  if (group.rank == 0) {
    const std::string path = directory_ + "/shardmuon-checkpoint.json";
    nlohmann::json index = nlohmann::json::parse(std::ifstream(path));
    for (auto& [name, param] : index["params"].items()) {
      EXPECT_TRUE(param.contains("group")) << name;
      param.erase("group");
    }
    std::ofstream(path, std::ios::trunc) << index.dump();
  }
  MPI_Barrier(group.mpi);
  step = -7;
  EXPECT_TRUE(group_all(load_moved(hyper) == SHARDMUON_SUCCESS, group.mpi))
      << shardmuon_last_error();
  EXPECT_EQ(step, 8);
  EXPECT_EQ(hyper[1].lr, 0.03);
}

// A save removes the files of the checkpoint it replaces and the temporaries a crash left,
// named as the library names them, and nothing else: a user's file that merely starts like
// them stays.
TEST_F(Checkpoint, ASaveRemovesOnlyItsOwnFormerFiles) {
  const Group& group = Harness::get().group(std::min(2, Harness::get().max_group_size()));
  const bool rank0 = Harness::get().world_rank() == 0;
  const auto names_in = [&]() {
    std::set<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(directory_)) {
      names.insert(entry.path().filename().string());
    }
    return names;
  };
  if (!saved_on(group, 1)) return;
  const std::vector<std::string> users = {
      "shardmuon-rank-notes.txt",
      "shardmuon-checkpoint.json.bak",
      "shardmuon-checkpoint.json.tmp-draft",
      "shardmuon-rank-00000-of-00002-mine.safetensors",
      "shardmuon-rank-00000-of-00002-0123456789abcdef.safetensors.old",
      "my-shardmuon-rank-00000-of-00001-0123456789abcdef.safetensors"};
  const std::vector<std::string> leftovers = {
      "shardmuon-rank-00001-of-00004-0123456789abcdef.safetensors",
      "shardmuon-rank-00000-of-00002-0123456789abcdef.safetensors.tmp-123-4",
      "shardmuon-checkpoint.json.tmp-123-5"};
  std::set<std::string> former;
  if (rank0) {
    former = names_in();
    former.erase("shardmuon-checkpoint.json");
    EXPECT_EQ(former.size(), static_cast<size_t>(group.size));
    for (const std::string& name : users) std::ofstream(directory_ + "/" + name) << "mine";
    for (const std::string& name : leftovers) std::ofstream(directory_ + "/" + name) << "left";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (!saved_on(group, 2)) return;
  if (rank0) {
    const std::set<std::string> now = names_in();
    for (const std::string& name : users) EXPECT_EQ(now.count(name), 1u) << name;
    for (const std::string& name : leftovers) EXPECT_EQ(now.count(name), 0u) << name;
    for (const std::string& name : former) EXPECT_EQ(now.count(name), 0u) << name;
    // What remains besides: the index and one file per rank of the new save.
    EXPECT_EQ(now.size(), users.size() + 1 + group.size);
  }
}

// Damaged checkpoints: every rank gets an error, and no momentum buffer, step or group changes.
TEST_F(Checkpoint, DamagedCheckpointsFailCleanly) {
  const int p = std::min(2, Harness::get().max_group_size());
  const Group& group = Harness::get().group(p);
  struct Damage {
    const char* name;
    void (*apply)(const std::string& directory);
    const char* message;  // in the error of the rank that reads the damage
  };
  const Damage damages[] = {
      {"flipped data byte",
       [](const std::string& d) {
         const std::string file = first_rank_file(d);
         std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
         f.seekg(-3, std::ios::end);
         const char c = static_cast<char>(f.get());
         f.seekp(-3, std::ios::end);
         f.put(static_cast<char>(c ^ 0x10));
       },
       "is corrupted: the CRC-32"},
      {"truncated file",
       [](const std::string& d) {
         const std::string file = first_rank_file(d);
         std::filesystem::resize_file(file, std::filesystem::file_size(file) - 100);
       },
       "truncated?"},
      {"header garbage",
       [](const std::string& d) {
         std::fstream f(first_rank_file(d), std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(8);  // the header's opening brace
         f.write("]]]]", 4);
       },
       "is not JSON"},
      {"index garbage",
       [](const std::string& d) {
         std::ofstream(d + "/shardmuon-checkpoint.json") << "{\"format\": ";
       },
       "is not JSON"},
      {"negative step",
       [](const std::string& d) {
         const std::string index_path = d + "/shardmuon-checkpoint.json";
         nlohmann::json index = nlohmann::json::parse(std::ifstream(index_path));
         index["step"] = -3;
         std::ofstream(index_path) << index.dump();
       },
       "has step -3"},
      {"missing rank file",
       [](const std::string& d) { std::filesystem::remove(first_rank_file(d)); }, "cannot open"},
      {"missing index",
       [](const std::string& d) { std::filesystem::remove(d + "/shardmuon-checkpoint.json"); },
       "cannot open"},
      {"no record of the pieces",
       [](const std::string& d) {
         edit_safetensors_header(first_rank_file(d), [](nlohmann::json& header) {
           header["__metadata__"].erase("pieces");
         });
       },
       "has no record of its pieces"},
      {"a shape of more than 2^64 bytes",
       [](const std::string& d) {
         // A wrapped byte count could match the tensor's short range (4 x 2^62 x 4 = 2^66).
         edit_safetensors_header(first_rank_file(d), [](nlohmann::json& header) {
           for (auto& [name, entry] : header.items()) {
             if (name != "__metadata__") {
               entry["shape"] = {int64_t{1} << 62, 4};
               break;
             }
           }
         });
       },
       "more bytes than 2^64"},
      {"another save's token",
       [](const std::string& d) {
         // As if the file of another save had been copied in under this save's name.
         edit_safetensors_header(first_rank_file(d), [](nlohmann::json& header) {
           header["__metadata__"]["token"] = "0123456789abcdef";
         });
       },
       "belongs to another save than the index"},
      {"a missing piece",
       [](const std::string& d) {
         edit_safetensors_header(first_rank_file(d), [](nlohmann::json& header) {
           header.erase("head-proj_2");  // replicated: rank 0 wrote it, every rank reads it
         });
       },
       "lacks the 29 x 31 piece \"head-proj_2\""},
      {"a piece outside the matrix",
       [](const std::string& d) {
         const std::string index_path = d + "/shardmuon-checkpoint.json";
         nlohmann::json index = nlohmann::json::parse(std::ifstream(index_path));
         index["params"]["layers.0.qkv.weight"]["pieces"][0]["row0"] = 30;  // of 37 rows, 37 high
         std::ofstream(index_path, std::ios::trunc) << index.dump();
       },
       "elements, outside its 37 x 53"},
  };
  for (const Damage& damage : damages) {
    if (!saved_on(group, 9)) return;
    if (Harness::get().world_rank() == 0) damage.apply(directory_);
    MPI_Barrier(MPI_COMM_WORLD);
    if (!group.member) continue;
    State state(group, 0, true);
    const auto before = state.momentum_bytes();
    shardmuon_muon_group hyper = some_group(0.5);
    int64_t step = -7;
    const shardmuon_status status = load(group, state, directory_, &hyper, &step);
    const std::string error = shardmuon_last_error();
    EXPECT_NE(status, SHARDMUON_SUCCESS) << damage.name;
    if (status == SHARDMUON_ERROR_INVALID_ARGUMENT) {
      EXPECT_NE(error.find(damage.message), std::string::npos)
          << damage.name << ": \"" << error << "\" lacks \"" << damage.message << "\"";
    } else {
      EXPECT_EQ(status, SHARDMUON_ERROR_PEER_FAILED) << damage.name << ": " << error;
    }
    EXPECT_TRUE(group_all(status == SHARDMUON_ERROR_INVALID_ARGUMENT, group.mpi) || group.size > 1)
        << damage.name;
    EXPECT_EQ(state.momentum_bytes(), before) << damage.name;
    EXPECT_EQ(step, -7) << damage.name;
    EXPECT_EQ(hyper.lr, 0.5) << damage.name;
  }
}

// A name that is not in the checkpoint, or a shape that changed: errors naming the parameter.
TEST_F(Checkpoint, MismatchedParametersAreNamed) {
  const Group& group = Harness::get().group(1);
  if (!group.member) return;
  State state(group, 0, false);
  ASSERT_EQ(save(group, state, directory_, some_group(0.02), 1), SHARDMUON_SUCCESS);
  int64_t step = 0;
  State renamed(group, 0, true);
  renamed.names[1] = "layers.0.renamed.weight";
  EXPECT_EQ(load(group, renamed, directory_, nullptr, &step), SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error())
                .find("\"layers.0.renamed.weight\" is not in the checkpoint"),
            std::string::npos)
      << shardmuon_last_error();
  State reshaped(group, 0, true);
  reshaped.api[2].layout.cols = 30;
  reshaped.api[2].layout.partition = SHARDMUON_REPLICATED;
  EXPECT_EQ(load(group, reshaped, directory_, nullptr, &step), SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("was saved as 29 x 31"), std::string::npos)
      << shardmuon_last_error();
  const char* bad_names[] = {"a", "a", "b"};
  EXPECT_EQ(shardmuon_muon_load(Harness::get().context(), group.comm, directory_.c_str(),
                                state.api.data(), bad_names, 3, nullptr, 0, &step,
                                Harness::get().stream()),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("is not unique"), std::string::npos);
  // safetensors keeps its metadata under this key: a parameter of that name could be saved
  // but never loaded.
  const char* metadata_name[] = {"a", "__metadata__", "b"};
  const shardmuon_muon_group hyper = some_group(0.1);
  EXPECT_EQ(shardmuon_muon_save(Harness::get().context(), group.comm, directory_.c_str(),
                                state.api.data(), metadata_name, 3, &hyper, 1, 2,
                                Harness::get().stream()),
            SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("safetensors header's own key"),
            std::string::npos)
      << shardmuon_last_error();
}

// The index is read, not trusted: pieces that overlap must not pass for a full cover even when
// their element counts add up (saved on 2 ranks, one piece listed in place of the other, loaded
// on 1: the old count-based check loaded half of the matrix as zeros).
TEST_F(Checkpoint, AnIndexWhosePiecesOverlapIsRefused) {
  if (Harness::get().max_group_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const Group& pair = Harness::get().group(2);
  if (!saved_on(pair, 4)) return;
  if (Harness::get().world_rank() == 0) {
    const std::string path = directory_ + "/shardmuon-checkpoint.json";
    nlohmann::json index = nlohmann::json::parse(std::ifstream(path));
    // Layout kind 0 gives its second parameter balanced row blocks: two pieces of one size.
    nlohmann::json& pieces = index["params"]["layers.0.out.weight"]["pieces"];
    ASSERT_EQ(pieces.size(), 2u);
    pieces[1] = pieces[0];
    std::ofstream(path, std::ios::trunc) << index.dump();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const Group& single = Harness::get().group(1);
  if (!single.member) return;
  State state(single, 1, true);
  const auto before = state.momentum_bytes();
  int64_t step = -1;
  EXPECT_EQ(load(single, state, directory_, nullptr, &step), SHARDMUON_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardmuon_last_error()).find("\"layers.0.out.weight\" overlap"),
            std::string::npos)
      << shardmuon_last_error();
  EXPECT_EQ(state.momentum_bytes(), before);
  EXPECT_EQ(step, -1);
}

}  // namespace
}  // namespace shardmuon_test
