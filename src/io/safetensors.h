// The safetensors container (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length, a JSON header naming each tensor's dtype, shape and byte
// range, then the raw bytes. Files are written atomically and read with every offset checked
// against the file's size, so a truncated or garbled file is an error, never a bad read.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace shardmuon {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F64", "F32", "BF16"
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range within the data section
};

struct SafetensorsHeader {
  // By name: a checkpoint load looks up every tensor of a file, so a list would make it
  // quadratic in the number of tensors.
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__": strings only, by the format
  uint64_t data_start = 0;                      // file offset of the data section

  const SafetensorsEntry* find(const std::string& name) const;
};

struct SafetensorsTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t bytes = 0;
};

// Writes path.tmp-<unique>, flushes it to disk, then renames it over path (and syncs the
// directory), so readers see the old file or the whole new one. Throws INTERNAL on I/O errors
// with the path and the system's reason.
void write_safetensors_atomically(const std::string& path,
                                  const std::vector<SafetensorsTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata);

// Reads and checks the header: sizes, JSON, dtypes, shapes against byte ranges, ranges
// inside the file and not overlapping. Throws INVALID_ARGUMENT naming the file and the flaw.
SafetensorsHeader read_safetensors_header(const std::string& path);

// The bytes of one tensor (whose entry came from read_safetensors_header of the same file).
std::vector<unsigned char> read_safetensors_tensor(const std::string& path,
                                                   const SafetensorsHeader& header,
                                                   const SafetensorsEntry& entry);

// Writes text to path atomically, as above.
void write_file_atomically(const std::string& path, const std::string& text);
std::string read_text_file(const std::string& path);

size_t safetensors_dtype_size(const std::string& dtype);  // 0 for an unknown dtype

}  // namespace shardmuon
