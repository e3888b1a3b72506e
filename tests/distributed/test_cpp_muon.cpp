// The C++ Muon class: the same bits as the C API step on the same inputs, and a run saved
// and loaded into a new optimizer continues exactly as the uninterrupted one.
#include <gtest/gtest.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "../common/harness.h"
#include "../common/ns_runner.h"
#include "../common/reference.h"
#include "shardmuon/shardmuon.hpp"

namespace shardmuon_test {
namespace {

constexpr int kParams = 3;
const int64_t kShapes[kParams][2] = {{45, 19}, {23, 50}, {17, 30}};
const shardmuon_dtype kDtypes[kParams] = {SHARDMUON_BFLOAT16, SHARDMUON_FLOAT32, SHARDMUON_FLOAT32};
// Rows, columns, and a flat (ZeRO-style) range of the elements.
const shardmuon_partition kPartitions[kParams] = {SHARDMUON_SHARDED_DIM0, SHARDMUON_SHARDED_DIM1,
                                                  SHARDMUON_SHARDED_FLAT};

std::vector<int64_t> sizes_of(int i, const Group& group) {
  return uneven_sizes(sharded_extent(kShapes[i][0], kShapes[i][1], kPartitions[i]), group.size);
}

shardmuon_partition partition_of(int i) {
  return kPartitions[i];
}

shardmuon::Layout layout_of(int i, const Group& group) {
  if (kPartitions[i] == SHARDMUON_SHARDED_FLAT) {
    return shardmuon::Layout::flat(kShapes[i][0], kShapes[i][1], sizes_of(i, group));
  }
  const int dim = kPartitions[i] == SHARDMUON_SHARDED_DIM0 ? 0 : 1;
  return shardmuon::Layout::sharded(kShapes[i][0], kShapes[i][1], dim, sizes_of(i, group));
}

// This rank's shard of parameter i of a random matrix, in the backend's memory.
Buffer upload_shard(int i, const Group& group, uint64_t seed, double scale = 1.0) {
  Matrix m = random_gaussian(kShapes[i][0], kShapes[i][1], seed);
  for (double& v : m.values) v *= scale;
  return Harness::get().upload(
      to_bytes(extract_shard(m, partition_of(i), sizes_of(i, group), group.rank), kDtypes[i]));
}

// The largest group of ranks, with the harness's context and the group's communicator in the
// class's (borrowed) wrappers: what the tests here run on.
struct OnTheLargestGroup {
  const Harness& harness = Harness::get();
  const Group& group = harness.group(harness.max_group_size());
  const shardmuon::Context context = shardmuon::Context::borrow(harness.context());
  const shardmuon::Comm comm = shardmuon::Comm::borrow(group.comm);
};

class CppMuon : public DistributedTest, protected OnTheLargestGroup {};

TEST_F(CppMuon, MatchesTheCApiAndResumesFromACheckpoint) {
  if (!group.member) return;
  shardmuon_muon_group hyper = shardmuon::default_muon_group();
  hyper.lr = 0.02;

  // The class's parameters, and a copy driven through the C API with its own momentum.
  std::vector<Buffer> class_params, c_params, c_momentum, grads[3];
  shardmuon::Muon muon(context, comm, {hyper});
  std::vector<shardmuon_muon_param> c_batch(kParams);
  for (int i = 0; i < kParams; ++i) {
    class_params.push_back(upload_shard(i, group, 10 + i, 0.05));
    c_params.push_back(upload_shard(i, group, 10 + i, 0.05));
    c_momentum.push_back(upload_shard(i, group, 10 + i, 0.0));  // zeros, like the class's
    for (int s = 0; s < 3; ++s) grads[s].push_back(upload_shard(i, group, 20 + 10 * s + i));
    muon.add_parameter("p" + std::to_string(i), class_params[i].data(), kDtypes[i],
                       layout_of(i, group));
  }
  std::vector<std::vector<int64_t>> c_sizes;
  for (int i = 0; i < kParams; ++i) c_sizes.push_back(sizes_of(i, group));
  for (int i = 0; i < kParams; ++i) {
    c_batch[i].param = c_params[i].data();
    c_batch[i].momentum = c_momentum[i].data();
    c_batch[i].dtype = kDtypes[i];
    c_batch[i].layout = shardmuon_layout{kShapes[i][0], kShapes[i][1], partition_of(i), group.size,
                                         c_sizes[i].data()};
  }

  auto c_step = [&](int s) {
    for (int i = 0; i < kParams; ++i) c_batch[i].grad = grads[s][i].data();
    ASSERT_EQ(shardmuon_muon_step(harness.context(), group.comm, c_batch.data(), kParams, &hyper, 1,
                                  harness.stream()),
              SHARDMUON_SUCCESS)
        << shardmuon_last_error();
  };
  auto class_grads = [&](int s) {
    std::vector<std::optional<const void*>> g;
    for (int i = 0; i < kParams; ++i) g.emplace_back(grads[s][i].data());
    return g;
  };

  for (int s = 0; s < 2; ++s) {
    hyper.lr = 0.02 / (s + 1);
    muon.groups()[0].lr = hyper.lr;
    muon.step(class_grads(s), harness.stream());
    c_step(s);
  }
  EXPECT_EQ(muon.steps_taken(), 2);
  for (int i = 0; i < kParams; ++i) {
    EXPECT_EQ(harness.download(class_params[i]), harness.download(c_params[i])) << "param " << i;
    EXPECT_EQ(harness.download(muon.momentum(i), c_momentum[i].bytes()),
              harness.download(c_momentum[i]))
        << "momentum " << i;
  }

  // Save, load into a new optimizer over the same parameters, and take the third step in both.
  std::string directory;
  {
    char path[256] = {0};
    if (harness.world_rank() == 0) {
      std::snprintf(path, sizeof path, "%s/shardmuon-cpp-XXXXXX",
                    std::filesystem::temp_directory_path().c_str());
      if (mkdtemp(path) == nullptr) path[0] = '\0';
    }
    MPI_Bcast(path, sizeof path, MPI_CHAR, 0, group.mpi);
    directory = path;
  }
  ASSERT_FALSE(directory.empty());
  muon.save(directory, harness.stream());

  shardmuon::Muon resumed(context, comm, {shardmuon::default_muon_group()});
  for (int i = 0; i < kParams; ++i) {
    resumed.add_parameter("p" + std::to_string(i), class_params[i].data(), kDtypes[i],
                          layout_of(i, group));
  }
  resumed.load(directory, harness.stream());
  EXPECT_EQ(resumed.steps_taken(), 2);
  EXPECT_EQ(resumed.groups()[0].lr, hyper.lr);
  for (int i = 0; i < kParams; ++i) {
    EXPECT_EQ(harness.download(resumed.momentum(i), c_momentum[i].bytes()),
              harness.download(c_momentum[i]))
        << "loaded momentum " << i;
  }
  resumed.step(class_grads(2), harness.stream());
  c_step(2);
  for (int i = 0; i < kParams; ++i) {
    EXPECT_EQ(harness.download(class_params[i]), harness.download(c_params[i])) << "param " << i;
    EXPECT_EQ(harness.download(resumed.momentum(i), c_momentum[i].bytes()),
              harness.download(c_momentum[i]))
        << "momentum " << i;
  }
  EXPECT_EQ(resumed.steps_taken(), 3);

  // A gradient list of the wrong length is refused with the counts.
  try {
    resumed.step({}, harness.stream());
    ADD_FAILURE() << "no exception";
  } catch (const shardmuon::Error& e) {
    const std::string expected = "0 gradients for " + std::to_string(kParams) + " parameters";
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
  // So is a layout listing shard sizes for another number of ranks (the momentum buffer is
  // sized from this rank's entry before the library sees the layout).
  try {
    std::vector<int64_t> sizes(group.size + 1, 1);
    sizes[0] = 8 - group.size;
    resumed.add_parameter("wrong", class_params[0].data(), SHARDMUON_FLOAT32,
                          shardmuon::Layout::sharded(8, 4, 0, sizes));
    ADD_FAILURE() << "no exception";
  } catch (const shardmuon::Error& e) {
    EXPECT_EQ(e.status(), SHARDMUON_ERROR_INVALID_ARGUMENT);
    const std::string expected = "lists " + std::to_string(group.size + 1) + " shard sizes";
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
  MPI_Barrier(group.mpi);
  if (group.rank == 0) std::filesystem::remove_all(directory);
}

// The Context's non-finite settings: a step flag set on rank 0 skips the class's step on
// every rank (counted), and under RAISE the step throws with the library's status.
TEST_F(CppMuon, TheContextsStepFlagAndPolicySkipOrRaise) {
  if (!group.member) return;
  shardmuon::Muon muon(context, comm, {shardmuon::default_muon_group()});
  Buffer param = upload_shard(1, group, 31, 0.05);
  const Buffer grad = upload_shard(1, group, 32);
  const std::vector<unsigned char> before = harness.download(param);
  muon.add_parameter("p", param.data(), kDtypes[1], layout_of(1, group));
  const Buffer flag = harness.upload(to_bytes({group.rank == 0 ? 1.0 : 0.0}, SHARDMUON_FLOAT32));
  struct Restore {  // the harness's context, for the tests after this one
    const shardmuon::Context& context;
    ~Restore() {
      shardmuon_context_set_nonfinite_policy(context.get(), SHARDMUON_NONFINITE_SKIP);
      shardmuon_context_set_step_flag(context.get(), nullptr);
    }
  } restore{context};
  context.set_step_flag(static_cast<float*>(flag.data()));
  const shardmuon::Context::NonfiniteCounts counts = context.nonfinite_counts();
  muon.step({grad.data()}, harness.stream());
  EXPECT_EQ(harness.download(param), before);
  EXPECT_EQ(context.nonfinite_counts().skipped_steps, counts.skipped_steps + 1);
  context.set_nonfinite_policy(SHARDMUON_NONFINITE_RAISE);
  harness.upload_into(flag.data(), to_bytes({group.rank == 0 ? 1.0 : 0.0}, SHARDMUON_FLOAT32));
  try {
    muon.step({grad.data()}, harness.stream());
    ADD_FAILURE() << "no exception";
  } catch (const shardmuon::Error& e) {
    EXPECT_EQ(e.status(), SHARDMUON_ERROR_NON_FINITE) << e.what();
  }
  EXPECT_EQ(harness.download(param), before);
  context.set_nonfinite_policy(SHARDMUON_NONFINITE_SKIP);
  context.set_step_flag(nullptr);
  muon.step({grad.data()}, harness.stream());
  EXPECT_TRUE(before.empty() || harness.download(param) != before);  // an empty shard: nothing
}

// The class keeps the handles it is given, not their wrappers: a Muon built from temporaries
// (the borrow() wrappers of a training loop's handles), or from a Context moved after, steps
// as one built from named wrappers does.
TEST_F(CppMuon, KeepsTheHandlesItIsGivenNotTheirWrappers) {
  if (!group.member) return;
  const Buffer grad = upload_shard(1, group, 42);
  Buffer named_param = upload_shard(1, group, 41, 0.05);
  Buffer temporaries_param = upload_shard(1, group, 41, 0.05);
  Buffer moved_param = upload_shard(1, group, 41, 0.05);

  shardmuon::Muon named(context, comm, {shardmuon::default_muon_group()});
  shardmuon::Muon from_temporaries(shardmuon::Context::borrow(harness.context()),
                                   shardmuon::Comm::borrow(group.comm),
                                   {shardmuon::default_muon_group()});
  shardmuon::Context movable = shardmuon::Context::borrow(harness.context());
  shardmuon::Muon from_moved(movable, comm, {shardmuon::default_muon_group()});
  const shardmuon::Context moved_to = std::move(movable);

  named.add_parameter("p", named_param.data(), kDtypes[1], layout_of(1, group));
  from_temporaries.add_parameter("p", temporaries_param.data(), kDtypes[1], layout_of(1, group));
  from_moved.add_parameter("p", moved_param.data(), kDtypes[1], layout_of(1, group));
  for (int step = 0; step < 2; ++step) {
    named.step({grad.data()}, harness.stream());
    from_temporaries.step({grad.data()}, harness.stream());
    from_moved.step({grad.data()}, harness.stream());
  }
  EXPECT_EQ(harness.download(temporaries_param), harness.download(named_param));
  EXPECT_EQ(harness.download(moved_param), harness.download(named_param));
}

// A Context and Comm that own their handles, passed as temporaries, are taken over and live
// as long as the Muon: it steps as one given named owners does.
TEST_F(CppMuon, TakesOverAnOwningContextAndCommPassedAsTemporaries) {
  const Matrix start = random_gaussian(7, 5, 51);
  const Matrix gradient = random_gaussian(7, 5, 52);
  std::vector<float> named_param(start.values.begin(), start.values.end());
  std::vector<float> owned_param = named_param;
  const std::vector<float> grad(gradient.values.begin(), gradient.values.end());

  const shardmuon::Context cpu(SHARDMUON_BACKEND_CPU);
  const shardmuon::Comm self = shardmuon::Comm::self();
  shardmuon::Muon named(cpu, self, {shardmuon::default_muon_group()});
  shardmuon::Muon owner(shardmuon::Context(SHARDMUON_BACKEND_CPU), shardmuon::Comm::self(),
                        {shardmuon::default_muon_group()});
  named.add_parameter("p", named_param.data(), SHARDMUON_FLOAT32,
                      shardmuon::Layout::replicated(7, 5));
  owner.add_parameter("p", owned_param.data(), SHARDMUON_FLOAT32,
                      shardmuon::Layout::replicated(7, 5));
  for (int step = 0; step < 2; ++step) {
    named.step({grad.data()});
    owner.step({grad.data()});
  }
  EXPECT_EQ(owned_param, named_param);
  EXPECT_NE(owned_param, std::vector<float>(start.values.begin(), start.values.end()));
}

// A parameter the step would refuse is refused when it is added, with an error naming it, and
// nothing is registered; a layout split along a dim other than 0 or 1 cannot be built.
TEST_F(CppMuon, AddParameterRefusesABadParameterNamingIt) {
  if (!group.member) return;
  shardmuon::Muon muon(context, comm, {shardmuon::default_muon_group()});
  const Buffer param = harness.upload(to_bytes(std::vector<double>(64, 0.5), SHARDMUON_FLOAT32));

  const auto expect_refused = [&](const std::string& case_name, auto add) {
    SCOPED_TRACE(case_name);
    try {
      add();
      ADD_FAILURE() << "no exception";
    } catch (const shardmuon::Error& e) {
      EXPECT_EQ(e.status(), SHARDMUON_ERROR_INVALID_ARGUMENT) << e.what();
      EXPECT_NE(std::string(e.what()).find("Muon::add_parameter(\"bad\")"), std::string::npos)
          << e.what();
    }
  };
  expect_refused("a group out of range", [&] {
    muon.add_parameter("bad", param.data(), SHARDMUON_FLOAT32, shardmuon::Layout::replicated(8, 8),
                       /*group=*/1);
  });
  expect_refused("row blocks that do not divide the rows", [&] {
    muon.add_parameter("bad", param.data(), SHARDMUON_FLOAT32, shardmuon::Layout::replicated(5, 8),
                       0, /*row_blocks=*/2);
  });
  expect_refused("negative rows", [&] {
    muon.add_parameter("bad", param.data(), SHARDMUON_FLOAT32,
                       shardmuon::Layout::replicated(-8, 8));
  });
  if (group.size >= 2) {
    std::vector<int64_t> sizes(group.size, 0);
    sizes[0] = -1;
    sizes[1] = 9;  // the sum is the 8 rows: only the negative size is wrong
    expect_refused("a negative shard size", [&] {
      muon.add_parameter("bad", param.data(), SHARDMUON_FLOAT32,
                         shardmuon::Layout::sharded(8, 8, 0, sizes));
    });
  }
  EXPECT_EQ(muon.size(), 0u);
  try {
    shardmuon::Layout::sharded(8, 8, 2, {});
    ADD_FAILURE() << "no exception";
  } catch (const shardmuon::Error& e) {
    EXPECT_EQ(e.status(), SHARDMUON_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("dim must be 0 or 1, got 2"), std::string::npos)
        << e.what();
  }
}

// A step given the wrong number of gradients on one rank throws there, and the other ranks'
// steps fail at once with PEER_FAILED rather than wait for that rank until the timeout.
TEST_F(CppMuon, AWrongGradientCountOnOneRankFailsTheStepOnEveryRank) {
  if (!group.member) return;
  if (group.size < 2) GTEST_SKIP() << "needs 2 ranks";
  shardmuon::Muon muon(context, comm, {shardmuon::default_muon_group()});
  Buffer param = upload_shard(1, group, 61, 0.05);
  const Buffer grad = upload_shard(1, group, 62);
  const std::vector<unsigned char> before = harness.download(param);
  muon.add_parameter("p", param.data(), kDtypes[1], layout_of(1, group));
  std::vector<std::optional<const void*>> grads = {grad.data()};
  if (group.rank == 0) grads.push_back(grad.data());
  try {
    muon.step(grads, harness.stream());
    ADD_FAILURE() << "no exception";
  } catch (const shardmuon::Error& e) {
    EXPECT_EQ(e.status(),
              group.rank == 0 ? SHARDMUON_ERROR_INVALID_ARGUMENT : SHARDMUON_ERROR_PEER_FAILED)
        << e.what();
  }
  EXPECT_EQ(harness.download(param), before);
  EXPECT_EQ(muon.steps_taken(), 0);
  muon.step({grad.data()}, harness.stream());  // the communicator is still usable
  EXPECT_EQ(muon.steps_taken(), 1);
}

}  // namespace
}  // namespace shardmuon_test
