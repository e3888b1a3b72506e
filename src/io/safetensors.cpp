#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace shardmuon {
namespace {

using nlohmann::json;

// The format's own limit on the header, which also bounds what a corrupt length can make us
// allocate.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

[[noreturn]] void fail_io(const std::string& what, const std::string& path) {
  fail(SHARDMUON_ERROR_INTERNAL, what, " ", path, ": ", std::strerror(errno));
}

[[noreturn]] void fail_format(const std::string& path, const std::string& flaw) {
  fail(SHARDMUON_ERROR_INVALID_ARGUMENT, "checkpoint file ", path, " is not valid: ", flaw);
}

std::string directory_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

// A unique temporary name next to path: the process id and a per-process counter.
std::string temporary_name(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return concat(path, ".tmp-", static_cast<long long>(getpid()), "-", counter++);
}

// A file opened for reading, closed on scope exit.
class ReadFile {
 public:
  explicit ReadFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      fail(SHARDMUON_ERROR_INVALID_ARGUMENT, "cannot open ", path, ": ", std::strerror(errno));
    }
  }
  ~ReadFile() { ::close(fd_); }
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;

  uint64_t size() const {
    struct stat info {};
    if (::fstat(fd_, &info) != 0) fail_io("cannot stat", path_);
    return static_cast<uint64_t>(info.st_size);
  }

  // Reads exactly bytes at offset; false if the file ends first.
  bool read_at(uint64_t offset, void* buffer, size_t bytes) const {
    char* at = static_cast<char*>(buffer);
    while (bytes > 0) {
      const ssize_t got = ::pread(fd_, at, bytes, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) fail_io("cannot read", path_);
      if (got == 0) return false;
      at += got;
      offset += static_cast<uint64_t>(got);
      bytes -= static_cast<size_t>(got);
    }
    return true;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* at = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t written = ::write(fd, at, bytes);
    if (written < 0) {
      if (errno == EINTR) continue;
      fail_io("cannot write", path);
    }
    at += written;
    bytes -= static_cast<size_t>(written);
  }
}

