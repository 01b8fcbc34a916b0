// paradyse/serve/hf_checkpoint.hpp: the tensors of a Hugging Face checkpoint folder, read as float32.
//
// A folder holds model.safetensors, or shards listed by model.safetensors.index.json ({"weight_map": {name: file}}).
// Every file's header is read and validated up front (model/safetensors.hpp); tensors are stored in F32, F16 or
// BF16 and converted to float32 on reading. Errors name the folder, the tensor and what was expected: a missing
// tensor, a wrong shape, an unsupported dtype, an index entry that names a file without that tensor, a non-finite
// value (inf or NaN: damaged weights would otherwise surface as a NaN logit far from the tensor that held it). The
// checkpoint remembers what was loaded, so that the loader can refuse tensors the configuration does not use
// (unused()): a config with fewer layers, or without the biases the file holds, would serve another model.
#pragma once

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/model/safetensors.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace paradyse::serve {

class HfCheckpoint {
public:
  explicit HfCheckpoint(std::string folder) : folder_(std::move(folder)) {
    namespace fs = std::filesystem;
    const fs::path dir(folder_);
    check(fs::is_directory(dir), "hf checkpoint: \"{}\" is not a folder", folder_);
    const fs::path single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
    if (fs::exists(single)) {
      open_file("model.safetensors");
      for (const safetensors::TensorEntry& t : files_[0].header.tensors) where_[t.name] = 0;
    } else {
      check(fs::exists(index), "hf checkpoint: \"{}\" has neither model.safetensors nor model.safetensors.index.json",
            folder_);
      const json::Value doc = json::load_file(index.string());
      const auto map = doc.is_object() ? doc.find("weight_map") : doc.end();
      check(map != doc.end() && map->is_object(), "hf checkpoint: {} has no \"weight_map\" object", index.string());
      std::map<std::string, std::size_t> opened;
      for (const auto& [name, file] : map->items()) {
        check(file.is_string(), "hf checkpoint: {}: weight_map[\"{}\"] must be a file name", index.string(),
              printable(name));
        const std::string& f = file.get_ref<const std::string&>();
        // A plain file name of the folder: not empty, ".", "..", a path or a name with control characters (a NUL
        // would cut the name, and every message naming it).
        const bool plain = !f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos &&
                           std::none_of(f.begin(), f.end(), [](char ch) { return static_cast<unsigned char>(ch) < 0x20; });
        check(plain, "hf checkpoint: {}: weight_map[\"{}\"] = \"{}\" must name a file of the folder", index.string(),
              printable(name), printable(f));
        auto it = opened.find(f);
        if (it == opened.end()) it = opened.emplace(f, open_file(f)).first;
        check(files_[it->second].header.find(name) != nullptr,
              "hf checkpoint: {} maps \"{}\" to {}, which does not hold it", index.string(), printable(name), f);
        where_[name] = it->second;
      }
    }
  }

  const std::string& folder() const noexcept { return folder_; }
  bool has(const std::string& name) const { return where_.count(name) != 0; }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [n, f] : where_) out.push_back(n);
    return out;
  }
  // Bytes the tensors take on disk.
  std::int64_t bytes_on_disk() const {
    std::int64_t total = 0;
    for (const OpenFile& f : files_) total += f.header.data_bytes;
    return total;
  }

  // Throws unless the folder holds `name` with `shape` (reads nothing): what load() checks first. A caller that
  // allocates buffers for tensors of a shape the configuration gives checks them first, so that a corrupt
  // config.json (num_local_experts 10^6) is refused by name instead of allocating gigabytes.
  void check_shape(const std::string& name, const Shape& shape) const { (void)entry_of(name, shape); }

  // `name` as float32, checked to have `shape`.
  Tensor<float> load(const std::string& name, const Shape& shape) const {
    const auto [file_index, entry] = entry_of(name, shape);
    const OpenFile& file = files_[file_index];
    const safetensors::TensorEntry& e = *entry;
    used_.insert(name);
    Tensor<float> out(shape);
    const std::int64_t n = e.numel();
    if (e.dtype == "F32") {
      file.file->read_at(out.data(), n * 4, file.header.data_start + e.begin);
      check_finite(name, out);
      return out;
    }
    check(e.dtype == "BF16" || e.dtype == "F16", "hf checkpoint {}: tensor \"{}\" is stored as {}; expected F32, F16 or "
          "BF16", folder_, name, e.dtype);
    std::vector<std::uint16_t> raw(static_cast<std::size_t>(n));
    file.file->read_at(raw.data(), n * 2, file.header.data_start + e.begin);
    float* o = out.data();
    if (e.dtype == "BF16")
      for (std::int64_t i = 0; i < n; ++i) o[i] = float(bf16::from_bits(raw[std::size_t(i)]));
    else
      for (std::int64_t i = 0; i < n; ++i) o[i] = f16::to_float(raw[std::size_t(i)]);
    check_finite(name, out);
    return out;
  }

  // Tensors of the folder that no load() has read, sorted (rotary inv_freq buffers, recomputed, are not counted).
  std::vector<std::string> unused() const {
    std::vector<std::string> out;
    for (const auto& [n, f] : where_)
      if (!used_.count(n) && !n.ends_with("rotary_emb.inv_freq")) out.push_back(n);
    return out;
  }

private:
  std::pair<std::size_t, const safetensors::TensorEntry*> entry_of(const std::string& name, const Shape& shape) const {
    auto it = where_.find(name);
    check(it != where_.end(), "hf checkpoint {}: tensor \"{}\" is missing (expected shape {})", folder_, name, shape);
    const safetensors::TensorEntry& e = *files_[it->second].header.find(name);
    bool same = std::int64_t(e.shape.size()) == shape.rank();
    for (std::size_t d = 0; same && d < e.shape.size(); ++d) same = e.shape[d] == shape[int(d)];
    check(same, "hf checkpoint {}: tensor \"{}\" has shape [{}], expected {}", folder_, name, fmt::join(e.shape, ", "),
          shape);
    return {it->second, &e};
  }
  void check_finite(const std::string& name, const Tensor<float>& t) const {
    const std::span<const float> v = t.span();
    for (std::size_t i = 0; i < v.size(); ++i)
      check(std::isfinite(v[i]), "hf checkpoint {}: tensor \"{}\" holds {} at element {} of shape {}; expected finite "
            "weights (the file is damaged or was saved after a diverged run)", folder_, name, v[i], i, t.shape());
  }

  struct OpenFile {
    std::unique_ptr<safetensors::File> file;
    safetensors::Header header;
  };
  std::size_t open_file(const std::string& name) {
    OpenFile f;
    f.file = std::make_unique<safetensors::File>((std::filesystem::path(folder_) / name).string(), O_RDONLY);
    f.header = safetensors::read_header(*f.file);
    files_.push_back(std::move(f));
    return files_.size() - 1;
  }

  std::string folder_;
  std::vector<OpenFile> files_;
  std::map<std::string, std::size_t> where_;
  mutable std::set<std::string> used_;  // what load() has read
};

}  // namespace paradyse::serve
