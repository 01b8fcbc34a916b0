// Fuzz targets (tests/fuzz/mutate.hpp) of the checkpoint readers: read_checkpoint_metadata, read_checkpoint_config
// (model/checkpoint_format.hpp), read_training_checkpoint (model/resume.hpp) and load_checkpoint (model/checkpoint.hpp).
// Seeds: checkpoints written by the library at tiny size, a dense GPT with its AdamW state and train_gpt's
// training metadata (train.next_step, train.args, train.data) and an MoE GPT (dense and MoE layers, shared experts).
// The header's JSON is what is mutated (the 8-byte length prefix is rewritten to match, so the mutations reach the
// metadata and tensor entries instead of stopping at the length check); one more target mutates whole files, the
// length prefix and the data included.
#include "fuzz/mutate.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/resume.hpp"
#include "paradyse/model/safetensors.hpp"
#include "paradyse/strategy/megatron_ts.hpp"
#include "paradyse/strategy/switchable.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace {

using namespace paradyse;
namespace fs = std::filesystem;
using FuzzModel = Gpt<Switchable<MegatronTS<ops::Cpu>>>;

GptConfig tiny_dense() {
  GptConfig c;
  c.layer.hidden = 8;
  c.layer.heads = 2;
  c.layer.kv_heads = 1;
  c.layer.head_dim = 4;
  c.layer.ffn = 16;
  c.layer.causal = true;
  c.layers = 2;
  c.vocab = 7;
  return c;
}
GptConfig tiny_moe() {
  GptConfig c = tiny_dense();
  c.layer.activation = Activation::swiglu;
  c.tied_head = true;
  MoeConfig m;
  m.hidden = c.layer.hidden;
  m.experts = 3;
  m.top_k = 2;
  m.expert_ffn = 4;
  m.shared_experts = 1;
  m.shared_ffn = 4;
  m.shared_gate = true;
  c.moe = MoeLayers{m, 1};  // layer 0 dense, layer 1 MoE
  return c;
}


// A checkpoint file split into its header JSON and its data buffer.
struct SplitFile {
  std::string header, data;
};
SplitFile split(const std::string& file) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[std::size_t(i)]);
  return {file.substr(8, n), file.substr(8 + n)};
}
std::string join(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[std::size_t(i)] = char((std::uint64_t(header.size()) >> (8 * i)) & 0xff);
  return out + header + data;
}

// Every reader of a checkpoint on the file at `path`; `model` is of the seed's configuration, `training` whether the
// seed is a training checkpoint (AdamW state, train.next_step).
void read_checkpoint(const std::string& path, FuzzModel& model, bool training) {
  (void)read_checkpoint_metadata(path);
  const GptConfig c = read_checkpoint_config(path);
  CHECK(c.layers >= 1);
  if (training) {
    const int next = read_training_checkpoint(path).next_step;  // not inside CHECK: doctest would take an exception
    CHECK(next >= 1);
  }
  load_checkpoint(model, path, {.optimizer_state = training});
}

}  // namespace

TEST_CASE("fuzz checkpoint: metadata, configuration, next step and load of mutated headers and files") {
  fuzz::TempFolder dir;
  const std::string dense_path = (dir.path / "dense.safetensors").string(), moe_path = (dir.path / "moe.safetensors").string();
  run_ranks(1, [&](ThreadCommunicator& comm) {
    FuzzModel dense(tiny_dense(), 1, 0, 3);
    save_checkpoint(comm, dense, dense_path,
                    {.optimizer_state = true,
                     .extra = {{"train.args", "--steps\n6\n--seed\n1"}, {"train.next_step", "4"}, {"train.data", "seed 1"}}});
    FuzzModel moe(tiny_moe(), 1, 0, 5);
    save_checkpoint(comm, moe, moe_path);
  });
  FuzzModel dense_target(tiny_dense(), 1, 0, 1), moe_target(tiny_moe(), 1, 0, 1);
  const std::string input = (dir.path / "input.safetensors").string();
  auto write = [&](const std::string& bytes) { return dir.write("input.safetensors", bytes); };

  // The regression cases (issue 27): train.next_step "-6" crashed train_gpt; "x6" and "99999999999" leaked
  // std::stoi's std::invalid_argument and std::out_of_range.
  const SplitFile dense_file = split(fuzz::read_file(dense_path));
  std::vector<std::string> regressions;
  for (const char* bad : {"-6", "x6", "99999999999", "", "4x", " 4"}) {
    std::string header = dense_file.header;
    const std::string from = "\"train.next_step\":\"4\"";
    const std::size_t at = header.find(from);
    REQUIRE(at != std::string::npos);
    header.replace(at, from.size(), std::string("\"train.next_step\":\"") + bad + "\"");
    regressions.push_back(header);
  }
  // Under format v2's metadata checksum an edited header stops at the checksum; the parser of the training fields
  // itself must refuse each regression value too (a v1 file has no checksum).
  const auto dense_metadata = read_checkpoint_metadata(dense_path);
  for (const char* bad : {"-6", "x6", "99999999999", "", "4x", " 4"}) {
    auto metadata = dense_metadata;
    for (auto& [key, value] : metadata)
      if (key == "train.next_step") value = bad;
    CHECK_THROWS_AS(training_checkpoint_info(metadata, dense_path), Error);
  }
  fuzz::run("checkpoint_training", {dense_file.header},
            [&](const std::string& header) { read_checkpoint(write(join(header, dense_file.data)), dense_target, true); },
            regressions, input);

  const SplitFile moe_file = split(fuzz::read_file(moe_path));
  fuzz::run("checkpoint_moe", {moe_file.header},
            [&](const std::string& header) { read_checkpoint(write(join(header, moe_file.data)), moe_target, false); },
            {}, input);

  // Whole files: the length prefix and the data are mutated too.
  fuzz::run("checkpoint_file", {fuzz::read_file(dense_path)},
            [&](const std::string& file) { read_checkpoint(write(file), dense_target, true); }, {}, input);
}
