#include "io/checkpoint.h"

#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "core/agreement.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/schedule.h"
#include "io/safetensors.h"

namespace shardmuon {
namespace {

using nlohmann::json;

constexpr const char* kFormat = "shardmuon.muon-checkpoint";
constexpr int kVersion = 1;
constexpr const char* kIndexName = "shardmuon-checkpoint.json";

// A rectangle of a logical matrix.
struct Region {
  int64_t row0 = 0, col0 = 0, rows = 0, cols = 0;
  int64_t elements() const { return rows * cols; }
};

Region intersect(const Region& a, const Region& b) {
  const int64_t row0 = std::max(a.row0, b.row0), col0 = std::max(a.col0, b.col0);
  const int64_t row1 = std::min(a.row0 + a.rows, b.row0 + b.rows);
  const int64_t col1 = std::min(a.col0 + a.cols, b.col0 + b.cols);
  if (row1 <= row0 || col1 <= col0) return Region{};
  return Region{row0, col0, row1 - row0, col1 - col0};
}

// A rectangle of the logical matrix and where it starts in a rank's local buffer (elements).
struct PlacedRegion {
  Region region;
  int64_t local_offset = 0;
};

// The parts of the logical matrix a rank's local buffer holds, in the buffer's order: one
// rectangle, or for a flat shard up to three (the end of a first row, whole rows, the start of
// a last row).
std::vector<PlacedRegion> local_regions(const ShardLayout& layout, int rank) {
  const int64_t rows = layout.rows(), cols = layout.cols();
  if (!layout.is_sharded()) return {{Region{0, 0, rows, cols}, 0}};
  const int64_t offset = layout.shard_offsets()[rank], size = layout.shard_sizes()[rank];
  if (size == 0) return {};
  if (layout.sharded_dim() == 0) return {{Region{offset, 0, size, cols}, 0}};
  if (layout.sharded_dim() == 1) return {{Region{0, offset, rows, size}, 0}};
  std::vector<PlacedRegion> regions;
  for (int64_t at = offset, end = offset + size; at < end;) {
    const int64_t row = at / cols, col = at % cols;
    if (col == 0 && end - at >= cols) {
      const int64_t whole_rows = (end - at) / cols;
      regions.push_back({Region{row, 0, whole_rows, cols}, at - offset});
      at += whole_rows * cols;
    } else {
      const int64_t width = std::min(cols - col, end - at);
      regions.push_back({Region{row, col, 1, width}, at - offset});
      at += width;
    }
  }
  return regions;
}

// The pieces a rank writes: its shard's, or for a replicated matrix, rank 0 the whole.
std::vector<PlacedRegion> saved_regions(const ShardLayout& layout, int rank) {
  if (!layout.is_sharded() && rank != 0) return {};
  return local_regions(layout, rank);
}

// The tensor name of a parameter's j-th piece in a rank's file (a flat shard has up to three).
std::string piece_tensor_name(const std::string& name, size_t j) {
  return j == 0 ? name : concat(name, "#", j);
}

const char* safetensors_dtype(shardmuon_dtype dtype) {
  return dtype == SHARDMUON_FLOAT64 ? "F64" : dtype == SHARDMUON_FLOAT32 ? "F32" : "BF16";
}

// The dtype of a safetensors dtype name; only the three the library writes are read.
shardmuon_dtype dtype_of(const std::string& name) {
  if (name == "F64") return SHARDMUON_FLOAT64;
  if (name == "F32") return SHARDMUON_FLOAT32;
  return SHARDMUON_BFLOAT16;  // read_safetensors_header admits only F64, F32 and BF16
}

uint32_t crc32_of(const unsigned char* data, size_t size) {
  return static_cast<uint32_t>(::crc32_z(::crc32_z(0L, Z_NULL, 0), data, size));
}
uint32_t crc32_of(const std::vector<unsigned char>& bytes) {
  return crc32_of(bytes.data(), bytes.size());
}

std::string rank_file_name(int rank, int ranks, const std::string& token) {
  char name[96];
  std::snprintf(name, sizeof name, "shardmuon-rank-%05d-of-%05d-%s.safetensors", rank, ranks,
                token.c_str());
  return name;
}

const char* weight_decay_name(shardmuon_weight_decay mode) {
  switch (mode) {
    case SHARDMUON_WEIGHT_DECAY_DECOUPLED: return "decoupled";
    case SHARDMUON_WEIGHT_DECAY_L2: return "l2";
    case SHARDMUON_WEIGHT_DECAY_INDEPENDENT: return "independent";
    case SHARDMUON_WEIGHT_DECAY_NONE: return "none";
  }
  return "?";
}

const char* scale_mode_name(shardmuon_scale_mode mode) {
  switch (mode) {
    case SHARDMUON_SCALE_SPECTRAL: return "spectral";
    case SHARDMUON_SCALE_SHAPE_SCALING: return "shape_scaling";
    case SHARDMUON_SCALE_UNIT_RMS_NORM: return "unit_rms_norm";
    case SHARDMUON_SCALE_NONE: return "none";
  }
  return "?";
}

template <typename Enum>
Enum enum_from_name(const std::string& name, int count, const char* (*name_of)(Enum),
                    const char* what) {
  for (int value = 0; value < count; ++value) {
    if (name == name_of(static_cast<Enum>(value))) return static_cast<Enum>(value);
  }
  fail(SHARDMUON_ERROR_INVALID_ARGUMENT, "the checkpoint names an unknown ", what, " \"", name,
       "\"");
}

const char* ns_storage_name(shardmuon_ns_storage storage) {
  switch (storage) {
    case SHARDMUON_NS_STORAGE_PARAM: return "param";
    case SHARDMUON_NS_STORAGE_BFLOAT16: return "bfloat16";
    case SHARDMUON_NS_STORAGE_FLOAT32: return "float32";
  }
  return "?";
}

const char* schedule_label(shardmuon_schedule schedule) {
  return schedule_name(schedule);
}

json group_to_json(const shardmuon_muon_group& group) {
  json ns = {{"iterations", group.ns.num_iterations},
             {"schedule", schedule_name(group.ns.schedule)},
             {"eps", group.ns.eps},
             {"algorithm", static_cast<int>(group.ns.algorithm)}};
  if (group.ns.schedule == SHARDMUON_SCHEDULE_CUSTOM) {
    json coefficients = json::array();
    for (const Coefficients& k : coefficients_for(group.ns))
      coefficients.push_back({k.a, k.b, k.c});
    ns["custom_coefficients"] = coefficients;
  }
  // A group that reads its learning rate from device memory may leave lr unset (NaN): the
  // index then records null, and loading keeps the caller's lr.
  const json lr = std::isfinite(group.lr) ? json(group.lr) : json(nullptr);
  return {{"lr", lr},
          {"momentum", group.momentum},
          {"nesterov", group.nesterov != 0},
          {"weight_decay", group.weight_decay},
          {"weight_decay_mode", weight_decay_name(group.weight_decay_mode)},
          {"scale_mode", scale_mode_name(group.scale_mode)},
          {"extra_scale_factor", group.extra_scale_factor},
          {"ns", ns},
          {"ns_storage", ns_storage_name(group.ns_storage)}};
}

// The saved group. The caller's group is an output: of it only what a checkpoint cannot hold
// is read, its pointers into the caller's memory: lr_on_device (with lr, where the saved group
// had its learning rate on the device and recorded none) and, for a custom schedule, the
// coefficients, which must equal the saved ones.
shardmuon_muon_group group_from_json(const json& saved, const shardmuon_muon_group& caller,
                                     int index) {
  shardmuon_muon_group group{};
  group.lr_on_device = caller.lr_on_device;
  group.lr = saved.at("lr").is_null() ? caller.lr : saved.at("lr").get<double>();
  group.momentum = saved.at("momentum").get<double>();
  group.nesterov = saved.at("nesterov").get<bool>() ? 1 : 0;
  group.weight_decay = saved.at("weight_decay").get<double>();
  group.weight_decay_mode = enum_from_name<shardmuon_weight_decay>(
      saved.at("weight_decay_mode").get<std::string>(), 4, weight_decay_name, "weight decay mode");
  group.scale_mode = enum_from_name<shardmuon_scale_mode>(saved.at("scale_mode").get<std::string>(),
                                                          4, scale_mode_name, "scale mode");
  group.extra_scale_factor = saved.at("extra_scale_factor").get<double>();
  // Checkpoints from before ns_storage was a group setting ran the iteration in the
  // parameter's dtype (PARAM, the zero value).
  if (saved.contains("ns_storage")) {
    group.ns_storage = enum_from_name<shardmuon_ns_storage>(
        saved.at("ns_storage").get<std::string>(), 3, ns_storage_name, "ns_storage");
  }
  const json& ns = saved.at("ns");
  group.ns.num_iterations = ns.at("iterations").get<int>();
  group.ns.schedule = enum_from_name<shardmuon_schedule>(ns.at("schedule").get<std::string>(), 6,
                                                         schedule_label, "schedule");
  group.ns.eps = ns.at("eps").get<double>();
  group.ns.algorithm = static_cast<shardmuon_ns_algorithm>(ns.at("algorithm").get<int>());
  if (group.ns.schedule == SHARDMUON_SCHEDULE_CUSTOM) {
    const auto saved_coefficients =
        ns.at("custom_coefficients").get<std::vector<std::vector<double>>>();
    bool same = caller.ns.custom_coefficients != nullptr &&
                caller.ns.num_custom_coefficients == static_cast<int>(saved_coefficients.size());
    for (size_t k = 0; same && k < saved_coefficients.size(); ++k) {
      for (size_t j = 0; j < 3; ++j) {
        same = same && saved_coefficients[k].size() == 3 &&
               caller.ns.custom_coefficients[3 * k + j] == saved_coefficients[k][j];
      }
    }
    SHARDMUON_CHECK_ARG(same, "groups[", index, "] was saved with a custom schedule of ",
                        saved_coefficients.size(),
                        " coefficient triples; pass the same ones in groups[", index,
                        "].ns.custom_coefficients to load it");
    group.ns.custom_coefficients = caller.ns.custom_coefficients;
    group.ns.num_custom_coefficients = static_cast<int>(saved_coefficients.size());
  }
  validate_muon_group(group, index);
  return group;
}

// A small matcher for those names (std::regex would do, but GCC 12 warns inside its own
// headers under the sanitizer builds' -O2, and those build with -Werror).
class NameScanner {
 public:
  explicit NameScanner(const std::string& text) : text_(text) {}
  bool literal(const char* expected) {
    const size_t length = std::strlen(expected);
    if (text_.compare(at_, length, expected) != 0) return false;
    at_ += length;
    return true;
  }
  // A run of characters from `allowed`, of at least `least` and at most `most` of them.
  bool run(const char* allowed, size_t least, size_t most = std::string::npos) {
    const size_t end = std::min(text_.find_first_not_of(allowed, at_), text_.size());
    if (end - at_ < least || end - at_ > most) return false;
    at_ = end;
    return true;
  }
  bool done() const { return at_ == text_.size(); }

