// paradyse/model/checkpoint_io.hpp: writing and opening one GPT checkpoint file (the format of
// model/checkpoint_format.hpp), for every model that saves or loads one: the single group's Gpt (model/checkpoint.hpp)
// and the training mesh (model/mesh_checkpoint.hpp).
//
//   CheckpointWriter out(comm.rank() == 0, path, config, header_fields, options);   // the header, at once
//   out.write("embedding", data, count); ...                                        // every tensor, in data order
//   out.finish(comm);                                                               // collective: checksum, rename
//
//   const CheckedCheckpoint in = open_checkpoint(path, config, options);   // validated: config, names, checksum
//   in.read("layers.0.attention.w_q", out);
//
// The writer's file errors (a full disk, an unwritable folder) do not leave the collective: the writer stops writing,
// every rank goes on gathering, and finish throws on every rank (the writer its error, the others one naming it), so
// that no rank waits for a gather the writer left; the file at the path is then unchanged.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/model/checkpoint_format.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/safetensors.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse {

// What load_checkpoint accepts beyond a complete checkpoint written by save_checkpoint, and what it restores.
struct CheckpointLoadOptions {
  // Load a file that has no data checksum (written by another tool), unverified. Off: such a file is refused.
  bool allow_missing_checksum = false;
  // Also restore the AdamW moments and the step count (the file must hold them): to resume training.
  bool optimizer_state = false;
};

// What save_checkpoint writes beyond the weights.
struct CheckpointSaveOptions {
  bool optimizer_state = false;  // the AdamW moments too (to resume training)
  // The caller's metadata (string keys and values), saved beside the configuration; its keys must not be ones the
  // checkpoint uses itself (format, the configuration's fields, step, saved_on_ranks, optimizer, the checksum).
  std::vector<std::pair<std::string, std::string>> extra;
};

// The fields of a checkpoint's header that the saving model states: the optimizer step count, the group it was
// saved on (saved_on_ranks; a mesh adds its shape, saved_on_mesh), its compute dtype.
struct CheckpointHeaderFields {
  std::int64_t step = 0;
  int saved_on_ranks = 1;
  std::string_view compute_dtype = "f32";
  std::string saved_on_mesh;  // empty: a single group
};

// One checkpoint file being written (see the top of this file). Only the writer (one rank) touches the file.
class CheckpointWriter {
public:
  CheckpointWriter(bool writer, std::string path, const GptConfig& config, const CheckpointHeaderFields& fields,
                   const CheckpointSaveOptions& options)
      : writer_(writer), path_(std::move(path)),
        entries_(checkpoint_detail::entries_of(config, options.optimizer_state)) {
    using namespace checkpoint_detail;
    metadata_ = full_config_metadata(config);
    metadata_.emplace_back("step", fmt::format("{}", fields.step));
    metadata_.emplace_back("saved_on_ranks", fmt::format("{}", fields.saved_on_ranks));
    if (!fields.saved_on_mesh.empty()) metadata_.emplace_back("saved_on_mesh", fields.saved_on_mesh);
    // The run's compute type (f32, or bf16 mixed precision); the tensors are its fp32 master weights either way.
    metadata_.emplace_back("compute_dtype", std::string(fields.compute_dtype));
    if (options.optimizer_state) metadata_.emplace_back(std::string(kOptimizerKey), "adamw");
    for (const auto& [key, value] : options.extra) {
      for (const auto& [taken, ignored] : metadata_)
        check(key != taken, "save_checkpoint: the extra metadata key '{}' is one the checkpoint uses itself", key);
      check(key != kChecksumKey && key != kMetadataChecksumKey,
            "save_checkpoint: the extra metadata key '{}' is a checksum's", key);
      metadata_.emplace_back(key, value);
    }
    metadata_.emplace_back(std::string(kMetadataChecksumKey), metadata_checksum(metadata_));
    metadata_.emplace_back(std::string(kChecksumKey), std::string(16, '0'));  // fixed width: rewritten at the end
    if (!writer_) return;
    const std::string header = safetensors::encode_header(entries_, metadata_);
    data_start_ = std::int64_t(header.size());
    writing([&] {
      out_.emplace(path_);
      out_->file().write_at(header.data(), data_start_, 0);
    });
  }