// Writes the pieces to a temporary file, syncs it, and renames it over path.
void write_pieces_atomically(const std::string& path,
                             const std::vector<std::pair<const void*, size_t>>& pieces) {
  const std::string temporary = temporary_name(path);
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail_io("cannot create", temporary);
  try {
    for (const auto& [data, bytes] : pieces) write_all(fd, data, bytes, temporary);
    if (::fsync(fd) != 0) fail_io("cannot flush", temporary);
  } catch (...) {
    ::close(fd);
    ::unlink(temporary.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(temporary.c_str());
    fail_io("cannot close", temporary);
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    const int saved = errno;
    ::unlink(temporary.c_str());
    errno = saved;
    fail_io("cannot rename the temporary file to", path);
  }
  // The rename itself reaches the disk with the directory.
  const int dir = ::open(directory_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

}  // namespace

size_t safetensors_dtype_size(const std::string& dtype) {
  if (dtype == "F64") return 8;
  if (dtype == "F32") return 4;
  if (dtype == "BF16") return 2;
  return 0;
}

const SafetensorsEntry* SafetensorsHeader::find(const std::string& name) const {
  const auto found = tensors.find(name);
  return found == tensors.end() ? nullptr : &found->second;
}

void write_safetensors_atomically(const std::string& path,
                                  const std::vector<SafetensorsTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  uint64_t offset = 0;
  for (const SafetensorsTensor& tensor : tensors) {
    header[tensor.name] = {{"dtype", tensor.dtype},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + tensor.bytes}}};
    offset += tensor.bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  unsigned char length[8];
  uint64_t size = text.size();
  for (int i = 0; i < 8; ++i, size >>= 8) length[i] = static_cast<unsigned char>(size & 0xff);

  std::vector<std::pair<const void*, size_t>> pieces = {{length, 8}, {text.data(), text.size()}};
  for (const SafetensorsTensor& tensor : tensors) pieces.emplace_back(tensor.data, tensor.bytes);
  write_pieces_atomically(path, pieces);
}

void write_file_atomically(const std::string& path, const std::string& text) {
  write_pieces_atomically(path, {{text.data(), text.size()}});
}

std::string read_text_file(const std::string& path) {
  const ReadFile file(path);
  std::string text(file.size(), '\0');
  if (!file.read_at(0, text.data(), text.size())) {
    fail(SHARDMUON_ERROR_INVALID_ARGUMENT, path, " changed size while it was read");
  }
  return text;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  const ReadFile file(path);
  const uint64_t size = file.size();
  unsigned char length_bytes[8];
  if (size < 8 || !file.read_at(0, length_bytes, 8)) {
    fail_format(path, "shorter than the 8-byte header length (truncated?)");
  }
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | length_bytes[i];
  if (length > kMaxHeaderBytes || length > size - 8) {
    fail_format(path, "its header length (" + std::to_string(length) +
                          " bytes) runs past the end of the file (" + std::to_string(size) +
                          " bytes; truncated?)");
  }
  std::string text(length, '\0');
  if (!file.read_at(8, text.data(), length)) fail_format(path, "the header could not be read");

  SafetensorsHeader header;
  header.data_start = 8 + length;
  const uint64_t data_bytes = size - header.data_start;
  json parsed;
  try {
    parsed = json::parse(text);
  } catch (const json::exception& e) {
    fail_format(path, std::string("its header is not JSON: ") + e.what());
  }
  if (!parsed.is_object()) fail_format(path, "its header is not a JSON object");
  try {
    for (auto& [name, value] : parsed.items()) {
      if (name == "__metadata__") {
        for (auto& [key, item] : value.items()) header.metadata[key] = item.get<std::string>();
        continue;
      }
      SafetensorsEntry entry;
      entry.name = name;
      entry.dtype = value.at("dtype").get<std::string>();
      entry.shape = value.at("shape").get<std::vector<int64_t>>();
      const auto offsets = value.at("data_offsets").get<std::vector<uint64_t>>();
      if (offsets.size() != 2) fail_format(path, "tensor " + name + " has no [begin, end] offsets");
      entry.begin = offsets[0];
      entry.end = offsets[1];
      const size_t element = safetensors_dtype_size(entry.dtype);
      if (element == 0) fail_format(path, "tensor " + name + " has unknown dtype " + entry.dtype);
      // The byte size, checked for overflow: a wrapped product could match a short range.
      uint64_t bytes = element;
      for (int64_t extent : entry.shape) {
        if (extent < 0) fail_format(path, "tensor " + name + " has a negative extent");
        if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(extent), &bytes)) {
          fail_format(path, "tensor " + name + "'s shape holds more bytes than 2^64");
        }
      }
      if (entry.begin > entry.end || entry.end - entry.begin != bytes) {
        fail_format(path, "tensor " + name + "'s byte range does not match its shape and dtype");
      }
      if (entry.end > data_bytes) {
        fail_format(path, "tensor " + name + " ends at byte " + std::to_string(entry.end) +
                              " of a data section of " + std::to_string(data_bytes) +
                              " bytes (truncated?)");
      }
      header.tensors.emplace(name, std::move(entry));
    }
  } catch (const json::exception& e) {
    fail_format(path, std::string("its header has an unexpected field: ") + e.what());
  }
  // Byte ranges may not overlap.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : header.tensors) ranges.emplace_back(entry.begin, entry.end);
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) fail_format(path, "two tensors' bytes overlap");
  }
  return header;
}

std::vector<unsigned char> read_safetensors_tensor(const std::string& path,
                                                   const SafetensorsHeader& header,
                                                   const SafetensorsEntry& entry) {
  const ReadFile file(path);
  std::vector<unsigned char> bytes(entry.end - entry.begin);
  if (!file.read_at(header.data_start + entry.begin, bytes.data(), bytes.size())) {
    fail_format(path, "tensor " + entry.name + " could not be read (truncated?)");
  }
  return bytes;
}

}  // namespace shardmuon