 private:
  const std::string& text_;
  size_t at_ = 0;
};

constexpr const char* kDigits = "0123456789";

// ".tmp-<pid>-<n>", the suffix of a file being written.
bool temporary_suffix(NameScanner& scan) {
  return scan.literal(".tmp-") && scan.run(kDigits, 1) && scan.literal("-") && scan.run(kDigits, 1);
}

// Whether a file in a checkpoint directory is one that save writes and may remove once it is
// stale: a rank file ("shardmuon-rank-<rank>-of-<ranks>-<token>.safetensors"), or the
// temporary of a rank file or of the index that a crash left (write_pieces_atomically's
// "<name>.tmp-<pid>-<n>"). Exactly these names: a user's file that merely starts like them
// ("shardmuon-rank-notes.txt", "shardmuon-checkpoint.json.bak") is not ours to delete.
bool is_own_file_name(const std::string& file) {
  NameScanner rank_file(file);
  if (rank_file.literal("shardmuon-rank-") && rank_file.run(kDigits, 5) &&
      rank_file.literal("-of-") && rank_file.run(kDigits, 5) && rank_file.literal("-") &&
      rank_file.run("0123456789abcdef", 16, 16) && rank_file.literal(".safetensors") &&
      (rank_file.done() || (temporary_suffix(rank_file) && rank_file.done()))) {
    return true;
  }
  NameScanner index(file);
  return index.literal("shardmuon-checkpoint.json") && temporary_suffix(index) && index.done();
}

uint64_t random_token() {
  std::random_device device;
  const uint64_t high = device(), low = device();
  return ((high << 32) | low) >> 1;  // 63 bits, so it travels through the int64 maximum
}

std::string hex(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}

// capture_local_failure, with JSON and filesystem errors turned into library failures.
template <typename Phase>
std::exception_ptr attempt(Phase&& phase) {
  return capture_local_failure([&] {
    try {
      phase();
    } catch (const json::exception& e) {
      fail(SHARDMUON_ERROR_INVALID_ARGUMENT, "the checkpoint is malformed: ", e.what());
    } catch (const std::filesystem::filesystem_error& e) {
      fail(SHARDMUON_ERROR_INTERNAL, e.what());
    }
  });
}

}  // namespace

std::vector<std::string> validate_checkpoint_names(const char* const* names, int num_params) {
  std::vector<std::string> result;
  SHARDMUON_CHECK_ARG(num_params == 0 || names != nullptr, "names is NULL");
  std::set<std::string> seen;
  for (int i = 0; i < num_params; ++i) {
    SHARDMUON_CHECK_ARG(names[i] != nullptr, "names[", i, "] is NULL");
    const std::string name = names[i];
    SHARDMUON_CHECK_ARG(!name.empty() && name.size() <= 200, "names[", i,
                        "] must have 1 to 200 characters, got ", name.size());
    for (char c : name) {
      SHARDMUON_CHECK_ARG(
          std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-', "names[",
          i, "] = \"", name, "\" has a character outside [A-Za-z0-9_.-]");
    }
    // safetensors keeps its own metadata under this key in every file's header.
    SHARDMUON_CHECK_ARG(name != "__metadata__", "names[", i,
                        "] = \"__metadata__\" is the safetensors header's own key; pick another");
    SHARDMUON_CHECK_ARG(seen.insert(name).second, "names[", i, "] = \"", name, "\" is not unique");
    result.push_back(name);
  }
  return result;
}

void save_muon_checkpoint(Backend& backend, Communicator& comm, const std::string& directory,
                          const ValidatedMuonStep& params, const std::vector<std::string>& names,
                          const shardmuon_muon_group* groups, int num_groups, int64_t step,
                          Stream stream) {
  const int rank = comm.rank(), ranks = comm.size();
  // A token unique to this save names its files, so a reader never mixes in another save's.
  int64_t token_value = rank == 0 ? static_cast<int64_t>(random_token()) : 0;
  comm.agree_max(&token_value, 1);
  const std::string token = hex(static_cast<uint64_t>(token_value));

  std::exception_ptr failure = attempt([&] {
    std::filesystem::create_directories(directory);
    std::vector<std::vector<unsigned char>> host(params.plans.size());
    for (size_t i = 0; i < params.plans.size(); ++i) {
      const MuonParamPlan& plan = params.plans[i];
      if (saved_regions(plan.ns.layout, rank).empty()) continue;
      host[i].resize(plan.ns.layout.local_elements(rank) * element_size(plan.param->dtype));
      backend.copy_to_host(host[i].data(), plan.param->momentum, host[i].size(), stream);
    }
    backend.synchronize(stream);
    std::vector<SafetensorsTensor> tensors;
    json pieces = json::object();
    for (size_t i = 0; i < params.plans.size(); ++i) {
      const MuonParamPlan& plan = params.plans[i];
      const size_t element = element_size(plan.param->dtype);
      const std::vector<PlacedRegion> regions = saved_regions(plan.ns.layout, rank);
      for (size_t j = 0; j < regions.size(); ++j) {
        const Region& piece = regions[j].region;
        const unsigned char* data = host[i].data() + regions[j].local_offset * element;
        const size_t bytes = piece.elements() * element;
        const std::string tensor = piece_tensor_name(names[i], j);
        tensors.push_back(
            {tensor, safetensors_dtype(plan.param->dtype), {piece.rows, piece.cols}, data, bytes});
        pieces[tensor] = {
            {"row0", piece.row0}, {"col0", piece.col0}, {"crc32", crc32_of(data, bytes)}};
      }
    }
    const std::map<std::string, std::string> metadata = {{"format", kFormat},
                                                         {"version", std::to_string(kVersion)},
                                                         {"token", token},
                                                         {"rank", std::to_string(rank)},
                                                         {"world", std::to_string(ranks)},
                                                         {"pieces", pieces.dump()}};
    write_safetensors_atomically(directory + "/" + rank_file_name(rank, ranks, token), tensors,
                                 metadata);
  });
  agree_across_ranks(comm, failure, 0, "",
                     "could not write its checkpoint file (its own error message says why); the "
                     "previous checkpoint in the directory, if any, is still the valid one");

  // The index, written last, is what makes the new checkpoint the valid one.
  failure = attempt([&] {
    if (rank != 0) return;
    json index = {{"format", kFormat},       {"version", kVersion}, {"token", token},
                  {"world", ranks},          {"step", step},        {"groups", json::array()},
                  {"params", json::object()}};
    for (int g = 0; g < num_groups; ++g) index["groups"].push_back(group_to_json(groups[g]));
    for (size_t i = 0; i < params.plans.size(); ++i) {
      const ShardLayout& layout = params.plans[i].ns.layout;
      json pieces = json::array();
      for (int r = 0; r < ranks; ++r) {
        const std::vector<PlacedRegion> regions = saved_regions(layout, r);
        for (size_t j = 0; j < regions.size(); ++j) {
          const Region& piece = regions[j].region;
          json entry = {{"file", rank_file_name(r, ranks, token)},
                        {"row0", piece.row0},
                        {"col0", piece.col0},
                        {"rows", piece.rows},
                        {"cols", piece.cols}};
          if (j > 0) entry["tensor"] = piece_tensor_name(names[i], j);
          pieces.push_back(entry);
        }
      }
      index["params"][names[i]] = {{"rows", layout.rows()},
                                   {"cols", layout.cols()},
                                   {"dtype", safetensors_dtype(params.plans[i].param->dtype)},
                                   {"group", params.plans[i].param->group},
                                   {"pieces", pieces}};
    }
    write_file_atomically(directory + "/" + kIndexName, index.dump(1));
    // Files of earlier saves (and temporaries a crash left) are no longer referenced.
    std::set<std::string> current;
    for (int r = 0; r < ranks; ++r) current.insert(rank_file_name(r, ranks, token));
    for (const auto& entry : std::filesystem::directory_iterator(directory)) {
      const std::string file = entry.path().filename().string();
      if (is_own_file_name(file) && current.count(file) == 0) {
        std::error_code ignored;
        std::filesystem::remove(entry.path(), ignored);
      }
    }
  });
  agree_across_ranks(comm, failure, 0, "",
                     "could not write the checkpoint index (its own error message says why)");
}

void load_muon_checkpoint(Backend& backend, Communicator& comm, const std::string& directory,
                          const ValidatedMuonStep& params, const std::vector<std::string>& names,
                          shardmuon_muon_group* groups, int num_groups, int64_t* step,
                          Stream stream) {
  const int rank = comm.rank();
  std::vector<std::vector<unsigned char>> staged(params.plans.size());
  std::vector<shardmuon_muon_group> loaded_groups;
  int64_t loaded_step = 0;
  std::string token;  // the save's, from the index this rank read

  std::exception_ptr failure = attempt([&] {
    const std::string index_path = directory + "/" + kIndexName;
    json index;
    try {
      index = json::parse(read_text_file(index_path));
    } catch (const json::exception& e) {
      fail(SHARDMUON_ERROR_INVALID_ARGUMENT, "checkpoint index ", index_path,
           " is not JSON: ", e.what());
    }
    SHARDMUON_CHECK_ARG(index.value("format", "") == kFormat, "checkpoint index ", index_path,
                        " is not a shardmuon Muon checkpoint");
    SHARDMUON_CHECK_ARG(index.at("version").get<int>() == kVersion, "checkpoint index ", index_path,
                        " has version ", index.at("version").get<int>(),
                        "; this library reads version ", kVersion);
    token = index.at("token").get<std::string>();
    loaded_step = index.at("step").get<int64_t>();
    // Save refuses a negative step, so one here means the index was edited or damaged.
    SHARDMUON_CHECK_ARG(loaded_step >= 0, "checkpoint index ", index_path, " has step ",
                        loaded_step, "; a saved step is >= 0");
    const json& saved_groups = index.at("groups");
    if (groups != nullptr) {
      SHARDMUON_CHECK_ARG(static_cast<int>(saved_groups.size()) == num_groups, "num_groups is ",
                          num_groups, " but the checkpoint holds ", saved_groups.size(), " groups");
      for (int g = 0; g < num_groups; ++g) {
        loaded_groups.push_back(group_from_json(saved_groups[g], groups[g], g));
      }
      // The saved groups replace the caller's: they must be able to step these parameters
      // in their layouts now (an algorithm that needs shards along dim 0 or 1, say, where a
      // parameter is now flat), checked as the step checks its groups.
      std::vector<shardmuon_muon_param> step_params;
      for (const MuonParamPlan& plan : params.plans) step_params.push_back(*plan.param);
      try {
        validate_muon_step(backend, comm, step_params.data(), static_cast<int>(step_params.size()),
                           loaded_groups.data(), num_groups,
                           /*use_grads=*/false);
      } catch (const Failure& e) {
        throw Failure(e.status(),
                      concat("the checkpoint's groups cannot step these parameters: ", e.what()));
      }
    }

    // Each rank file's header and record of its pieces, read and parsed once per load (not
    // once per piece: a file holds a piece of every parameter, so that was quadratic).
    struct RankFile {
      SafetensorsHeader header;
      json pieces;
    };
    std::map<std::string, RankFile> files;  // by path
    for (size_t i = 0; i < params.plans.size(); ++i) {
      const MuonParamPlan& plan = params.plans[i];
      const ShardLayout& layout = plan.ns.layout;
      const std::string& name = names[i];
      SHARDMUON_CHECK_ARG(index.at("params").contains(name), "params[", i, "] \"", name,
                          "\" is not in the checkpoint");
      const json& saved = index.at("params").at(name);
      SHARDMUON_CHECK_ARG(saved.at("rows").get<int64_t>() == layout.rows() &&
                              saved.at("cols").get<int64_t>() == layout.cols(),
                          "params[", i, "] \"", name, "\" was saved as ",
                          saved.at("rows").get<int64_t>(), " x ", saved.at("cols").get<int64_t>(),
                          " but its layout now says ", layout.rows(), " x ", layout.cols());
      // Restored groups are matched to parameters by index: a parameter now in another group
      // would step under another group's hyperparameters. Indexes written before the field
      // existed are not checked.
      if (groups != nullptr && saved.contains("group")) {
        // Compared as JSON integers: the index is read, not trusted (a float or a huge
        // number must not be cast to int).
        const json& saved_group = saved.at("group");
        SHARDMUON_CHECK_ARG(
            saved_group.is_number_integer() && saved_group.get<int64_t>() == plan.param->group,
            "params[", i, "] \"", name, "\" was saved in groups[", saved_group.dump(),
            "] but is now in groups[", plan.param->group, "]");
      }
      const std::vector<PlacedRegion> targets = local_regions(layout, rank);
      const int64_t needed = layout.local_elements(rank);
      if (needed == 0) continue;
      staged[i].resize(needed * element_size(plan.param->dtype));
      // Which of this rank's elements a piece has written: the index is read, not trusted, so
      // pieces that overlap (or leave gaps) must not pass for a full cover.
      std::vector<bool> written(static_cast<size_t>(needed), false);
      int64_t covered = 0;
      for (const json& piece_json : saved.at("pieces")) {
        const Region piece{
            piece_json.at("row0").get<int64_t>(), piece_json.at("col0").get<int64_t>(),
            piece_json.at("rows").get<int64_t>(), piece_json.at("cols").get<int64_t>()};
        SHARDMUON_CHECK_ARG(piece.row0 >= 0 && piece.col0 >= 0 && piece.rows >= 0 &&
                                piece.cols >= 0 && piece.rows <= layout.rows() - piece.row0 &&
                                piece.cols <= layout.cols() - piece.col0,
                            "the checkpoint index places a piece of \"", name, "\" at (",
                            piece.row0, ", ", piece.col0, ") with ", piece.rows, " x ", piece.cols,
                            " elements, outside its ", layout.rows(), " x ", layout.cols());
        bool overlaps = false;
        for (const PlacedRegion& target : targets) {
          overlaps = overlaps || intersect(piece, target.region).elements() > 0;
        }
        if (!overlaps) continue;
        const std::string file = piece_json.at("file").get<std::string>();
        const std::string tensor = piece_json.value("tensor", name);
        SHARDMUON_CHECK_ARG(file.find('/') == std::string::npos,
                            "the checkpoint index names a file "
                            "outside its directory: ",
                            file);
        const std::string path = directory + "/" + file;
        auto cached = files.find(path);
        if (cached == files.end()) {
          RankFile file_read{read_safetensors_header(path), json()};
          SafetensorsHeader& header = file_read.header;
          SHARDMUON_CHECK_ARG(header.metadata["token"] == token, "checkpoint file ", path,
                              " belongs to another save than the index (token ",
                              header.metadata["token"], ", index ", token, ")");
          const auto pieces_record = header.metadata.find("pieces");
          SHARDMUON_CHECK_ARG(pieces_record != header.metadata.end(), "checkpoint file ", path,
                              " has no record of its pieces in its metadata");
          file_read.pieces = json::parse(pieces_record->second);
          cached = files.emplace(path, std::move(file_read)).first;
        }
        const SafetensorsHeader& header = cached->second.header;
        const json& file_pieces = cached->second.pieces;
        const SafetensorsEntry* entry = header.find(tensor);
        SHARDMUON_CHECK_ARG(entry != nullptr && entry->shape.size() == 2 &&
                                entry->shape[0] == piece.rows && entry->shape[1] == piece.cols,
                            "checkpoint file ", path, " lacks the ", piece.rows, " x ", piece.cols,
                            " piece \"", tensor, "\" of \"", name, "\" that the index lists");
        SHARDMUON_CHECK_ARG(file_pieces.contains(tensor), "checkpoint file ", path,
                            " records no piece \"", tensor, "\"");
        const json& recorded = file_pieces.at(tensor);
        SHARDMUON_CHECK_ARG(recorded.at("row0").get<int64_t>() == piece.row0 &&
                                recorded.at("col0").get<int64_t>() == piece.col0,
                            "checkpoint file ", path, " places \"", tensor,
                            "\" elsewhere than the index");
        const std::vector<unsigned char> bytes = read_safetensors_tensor(path, header, *entry);
        const shardmuon_dtype saved_dtype = dtype_of(entry->dtype);
        SHARDMUON_CHECK_ARG(crc32_of(bytes) == recorded.at("crc32").get<uint32_t>(),
                            "checkpoint file ", path, " is corrupted: the CRC-32 of \"", tensor,
                            "\" does not match the one recorded when it was written");
        for (const PlacedRegion& target : targets) {
          const Region overlap = intersect(piece, target.region);
          const Region& t = target.region;
          for (int64_t r = 0; r < overlap.rows; ++r) {
            for (int64_t c = 0; c < overlap.cols; ++c) {
              const int64_t source =
                  (overlap.row0 - piece.row0 + r) * piece.cols + (overlap.col0 - piece.col0 + c);
              const int64_t destination = target.local_offset +
                                          (overlap.row0 - t.row0 + r) * t.cols +
                                          (overlap.col0 - t.col0 + c);
              SHARDMUON_CHECK_ARG(!written[destination], "the checkpoint's pieces of \"", name,
                                  "\" overlap (at row ", overlap.row0 + r, ", column ",
                                  overlap.col0 + c, ")");
              written[destination] = true;
              store_element(staged[i].data(), plan.param->dtype, destination,
                            load_element(bytes.data(), saved_dtype, source));
            }
          }
          covered += overlap.elements();
        }
      }
      SHARDMUON_CHECK_ARG(covered == needed, "the checkpoint's pieces of \"", name, "\" cover ",
                          covered, " of the ", needed, " elements this rank needs");
    }
  });
  // The ranks must have read the same save: on file systems that are not shared, or while a
  // save replaces the directory, ranks could otherwise each load another.
  agree_across_ranks(comm, failure, Digest().add_string(token).add(loaded_step).value(),
                     concat("the checkpoint of token ", token, " at step ", loaded_step),
                     "could not load the checkpoint (its own error message says why); no rank "
                     "modified anything");

  // Every rank has everything: only now is the running state replaced.
  for (size_t i = 0; i < params.plans.size(); ++i) {
    backend.copy_from_host(params.plans[i].param->momentum, staged[i].data(), staged[i].size(),
                           stream);
  }
  backend.synchronize(stream);
  *step = loaded_step;
  for (size_t g = 0; g < loaded_groups.size(); ++g) groups[g] = loaded_groups[g];
}

}  // namespace shardmuon