  bool writer() const noexcept { return writer_; }

  // The next tensor in data order (the writer only): its name and element count must be the header's.
  void write(std::string_view name, const float* data, std::int64_t count) {
    check(next_ < entries_.size(), "save_checkpoint: tensor '{}' comes after the last of the header", name);
    const safetensors::TensorEntry& e = entries_[next_++];
    check(e.name == name && e.numel() == count, "save_checkpoint: tensor '{}' of {} elements comes where the header "
          "has '{}' of {}", name, count, e.name, e.numel());
    writing([&] { out_->file().write_at(data, count * std::int64_t(sizeof(float)), data_start_ + e.begin); });
    checksum_ = safetensors::fnv1a(data, std::size_t(count) * sizeof(float), checksum_);
  }

  // Collective over `comm` (every rank that made a writer for this file, the writer among them): the writer puts
  // the checksum in the header and the file in place; then every rank learns whether the writer failed, and throws
  // its error if it did (the file exists for every rank once this returns).
  template <Communicator C>
  void finish(C& comm) {
    if (writer_) {
      writing([&] {
        check(next_ == entries_.size(), "save_checkpoint: {} of the header's {} tensors written", next_,
              entries_.size());
      });
      metadata_.back().second = fmt::format("{:016x}", checksum_);
      const std::string header = safetensors::encode_header(entries_, metadata_);
      writing([&] {
        check(std::int64_t(header.size()) == data_start_, "save_checkpoint: the header changed size");
        out_->file().write_at(header.data(), data_start_, 0);
        out_->commit();
      });
    }
    const int failed_here = write_error_.empty() ? 0 : 1;
    int failed = 0;
    comm.all_reduce(std::span<const int>(&failed_here, 1), std::span<int>(&failed, 1), ReduceOp::max);
    if (failed == 0) return;
    // Every rank throws the writer's error (its text shared, so that any rank's report says why).
    constexpr std::size_t kChars = 1024;
    std::vector<int> mine(kChars, 0), shared(kChars, 0);
    for (std::size_t i = 0; i < std::min(write_error_.size(), kChars - 1); ++i)
      mine[i] = static_cast<unsigned char>(write_error_[i]);
    comm.all_reduce(std::span<const int>(mine), std::span<int>(shared), ReduceOp::max);
    std::string why;
    for (std::size_t i = 0; i < kChars && shared[i] != 0; ++i) why += char(shared[i]);
    throw Error(fmt::format("saving the checkpoint {} failed: {}", path_, why));
  }

private:
  template <class Io>
  void writing(Io&& io) {
    if (!write_error_.empty()) return;
    try {
      io();
    } catch (const std::exception& e) {
      write_error_ = error_reason(e, /*drop_location=*/false);
      out_.reset();  // the temporary is removed; the file at the path is unchanged
    }
  }
  bool writer_;
  std::string path_;
  std::vector<safetensors::TensorEntry> entries_;
  checkpoint_detail::Metadata metadata_;
  std::optional<safetensors::AtomicFile> out_;
  std::string write_error_;
  std::int64_t data_start_ = 0;
  std::uint64_t checksum_ = safetensors::fnv1a(nullptr, 0);
  std::size_t next_ = 0;  // the next entry to write, in data order
};

// A checkpoint file opened for a model of `config`, every check passed (see open_checkpoint).
struct CheckedCheckpoint {
  std::string path;
  safetensors::File file;
  safetensors::Header header;
  std::int64_t step = 0;        // the optimizer steps taken (read when the optimizer state is asked for; else 0)
  bool optimizer_state = false;  // the file holds the AdamW moments
  // The tensor `name` (one the checks found) into `out` (its element count).
  void read(const std::string& name, float* out) const {
    const safetensors::TensorEntry& e = *header.find(name);
    file.read_at(out, e.end - e.begin, header.data_start + e.begin);
  }
};

