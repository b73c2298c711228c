#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"

namespace kda {

using json = nlohmann::json;

struct SafetensorsFile::Mapping {
  void* address = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (address && size) munmap(address, size);
  }
};

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& why) {
  throw Error(path + ": not a valid safetensors file: " + why);
}

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the format's own limit
// A valid header is three levels deep (header > tensor > shape); refusing anything much deeper
// keeps a hostile header from costing memory in proportion to its nesting.
constexpr int kMaxHeaderDepth = 8;

// Parses the JSON header. Any failure, including a repeated key (which nlohmann would silently
// resolve to the last value), becomes a kda::Error naming the file.
json parse_header(const std::string& path, const char* begin, const char* end) {
  std::vector<size_t> keys_seen;  // per object being parsed
  const json::parser_callback_t check = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= kMaxHeaderDepth) {
          fail(path, "header nests deeper than " + std::to_string(kMaxHeaderDepth) + " levels");
        }
        if (event == json::parse_event_t::object_start) keys_seen.push_back(0);
        break;
      case json::parse_event_t::key:
        ++keys_seen.back();
        break;
      case json::parse_event_t::object_end:
        if (parsed.size() != keys_seen.back()) {
          fail(path, "header repeats a key within one object");
        }
        keys_seen.pop_back();
        break;
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(begin, end, check);
  } catch (const json::exception& e) {
    fail(path, std::string("header is not JSON: ") + e.what());
  } catch (const std::bad_alloc&) {
    fail(path, "out of memory parsing a header of " + std::to_string(end - begin) + " bytes");
  }
}

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile file;
  file.path_ = path;
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw Error(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    throw Error(path + ": cannot stat: " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(path + ": not a regular file");
  }
  const size_t size = size_t(st.st_size);
  auto mapping = std::make_shared<Mapping>();
  if (size > 0) {
    void* address = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (address == MAP_FAILED) {
      ::close(fd);
      throw Error(path + ": cannot map: " + std::strerror(errno));
    }
    mapping->address = address;
    mapping->size = size;
  }
  ::close(fd);
  file.mapping_ = mapping;

  if (size < 8)
    fail(path,
         "file has " + std::to_string(size) + " bytes, fewer than the 8 of the header length");
  const auto* bytes = static_cast<const std::byte*>(mapping->address);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | uint64_t(bytes[i]);
  if (header_len > kMaxHeaderBytes)
    fail(path, "header length " + std::to_string(header_len) + " is over 100 MiB");
  if (header_len > size - 8) {
    fail(path, "header length " + std::to_string(header_len) + " runs past the end of the file (" +
                   std::to_string(size) + " bytes)");
  }
  const char* header_begin = reinterpret_cast<const char*>(bytes + 8);
  const json header = parse_header(path, header_begin, header_begin + header_len);
  if (!header.is_object()) fail(path, "header is not a JSON object");

  const size_t data_size = size - 8 - size_t(header_len);
  file.data_ = bytes + 8 + header_len;
  std::vector<std::pair<size_t, size_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& value = it.value();
    if (name == "__metadata__") {
      if (!value.is_object()) fail(path, "__metadata__ is not an object");
      for (auto m = value.begin(); m != value.end(); ++m) {
        if (!m.value().is_string())
          fail(path, "__metadata__ value '" + m.key() + "' is not a string");
        file.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "'";
    if (!value.is_object()) fail(path, where + " is not an object");
    if (!value.contains("dtype") || !value["dtype"].is_string())
      fail(path, where + " has no dtype string");
    const auto dtype = dtype_from_name(value["dtype"].get<std::string>());
    if (!dtype)
      fail(path, where + " has unknown dtype '" + value["dtype"].get<std::string>() + "'");
    if (!value.contains("shape") || !value["shape"].is_array())
      fail(path, where + " has no shape array");
    Shape shape;
    // Strides multiply every nonzero dimension, so their product must fit int64 even when
    // another dimension is 0 (and numel with it).
    uint64_t numel = 1, nonzero_product = 1;
    for (const json& d : value["shape"]) {
      if (!d.is_number_unsigned())
        fail(path, where + " has a shape entry that is not a non-negative integer");
      const uint64_t n = d.get<uint64_t>();
      constexpr uint64_t kMaxExtent = uint64_t(std::numeric_limits<int64_t>::max());
      if (n != 0 && nonzero_product > kMaxExtent / n)
        fail(path, where + " has a shape too large to address");
      if (n != 0) nonzero_product *= n;
      numel *= n;  // 0 or nonzero_product: cannot overflow
      shape.push_back(int64_t(n));
    }
    if (!value.contains("data_offsets") || !value["data_offsets"].is_array() ||
        value["data_offsets"].size() != 2 || !value["data_offsets"][0].is_number_unsigned() ||
        !value["data_offsets"][1].is_number_unsigned()) {
      fail(path, where + " has no [begin, end] data_offsets");
    }
    const uint64_t begin = value["data_offsets"][0].get<uint64_t>();
    const uint64_t end = value["data_offsets"][1].get<uint64_t>();
    if (begin > end) fail(path, where + " has data_offsets with begin after end");
    if (end > data_size) {
      fail(path, where + " ends at byte " + std::to_string(end) + " of a data section of " +
                     std::to_string(data_size) + " bytes (file truncated?)");
    }
    const uint64_t elem = dtype_size(*dtype);
    if (numel > std::numeric_limits<uint64_t>::max() / elem || numel * elem != end - begin) {
      fail(path, where + " has shape " + shape_string(shape) + " x " +
                     std::string(dtype_name(*dtype)) + " but " + std::to_string(end - begin) +
                     " bytes");
    }
    file.entries_[name] = Entry{*dtype, std::move(shape), size_t(begin), size_t(end)};
    if (end > begin) ranges.emplace_back(size_t(begin), size_t(end));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) fail(path, "two tensors' data ranges overlap");
  }
  return file;
}

