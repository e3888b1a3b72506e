// libFuzzer target: the checkpoint reader. An input is an index (JSON) and one rank file
// (safetensors), packed as [2-byte little-endian index length][index][rank file]; they are
// written into a directory and loaded into two parameters. Loading must not crash, and when
// it fails it must leave the momentum buffers, the step and the group untouched.
//
// With SHARDMUON_FUZZ_MAKE_SEED=<file> set (and -runs=1), the program instead saves a real
// checkpoint and writes it, packed, to <file>: the seed of tests/fuzz/corpus/checkpoint/.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "shardmuon/shardmuon.h"

namespace {

const char* kIndex = "shardmuon-checkpoint.json";

struct Fixture {
  shardmuon_context_t context = nullptr;
  shardmuon_comm_t comm = nullptr;
  std::string directory;
  std::vector<float> param_a = std::vector<float>(12, 0.5f),
                     momentum_a = std::vector<float>(12, 0.25f);
  std::vector<uint16_t> param_b = std::vector<uint16_t>(10, 0x3f80),
                        momentum_b = std::vector<uint16_t>(10, 0x3e80);
  shardmuon_muon_param params[2] = {};
  const char* names[2] = {"layer.a", "layer.b"};

  Fixture() {
    if (shardmuon_context_create(SHARDMUON_BACKEND_CPU, 0, &context) != SHARDMUON_SUCCESS ||
        shardmuon_comm_create_self(&comm) != SHARDMUON_SUCCESS) {
      std::abort();
    }
    directory =
        (std::filesystem::temp_directory_path() / ("shardmuon-fuzz-" + std::to_string(getpid())))
            .string();
    std::filesystem::create_directories(directory);
    params[0].param = param_a.data();
    params[0].momentum = momentum_a.data();
    params[0].dtype = SHARDMUON_FLOAT32;
    params[0].layout = shardmuon_layout{3, 4, SHARDMUON_REPLICATED, 1, nullptr};
    params[0].no_grad = 1;
    params[1].param = param_b.data();
    params[1].momentum = momentum_b.data();
    params[1].dtype = SHARDMUON_BFLOAT16;
    params[1].layout = shardmuon_layout{5, 2, SHARDMUON_REPLICATED, 1, nullptr};
    params[1].no_grad = 1;
  }
  ~Fixture() { std::filesystem::remove_all(directory); }
};

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void make_seed(Fixture& fixture, const char* output) {
  shardmuon_muon_group group;
  shardmuon_muon_group_default(&group);
  if (shardmuon_muon_save(fixture.context, fixture.comm, fixture.directory.c_str(), fixture.params,
                          fixture.names, 2, &group, 1, 42, nullptr) != SHARDMUON_SUCCESS) {
    std::fprintf(stderr, "%s\n", shardmuon_last_error());
    std::abort();
  }
  std::string index, rank_file;
  for (const auto& entry : std::filesystem::directory_iterator(fixture.directory)) {
    if (entry.path().filename() == kIndex) index = read_file(entry.path());
    if (entry.path().extension() == ".safetensors") rank_file = read_file(entry.path());
  }
  std::ofstream out(output, std::ios::binary);
  const uint16_t length = static_cast<uint16_t>(index.size());
  out.write(reinterpret_cast<const char*>(&length), 2);
  out << index << rank_file;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture fixture;
  if (const char* seed = std::getenv("SHARDMUON_FUZZ_MAKE_SEED")) {
    make_seed(fixture, seed);
    return 0;
  }
  if (size < 2) return 0;
  uint16_t length;
  std::memcpy(&length, data, 2);
  length = static_cast<uint16_t>(std::min<size_t>(length, size - 2));
  const std::string index(reinterpret_cast<const char*>(data + 2), length);
  const std::string rank_file(reinterpret_cast<const char*>(data + 2 + length), size - 2 - length);

  // The rank file goes under the name the index gives, when it gives a plain one.
  std::string name = "shardmuon-rank-00000-of-00001-0000000000000000.safetensors";
  const size_t at = index.find("shardmuon-rank-");
  if (at != std::string::npos) {
    const size_t end = index.find('"', at);
    if (end != std::string::npos && end - at < 100) name = index.substr(at, end - at);
  }
  for (const auto& entry : std::filesystem::directory_iterator(fixture.directory)) {
    std::filesystem::remove(entry.path());
  }
  std::ofstream(fixture.directory + "/" + kIndex, std::ios::binary) << index;
  if (name.find('/') == std::string::npos) {
    std::ofstream(fixture.directory + "/" + name, std::ios::binary) << rank_file;
  }

  const std::vector<float> momentum_a = fixture.momentum_a;
  const std::vector<uint16_t> momentum_b = fixture.momentum_b;
  shardmuon_muon_group group;
  shardmuon_muon_group_default(&group);
  const shardmuon_muon_group group_before = group;
  int64_t step = -5;
  const shardmuon_status status =
      shardmuon_muon_load(fixture.context, fixture.comm, fixture.directory.c_str(), fixture.params,
                          fixture.names, 2, &group, 1, &step, nullptr);
  if (status != SHARDMUON_SUCCESS) {
    if (fixture.momentum_a != momentum_a || fixture.momentum_b != momentum_b || step != -5 ||
        std::memcmp(&group, &group_before, sizeof group) != 0) {
      std::abort();  // a failed load changed the running state
    }
  }
  // Reset for the next input.
  fixture.momentum_a.assign(12, 0.25f);
  fixture.momentum_b.assign(10, 0x3e80);
  return 0;
}