// The checkpoint at `path`, opened and validated for a model of `config` (per rank, no communication): the format,
// the configuration (every field that differs named with both values), the names, dtypes and shapes of every tensor
// (the moments too when the file has them; with options.optimizer_state they must be there), and the checksum over
// the whole data buffer. Every mismatch is an Error naming the file, the tensor or field, and what was expected.
inline CheckedCheckpoint open_checkpoint(const std::string& path, const GptConfig& config,
                                         CheckpointLoadOptions options = {}) {
  using namespace checkpoint_detail;
  CheckedCheckpoint in{path, safetensors::File(path, O_RDONLY), {}, 0, false};
  in.header = safetensors::read_header(in.file);
  const safetensors::Header& header = in.header;
  const GptConfig saved = config_of(header, path);
  if (!(saved == config)) {
    const Metadata a = full_config_metadata(saved), b = full_config_metadata(config);
    const auto value = [](const Metadata& m, const std::string& key) {
      for (const auto& [k, v] : m)
        if (k == key) return v;
      return std::string("none (a dense GPT)");  // only MoE keys can be absent
    };
    std::vector<std::string> keys;  // of either, in order
    for (const Metadata* m : {&a, &b})
      for (const auto& [key, ignored] : *m)
        if (std::find(keys.begin(), keys.end(), key) == keys.end()) keys.push_back(key);
    std::string diff;
    for (const std::string& key : keys)
      if (value(a, key) != value(b, key))
        diff += fmt::format("{}{}: checkpoint {}, model {}", diff.empty() ? "" : "; ", key, value(a, key), value(b, key));
    throw Error(fmt::format("checkpoint {}: it holds a different model ({})", path, diff));
  }
  // Names, dtypes and shapes (the moments too when the file has them).
  const std::string* optimizer = header.meta(kOptimizerKey);
  check(optimizer == nullptr || *optimizer == "adamw", "checkpoint {}: optimizer state '{}', expected adamw", path,
        printable(optimizer ? *optimizer : std::string()));
  check(!options.optimizer_state || optimizer != nullptr,
        "checkpoint {}: it holds the weights only, not the optimizer state needed to resume training (saved without "
        "CheckpointSaveOptions::optimizer_state)", path);
  in.optimizer_state = optimizer != nullptr;
  in.step = options.optimizer_state ? to_integer(required(header, "step", path), "step", path, 0,
                                                 std::numeric_limits<std::int64_t>::max())
                                    : 0;
  const std::vector<safetensors::TensorEntry> expected = entries_of(config, optimizer != nullptr);
  for (const safetensors::TensorEntry& want : expected) {
    const safetensors::TensorEntry* got = header.find(want.name);
    check(got != nullptr, "checkpoint {}: tensor '{}' is missing", path, want.name);
    check(got->dtype == "F32", "checkpoint {}: tensor '{}' has dtype {}, expected F32", path, want.name, got->dtype);
    check(got->shape == want.shape, "checkpoint {}: tensor '{}' has shape [{}], expected [{}]", path, want.name,
          fmt::join(got->shape, ", "), fmt::join(want.shape, ", "));
  }
  for (const safetensors::TensorEntry& got : header.tensors) {
    bool known = false;
    for (const safetensors::TensorEntry& want : expected) known = known || want.name == got.name;
    check(known, "checkpoint {}: unexpected tensor '{}' (the model has no such weight)", path, got.name);
  }
  // The checksum over the whole data buffer, in blocks.
  const std::string* stored = header.meta(kChecksumKey);
  check(stored != nullptr || options.allow_missing_checksum,
        "checkpoint {}: the metadata has no '{}' checksum, so its data cannot be verified (not written by "
        "save_checkpoint?); pass CheckpointLoadOptions{{.allow_missing_checksum = true}} to load it unverified",
        path, kChecksumKey);
  if (stored) {
    Tensor<std::byte> block(Shape{std::min<std::int64_t>(std::int64_t(1) << 20, std::max<std::int64_t>(header.data_bytes, 1))});
    std::uint64_t checksum = safetensors::fnv1a(nullptr, 0);
    for (std::int64_t at = 0; at < header.data_bytes; at += block.numel()) {
      const std::int64_t n = std::min(block.numel(), header.data_bytes - at);
      in.file.read_at(block.data(), n, header.data_start + at);
      checksum = safetensors::fnv1a(block.data(), std::size_t(n), checksum);
    }
    check(fmt::format("{:016x}", checksum) == *stored,
          "checkpoint {}: the data is corrupted (checksum {:016x}, the header says {})", path, checksum,
          printable(*stored));
  }
  return in;
}

}  // namespace paradyse