std::span<const std::byte> SafetensorsFile::file_bytes() const {
  if (!mapping_ || !mapping_->address) return {};
  return {static_cast<const std::byte*>(mapping_->address), mapping_->size};
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& [name, entry] : entries_) out.push_back(name);
  return out;
}

TensorView SafetensorsFile::view(const std::string& name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) throw Error(path_ + ": no tensor named '" + name + "'");
  const Entry& e = it->second;
  return TensorView{const_cast<std::byte*>(data_ + e.begin), e.dtype, e.shape,
                    contiguous_strides(e.shape)};
}

Tensor SafetensorsFile::load(const std::string& name, DType dtype) const {
  return Tensor::from_view_as(view(name), dtype);
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  namespace fs = std::filesystem;
  require(!path.empty(), "cannot write a file with an empty path");
  const fs::path target(path);
  const fs::path folder = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::random_device rd;
  // Built by appending: GCC 12 warns falsely (-Wrestrict) on "." + std::string.
  std::string temp_name = ".";
  temp_name += target.filename().string();
  temp_name += ".tmp" + std::to_string(rd());
  const std::string temp = (folder / temp_name).string();
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(path + ": cannot create temporary " + temp + ": " + std::strerror(errno));
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      const std::string why = std::strerror(errno);
      ::close(fd);
      ::unlink(temp.c_str());
      throw Error(path + ": writing temporary " + temp + " failed: " + why);
    }
    written += size_t(n);
  }
  const bool synced = ::fsync(fd) == 0;
  const int sync_errno = errno;
  const bool closed = ::close(fd) == 0;  // always close, even when fsync failed
  if (!synced || !closed) {
    const std::string why = std::strerror(synced ? errno : sync_errno);
    ::unlink(temp.c_str());
    throw Error(path + ": " + (synced ? "close" : "fsync") + " of temporary " + temp +
                " failed: " + why);
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(temp.c_str());
    throw Error(path + ": rename failed: " + why);
  }
  const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const std::string where = path + ": tensor '" + name + "'";
    require(name != "__metadata__", path + ": a tensor may not be named __metadata__");
    require(!header.contains(name), where + " given twice");
    require(tensor != nullptr, where + " is a null pointer");
    require(tensor->raw() != nullptr || tensor->nbytes() == 0, where + " has no storage");
    header[name] = {{"dtype", std::string(dtype_name(tensor->dtype()))},
                    {"shape", tensor->shape()},
                    {"data_offsets", {offset, offset + tensor->nbytes()}}};
    offset += tensor->nbytes();
  }
  std::string text;
  try {
    text = header.dump();  // throws on names or metadata that are not UTF-8
  } catch (const json::exception& e) {
    throw Error(path + ": cannot write the header: " + e.what());
  }
  while ((8 + text.size()) % 8) text.push_back(' ');  // align the data section
  require(text.size() <= kMaxHeaderBytes, path + ": header of " + std::to_string(text.size()) +
                                              " bytes is over the format's 100 MiB");
  std::string bytes(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) bytes[i] = char((n >> (8 * i)) & 0xff);
  bytes += text;
  bytes.reserve(bytes.size() + offset);
  for (const auto& [name, tensor] : tensors) {
    bytes.append(static_cast<const char*>(tensor->raw()), tensor->nbytes());
  }
  write_file_atomic(path, bytes);
}

}  // namespace kda
