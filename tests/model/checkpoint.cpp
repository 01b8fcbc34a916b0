// GPT checkpoints (safetensors, global tensors, atomic writes): round trips, loading on another group size, and
// clear rejections of truncated, corrupted and mismatched files.
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/resume.hpp"

#include "strategy/harness.hpp"
#include "support/temp_folder.hpp"
#include "support/tolerance.hpp"

#include "paradyse/comm/threads.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace paradyse;
using namespace paradyse::testing;
using Strategies = AllStrategies<>;
using Model = Gpt<Strategies>;
namespace fs = std::filesystem;

GptConfig test_config(bool tied = false, Activation activation = Activation::gelu) {
  GptConfig c;
  c.layer = small_config(4, 2, 16);  // GQA: kv heads replicated on 4 ranks
  c.layer.activation = activation;
  c.layer.causal = c.layer.zigzag = true;
  c.layers = 2;
  c.vocab = 11;
  c.tied_head = tied;
  return c;
}

// A fresh folder (support/temp_folder.hpp) and its files.
struct TempDir : TempFolder {
  TempDir() : TempFolder("paradyse_checkpoint") {}
  std::string file(const std::string& name) const { return (path / name).string(); }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path)) out.push_back(e.path().filename().string());
    return out;
  }
};

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// Rank 0's view of a model's global weights: the replicated pack and every layer gathered.
struct Snapshot {
  std::vector<float> replicated;
  std::vector<GlobalLayerWeights<float>> layers;
};

// Trains `steps` steps on p ranks from `seed` (so the weights are not the initial ones), saves to `path` and returns
// the global weights.
Snapshot train_and_save(const GptConfig& c, int p, std::uint64_t seed, int steps, const std::string& path) {
  Snapshot snapshot;
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    Model model(c, p, r, seed);
    const std::int64_t s = 13;
    Rng rng(seed);
    std::vector<std::int32_t> tokens, targets;
    for (std::int64_t i = 0; i <= s; ++i) tokens.push_back(std::int32_t(rng.below(std::uint64_t(c.vocab))));
    targets.assign(tokens.begin() + 1, tokens.end());
    tokens.pop_back();
    const SequenceLayout layout(s, p, c.layer.zigzag);
    const Tensor<std::int32_t> x = shard_tokens(tokens, 1, layout, r), y = shard_tokens(targets, 1, layout, r);
    const StackPlan plan = uniform_plan<Strategies>(std::size_t(c.layers), "METP");
    for (int i = 0; i < steps; ++i) {
      model.zero_gradients();
      model.forward_backward(comm, pool, plan, s, x.view(), y.view());
      model.optimizer_step({});
    }
    save_checkpoint(comm, model, path);
    // The snapshot outlives this rank's tracker (it ends with run_ranks): charge it to the process's tracker.
    ScopedTracker process(MemoryTracker::process_default());
    std::vector<GlobalLayerWeights<float>> layers;
    for (int l = 0; l < c.layers; ++l)
      layers.push_back(checkpoint_detail::gather_layer(comm, c.layer, model.stack().weights()[std::size_t(l)]));
    if (r == 0) {
      snapshot.replicated.assign(model.replicated().span().begin(), model.replicated().span().end());
      snapshot.layers = std::move(layers);
    }
  });
  return snapshot;
}

// Loads `path` into a model drawn from another seed on p ranks and checks every rank holds the snapshot's weights.
void check_loads_as(const GptConfig& c, int p, const std::string& path, const Snapshot& want) {
  Findings findings;
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    Model model(c, p, r, 999);
    load_checkpoint(model, path);
    findings.compare(model.replicated().span(), want.replicated, fmt::format("p={} rank {} replicated", p, r), {0, 0});
    for (int l = 0; l < c.layers; ++l) {
      const LayerWeights shard = shard_of(want.layers[std::size_t(l)], c.layer, p, r);
      const LayerWeights& got = model.stack().weights()[std::size_t(l)];
      const std::string where = fmt::format("p={} rank {} layer {}", p, r, l);
      findings.compare(got.attention.packed.span(), shard.attention.packed.span(), where + " attention", {0, 0});
      findings.compare(got.mlp.packed.span(), shard.mlp.packed.span(), where + " mlp", {0, 0});
      findings.compare(got.norms.packed.span(), shard.norms.packed.span(), where + " norms", {0, 0});
    }
  });
  findings.check_all(fmt::format("load {} on p={}", path, p));
}

// The error message of load_checkpoint on `path` (empty when it loads).
std::string load_error(const GptConfig& c, const std::string& path, CheckpointLoadOptions options = {}) {
  try {
    Model model(c, 1, 0, 1);
    load_checkpoint(model, path, options);
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE("checkpoint: round trip, bit for bit, untied and tied heads, GELU and SwiGLU") {
  TempDir dir;
  for (const GptConfig& c : {test_config(false, Activation::gelu), test_config(true, Activation::swiglu)}) {
    const std::string path = dir.file(c.tied_head ? "tied.safetensors" : "untied.safetensors");
    const Snapshot saved = train_and_save(c, 2, 7, 2, path);
    check_loads_as(c, 2, path, saved);
    const GptConfig read = read_checkpoint_config(path);
    CHECK(read == c);
  }
  // Only the checkpoints remain: no temporary files.
  CHECK(dir.names().size() == 2);
}

TEST_CASE("checkpoint: saved on p=2, loads on p=4, p=3 and p=1 (global tensors)") {
  TempDir dir;
  GptConfig c = test_config();
  c.layer = small_config(12, 12, 24);  // divisible by 1..4
  c.layer.causal = c.layer.zigzag = true;
  const std::string path = dir.file("p2.safetensors");
  const Snapshot saved = train_and_save(c, 2, 3, 2, path);
  for (int p : {4, 3, 1}) check_loads_as(c, p, path, saved);
}

TEST_CASE("checkpoint: the file is safetensors (length prefix, JSON header, aligned data, every tensor)") {
  TempDir dir;
  const GptConfig c = test_config();
  const std::string path = dir.file("m.safetensors");
  const Snapshot saved = train_and_save(c, 1, 5, 1, path);
  const std::string bytes = read_all(path);
  REQUIRE(bytes.size() > 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[std::size_t(i)]);
  CHECK((8 + n) % 8 == 0);
  CHECK(bytes[8] == '{');
  const std::string json = bytes.substr(8, n);
  CHECK(json.find("\"__metadata__\"") != std::string::npos);
  CHECK(json.find("\"layers.1.mlp.w_out\":{\"dtype\":\"F32\",\"shape\":[16,16]") != std::string::npos);
  const safetensors::File file(path, O_RDONLY);
  const safetensors::Header header = safetensors::read_header(file);
  CHECK(header.tensors.size() == checkpoint_detail::entries_of(c).size());
  CHECK(header.data_start + header.data_bytes == std::int64_t(bytes.size()));
  // The embedding's bytes are the float32 values, little-endian, row-major.
  const safetensors::TensorEntry* e = header.find("embedding");
  REQUIRE(e != nullptr);
  std::vector<float> embedding(std::size_t(c.vocab * c.layer.hidden));
  std::memcpy(embedding.data(), bytes.data() + header.data_start + e->begin, embedding.size() * sizeof(float));
  const Tolerance exact{0, 0};
  CHECK_CLOSE(embedding, std::span<const float>(saved.replicated.data(), embedding.size()), exact);
}

TEST_CASE("checkpoint: truncated and corrupted files are rejected with a clear message") {
  TempDir dir;
  const GptConfig c = test_config();
  const std::string path = dir.file("good.safetensors");
  train_and_save(c, 1, 5, 1, path);
  REQUIRE(load_error(c, path).empty());
  const std::string good = read_all(path);
  const std::string bad = dir.file("bad.safetensors");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(good[std::size_t(i)]);

  SUBCASE("truncated in the data") {
    write_all(bad, good.substr(0, good.size() - 5));
    CHECK(load_error(c, bad).find("truncated") != std::string::npos);
  }
  SUBCASE("truncated in the header") {
    write_all(bad, good.substr(0, 8 + n / 2));
    CHECK(load_error(c, bad).find("truncated") != std::string::npos);
  }
  SUBCASE("shorter than the length prefix") {
    write_all(bad, good.substr(0, 5));
    CHECK(load_error(c, bad).find("too short for the 8-byte header length") != std::string::npos);
  }
  SUBCASE("a flipped byte in the data") {
    std::string copy = good;
    copy[copy.size() - 3] = char(copy[copy.size() - 3] ^ 0x10);
    write_all(bad, copy);
    CHECK(load_error(c, bad).find("the data is corrupted (checksum") != std::string::npos);
  }
  SUBCASE("garbage in the header") {
    std::string copy = good;
    copy[8 + n / 2] = '#';
    write_all(bad, copy);
    CHECK(load_error(c, bad).find("corrupted header") != std::string::npos);
  }
  SUBCASE("trailing bytes") {
    write_all(bad, good + "extra!!!");
    CHECK(load_error(c, bad).find("trailing bytes") != std::string::npos);
  }
  SUBCASE("not a file at all") {
    CHECK(load_error(c, dir.file("missing.safetensors")).find("cannot open") != std::string::npos);
  }
}

TEST_CASE("checkpoint: names, dtypes, shapes and the configuration are checked") {
  TempDir dir;
  const GptConfig c = test_config();
  const std::string path = dir.file("good.safetensors");
  train_and_save(c, 1, 5, 1, path);

  SUBCASE("another configuration") {
    GptConfig other = c;
    other.layer.ffn = 8;
    const std::string error = load_error(other, path);
    CHECK(error.find("holds a different model (ffn: checkpoint 16, model 8)") != std::string::npos);
  }
  // Hand-made files: the real entries and metadata (no checksum, so loaded with allow_missing_checksum), one thing
  // changed.
  const CheckpointLoadOptions unverified{.allow_missing_checksum = true};
  auto write_variant = [&](auto&& change) {
    std::vector<safetensors::TensorEntry> entries = checkpoint_detail::entries_of(c);
    checkpoint_detail::Metadata metadata = checkpoint_detail::config_metadata(c);
    change(entries, metadata);
    const std::string header = safetensors::encode_header(entries, metadata);
    const std::int64_t data = entries.empty() ? 0 : entries.back().end;
    const std::string file = dir.file("variant.safetensors");
    write_all(file, header + std::string(std::size_t(data), '\0'));
    return file;
  };
  using Entries = std::vector<safetensors::TensorEntry>;
  using Meta = checkpoint_detail::Metadata;
  SUBCASE("the hand-made file itself loads") {
    CHECK(load_error(c, write_variant([](Entries&, Meta&) {}), unverified).empty());
  }
  SUBCASE("a missing tensor") {
    const std::string file = write_variant([](Entries& e, Meta&) { std::erase_if(e, [](auto& t) { return t.name == "layers.1.mlp.w_out"; }); });
    CHECK(load_error(c, file, unverified).find("tensor 'layers.1.mlp.w_out' is missing") != std::string::npos);
  }
  SUBCASE("an unexpected tensor") {
    const std::string file = write_variant([](Entries& e, Meta&) { e.push_back({"extra.bias", "F32", {3}, 0, 0}); });
    CHECK(load_error(c, file, unverified).find("unexpected tensor 'extra.bias'") != std::string::npos);
  }
  SUBCASE("a wrong dtype") {
    const std::string file = write_variant([](Entries& e, Meta&) { e[0].dtype = "F16"; });
    CHECK(load_error(c, file, unverified).find("tensor 'embedding' has dtype F16, expected F32") != std::string::npos);
  }
  SUBCASE("a wrong shape") {
    const std::string file = write_variant([](Entries& e, Meta&) { e[0].shape = {16, 11}; });
    CHECK(load_error(c, file, unverified).find("tensor 'embedding' has shape [16, 11], expected [11, 16]") != std::string::npos);
  }
  SUBCASE("not a paradyse checkpoint") {
    const std::string file = write_variant([](Entries&, Meta& m) { m.clear(); });
    CHECK(load_error(c, file, unverified).find("the metadata has no 'format'") != std::string::npos);
  }
}

TEST_CASE("checkpoint: writes are atomic (a failed write leaves the old file and no temporary)") {
  TempDir dir;
  const GptConfig c = test_config();
  const std::string path = dir.file("model.safetensors");
  train_and_save(c, 1, 5, 1, path);
  const std::string before = read_all(path);
  {
    safetensors::AtomicFile half_written(path);
    half_written.file().write_at("garbage", 7, 0);
    CHECK(fs::exists(half_written.temporary_path()));
    CHECK(fs::path(half_written.temporary_path()).parent_path() == dir.path);  // same folder: rename is atomic
  }  // destroyed without commit(), as an exception during a save would
  CHECK(read_all(path) == before);
  CHECK(dir.names() == std::vector<std::string>{"model.safetensors"});
  CHECK(load_error(c, path).empty());
  // A save over an existing checkpoint replaces it whole.
  train_and_save(c, 2, 6, 1, path);
  CHECK(read_all(path) != before);
  CHECK(load_error(c, path).empty());
  CHECK(dir.names() == std::vector<std::string>{"model.safetensors"});
  CHECK_THROWS_WITH_AS(safetensors::AtomicFile(dir.file("no/such/folder/x.safetensors")), doctest::Contains("does not exist"), Error);
}

TEST_CASE("checkpoint: a file without the data checksum is refused unless asked for, and says why") {
  TempDir dir;
  const GptConfig c = test_config();
  std::vector<safetensors::TensorEntry> entries = checkpoint_detail::entries_of(c);
  const std::string header = safetensors::encode_header(entries, checkpoint_detail::config_metadata(c));
  const std::string file = dir.file("foreign.safetensors");
  write_all(file, header + std::string(std::size_t(entries.back().end), '\0'));
  const std::string error = load_error(c, file);
  CHECK(error.find("has no 'data_fnv1a64' checksum, so its data cannot be verified") != std::string::npos);
  CHECK(error.find("allow_missing_checksum") != std::string::npos);
  CHECK(load_error(c, file, {.allow_missing_checksum = true}).empty());
}

TEST_CASE("checkpoint: metadata integers out of range name the text and the range") {
  TempDir dir;
  const GptConfig c = test_config();
  auto with_meta = [&](const std::string& key, const std::string& value) {
    std::vector<safetensors::TensorEntry> entries = checkpoint_detail::entries_of(c);
    checkpoint_detail::Metadata metadata = checkpoint_detail::config_metadata(c);
    for (auto& [k, v] : metadata)
      if (k == key) v = value;
    const std::string file = dir.file("meta.safetensors");
    const std::string header = safetensors::encode_header(entries, metadata);  // assigns the offsets
    write_all(file, header + std::string(std::size_t(entries.back().end), '\0'));
    try {
      read_checkpoint_config(file);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string error = with_meta("layers", "99999999999999999999");
  CAPTURE(error);
  CHECK(error.find("metadata 'layers' = \"99999999999999999999\" is out of range [1, 65536]") != std::string::npos);
  CHECK(error.find("-1") == std::string::npos);
  error = with_meta("layers", "4294967298");  // 2^32 + 2: an int cast would read 2
  CHECK(error.find("metadata 'layers' = \"4294967298\" is out of range") != std::string::npos);
  CHECK(with_meta("hidden", "-16").find("metadata 'hidden' = \"-16\" is out of range [1, 16777216]") != std::string::npos);
  CHECK(with_meta("vocab", "12abc").find("metadata 'vocab' = \"12abc\" is not an integer") != std::string::npos);
  CHECK(with_meta("norm_eps", "nan").find("metadata 'norm_eps' = \"nan\" is not a finite number") != std::string::npos);
  CHECK(with_meta("rope_base", "1e999").find("is not a finite number") != std::string::npos);
}

TEST_CASE("checkpoint: a failed rename quotes its own errno, not \"Success\"") {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  safetensors::AtomicFile out(path);
  out.file().write_at("x", 1, 0);
  fs::create_directories(fs::path(path) / "inside");  // the destination became a non-empty folder: rename fails
  std::string error;
  try {
    out.commit();
  } catch (const Error& e) {
    error = e.what();
  }
  CAPTURE(error);
  CHECK(error.find("cannot rename") != std::string::npos);
  CHECK(error.find("Success") == std::string::npos);
  CHECK((error.find("Is a directory") != std::string::npos || error.find("Directory not empty") != std::string::npos));
}

TEST_CASE("checkpoint: a save removes the temporaries that killed saves of the same file left, and only those") {
  TempDir dir;
  const GptConfig c = test_config();
  const std::string path = dir.file("model.safetensors");
  // What a save killed mid-write leaves: a hidden temporary nobody holds. Another file's temporary stays.
  write_all(dir.file(".model.safetensors.tmp.Ab12Cd"), std::string(1000, 'x'));
  write_all(dir.file(".other.safetensors.tmp.Ab12Cd"), "y");
  write_all(dir.file(".model.safetensors.tmp.longer1"), "z");  // not a mkstemp name
  {
    safetensors::AtomicFile in_progress(path);  // a save in progress holds its temporary
    train_and_save(c, 1, 5, 1, path);
    CHECK(fs::exists(in_progress.temporary_path()));
  }
  std::vector<std::string> names = dir.names();
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{".model.safetensors.tmp.longer1", ".other.safetensors.tmp.Ab12Cd", "model.safetensors"});
  CHECK(load_error(c, path).empty());
}

TEST_CASE("checkpoint: check_writable_target fails at once for a missing folder, a folder, a read-only folder") {
  TempDir dir;
  CHECK_NOTHROW(check_writable_target(dir.file("model.safetensors")));
  CHECK(dir.names().empty());  // the probe is gone
  const std::string missing = "the folder \"" + dir.file("missing") + "\" does not exist";
  CHECK_THROWS_WITH_AS(check_writable_target(dir.file("missing/model.safetensors")), doctest::Contains(missing.c_str()),
                       Error);
  CHECK_THROWS_WITH_AS(check_writable_target(dir.path.string()), doctest::Contains("it is a folder"), Error);
  CHECK_THROWS_WITH_AS(check_writable_target(dir.path.string() + "/"), doctest::Contains("names a folder"), Error);
  write_all(dir.file("plain"), "x");
  CHECK_THROWS_WITH_AS(check_writable_target(dir.file("plain/model.safetensors")), doctest::Contains("is not a folder"), Error);
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directory(dir.path / "ro");
    fs::permissions(dir.path / "ro", fs::perms::owner_read | fs::perms::owner_exec);
    CHECK_THROWS_WITH_AS(check_writable_target(dir.file("ro/model.safetensors")), doctest::Contains("cannot create a file"), Error);
    fs::permissions(dir.path / "ro", fs::perms::owner_all);
  }
}

TEST_CASE("checkpoint: save_checkpoint_bytes is what a save allocates beyond the model, so a save can be budgeted") {
  TempDir dir;
  const GptConfig c = test_config();
  const int p = 2;
  const std::int64_t predicted = save_checkpoint_bytes(c, p);
  CHECK(predicted > 0);
  std::vector<std::size_t> growth(p);
  run_ranks(p, [&](ThreadCommunicator& comm) {
    Model model(c, p, comm.rank(), 5);
    MemoryTracker& tracker = MemoryTracker::current();
    const std::size_t before = tracker.in_use();
    tracker.reset_peak();
    save_checkpoint(comm, model, dir.file("budget.safetensors"));
    growth[std::size_t(comm.rank())] = tracker.peak() - before;
    // Under a cap of the model plus the budget, the save fits (below, with half the budget, it runs out of memory
    // and leaves the previous file as it was).
    tracker.set_cap(before + std::size_t(predicted));
    save_checkpoint(comm, model, dir.file("budget.safetensors"));
    tracker.set_cap(MemoryTracker::kNoCap);
  });
  for (int r = 0; r < p; ++r) CHECK(growth[std::size_t(r)] == std::size_t(predicted));
  const std::string saved = read_all(dir.file("budget.safetensors"));
  CHECK_THROWS_AS(run_ranks(p, [&](ThreadCommunicator& comm) {
                    Model model(c, p, comm.rank(), 6);
                    MemoryTracker& tracker = MemoryTracker::current();
                    tracker.set_cap(tracker.in_use() + std::size_t(predicted) / 2);
                    save_checkpoint(comm, model, dir.file("budget.safetensors"));
                  }),
                  OutOfMemory);
  CHECK(read_all(dir.file("budget.safetensors")) == saved);
  CHECK(dir.names().size() == 1);  // no temporary left
}

namespace {

// Steps [from, to) of a deterministic training run: step i trains on its own random sequence (drawn from the step
// index, so a resumed run sees the same data) under a plan that mixes strategies. Returns the losses.
std::vector<double> train_steps(Model& model, ThreadCommunicator& comm, BufferPool& pool, int from, int to) {
  const GptConfig& c = model.config();
  const int p = comm.size(), r = comm.rank();
  const StackPlan plan = uniform_plan<Strategies>(std::size_t(c.layers), "MegatronTS");
  const StackPlan other = uniform_plan<Strategies>(std::size_t(c.layers), "METP");
  std::vector<double> losses;
  for (int step = from; step < to; ++step) {
    const std::int64_t s = 9 + step;  // lengths change from step to step
    Rng rng(1000 + std::uint64_t(step));
    std::vector<std::int32_t> tokens, targets;
    for (std::int64_t i = 0; i <= s; ++i) tokens.push_back(std::int32_t(rng.below(std::uint64_t(c.vocab))));
    targets.assign(tokens.begin() + 1, tokens.end());
    tokens.pop_back();
    const SequenceLayout layout(s, p, c.layer.zigzag);
    const Tensor<std::int32_t> x = shard_tokens(tokens, 1, layout, r), y = shard_tokens(targets, 1, layout, r);
    model.zero_gradients();
    losses.push_back(model.forward_backward(comm, pool, step % 2 ? other : plan, s, x.view(), y.view()).loss);
    ops::AdamWConfig adamw;
    adamw.learning_rate = 0.01f;
    adamw.weight_decay = 0.1f;
    model.optimizer_step(adamw);
  }
  return losses;
}

// Everything the optimizer holds on this rank, flattened: weights, both moments (layers and replicated pack).
std::vector<float> optimizer_state_of(Model& model) {
  std::vector<float> out;
  const auto add = [&](const Tensor<float>& t) { out.insert(out.end(), t.span().begin(), t.span().end()); };
  for (auto* layers : {&model.stack().weights(), &model.moment1(), &model.moment2()})
    for (const LayerWeights& w : *layers) {
      add(w.attention.packed);
      add(w.mlp.packed);
      add(w.norms.packed);
    }
  add(model.replicated());
  add(model.replicated_moment1());
  add(model.replicated_moment2());
  return out;
}

// One rank's stop-and-resume: `total` steps uninterrupted; then k steps in a model of the same seed, saved to path
// with `save`; then resumed from path in a model drawn from another seed, for the remaining steps. state_of(model)
// reads the state compared bitwise after both runs.
struct StopAndResume {
  std::vector<double> straight, resumed;   // losses: steps 0..total, and k..total
  std::vector<float> straight_state, resumed_state;
  std::int64_t resumed_steps = -1;         // the resumed model's steps_taken() right after loading
};

template <class StateOf>
StopAndResume stop_and_resume(const GptConfig& c, ThreadCommunicator& comm, BufferPool& pool, int total, int k,
                              const std::string& path, const CheckpointSaveOptions& save, StateOf state_of) {
  const int p = comm.size(), r = comm.rank();
  StopAndResume out;
  {  // uninterrupted
    Model model(c, p, r, 7);
    out.straight = train_steps(model, comm, pool, 0, total);
    out.straight_state = state_of(model);
  }
  {  // stopped after k steps
    Model model(c, p, r, 7);
    train_steps(model, comm, pool, 0, k);
    save_checkpoint(comm, model, path, save);
  }
  {  // resumed in a model drawn from another seed
    Model model(c, p, r, 12345);
    load_checkpoint(model, path, {.optimizer_state = true});
    out.resumed_steps = model.steps_taken();
    out.resumed = train_steps(model, comm, pool, k, total);
    out.resumed_state = state_of(model);
  }
  return out;
}

}  // namespace

TEST_CASE("checkpoint: a run stopped at step k and resumed from its checkpoint gives the uninterrupted losses, bit for bit") {
  TempDir dir;
  for (const bool tied : {false, true})
    for (const int p : {1, 2, 4}) {
      const GptConfig c = test_config(tied, tied ? Activation::swiglu : Activation::gelu);
      const int total = 5, k = 2;
      const std::string path = dir.file(fmt::format("resume_p{}_{}.safetensors", p, tied));
      std::vector<double> straight, resumed, weights_only;
      std::vector<std::vector<float>> straight_state(static_cast<std::size_t>(p)), resumed_state(static_cast<std::size_t>(p));
      std::vector<std::int64_t> resumed_steps(static_cast<std::size_t>(p));
      run_ranks(p, [&](ThreadCommunicator& comm) {
        const int r = comm.rank();
        BufferPool pool;
        const StopAndResume run =
            stop_and_resume(c, comm, pool, total, k, path, {.optimizer_state = true, .extra = {{"train.next_step", "2"}}},
                            [](Model& model) { return optimizer_state_of(model); });
        if (r == 0) straight = run.straight, resumed = run.resumed;
        straight_state[std::size_t(r)] = run.straight_state;
        resumed_state[std::size_t(r)] = run.resumed_state;
        resumed_steps[std::size_t(r)] = run.resumed_steps;
        {  // the weights alone (AdamW restarted): a different continuation, so the moments are what made it exact
          Model model(c, p, r, 12345);
          load_checkpoint(model, path);
          const std::vector<double> losses = train_steps(model, comm, pool, k, total);
          if (r == 0) weights_only = losses;
        }
      });
      CAPTURE(p);
      CAPTURE(tied);
      REQUIRE(resumed.size() == std::size_t(total - k));
      for (int i = k; i < total; ++i) CHECK(resumed[std::size_t(i - k)] == straight[std::size_t(i)]);  // bitwise
      for (int r = 0; r < p; ++r) {
        CHECK(resumed_steps[std::size_t(r)] == k);
        CHECK(resumed_state[std::size_t(r)] == straight_state[std::size_t(r)]);  // weights and moments, bitwise
      }
      CHECK(weights_only[0] == straight[std::size_t(k)]);  // the first step's loss depends on the weights only
      CHECK(weights_only.back() != straight.back());        // later ones on the moments too
      // The caller's metadata comes back; a weights-only load of the same file still works (done above).
      const auto metadata = read_checkpoint_metadata(path);
      CHECK(std::find(metadata.begin(), metadata.end(), std::pair<std::string, std::string>("train.next_step", "2")) !=
            metadata.end());
    }
}

TEST_CASE("checkpoint: resuming needs the optimizer state, and extra metadata may not shadow the checkpoint's own") {
  TempDir dir;
  const GptConfig c = test_config();
  const std::string weights = dir.file("weights.safetensors"), training = dir.file("training.safetensors");
  run_ranks(2, [&](ThreadCommunicator& comm) {
    Model model(c, 2, comm.rank(), 3);
    save_checkpoint(comm, model, weights);
    std::string error;
    try {
      save_checkpoint(comm, model, training, {.optimizer_state = true, .extra = {{"hidden", "7"}}});
    } catch (const Error& e) {
      error = e.what();
    }
    CHECK(error.find("extra metadata key 'hidden'") != std::string::npos);
    comm.barrier();
  });
  CHECK(!fs::exists(training));
  const std::string error = load_error(c, weights, {.optimizer_state = true});
  CHECK(error.find("holds the weights only") != std::string::npos);
}

namespace {
// optimizer_state_of plus every MoE layer's expert shards and their moments.
std::vector<float> moe_state_of(Model& model) {
  std::vector<float> out = optimizer_state_of(model);
  for (auto* shards : {&model.stack().moe_weights(), &model.moe_moment1(), &model.moe_moment2()})
    for (const MoeShard& s : *shards)
      for (const Tensor<float>* t : {&s.router, &s.expert_in, &s.expert_out, &s.shared_in, &s.shared_out, &s.shared_gate})
        out.insert(out.end(), t->span().begin(), t->span().end());
  return out;
}
}  // namespace

TEST_CASE("checkpoint: an MoE GPT (router, routed and shared experts) resumes bit for bit and loads on other group sizes") {
  TempDir dir;
  GptConfig c = test_config(false, Activation::swiglu);
  MoeConfig m;
  m.hidden = c.layer.hidden;
  m.experts = 5;  // uneven over 2 and 4 ranks
  m.top_k = 2;
  m.expert_ffn = 8;
  m.norm_topk_prob = true;
  m.shared_experts = 1;
  m.shared_ffn = 8;
  m.shared_gate = true;
  m.aux_loss_coef = 0.01;
  m.z_loss_coef = 0.001;
  c.moe = MoeLayers{m, 1};  // layer 0 dense, layer 1 MoE
  const int p = 2, total = 5, k = 2;
  const std::string path = dir.file("moe.safetensors"), moved = dir.file("moe_p4.safetensors");
  std::vector<double> straight, resumed;
  std::vector<std::vector<float>> straight_state(p), resumed_state(p);
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    const StopAndResume run = stop_and_resume(c, comm, pool, total, k, path, {.optimizer_state = true, .extra = {}},
                                              [](Model& model) { return moe_state_of(model); });
    if (r == 0) straight = run.straight, resumed = run.resumed;
    straight_state[std::size_t(r)] = run.straight_state;
    resumed_state[std::size_t(r)] = run.resumed_state;
    CHECK(run.resumed_steps == k);
  });
  REQUIRE(resumed.size() == std::size_t(total - k));
  for (int i = k; i < total; ++i) CHECK(resumed[std::size_t(i - k)] == straight[std::size_t(i)]);  // bitwise
  for (int r = 0; r < p; ++r) CHECK(resumed_state[std::size_t(r)] == straight_state[std::size_t(r)]);
  CHECK(read_checkpoint_config(path) == c);
  // Global tensors: loaded on 4 ranks and saved again, then both files read on one rank hold the same states.
  run_ranks(4, [&](ThreadCommunicator& comm) {
    Model model(c, 4, comm.rank(), 99);
    load_checkpoint(model, path, {.optimizer_state = true});
    save_checkpoint(comm, model, moved, {.optimizer_state = true, .extra = {}});
  });
  Model first(c, 1, 0, 5), second(c, 1, 0, 6);
  load_checkpoint(first, path, {.optimizer_state = true});
  load_checkpoint(second, moved, {.optimizer_state = true});
  CHECK(moe_state_of(first) == moe_state_of(second));
  CHECK(first.steps_taken() == k);
  // A dense model refuses the MoE checkpoint, naming the difference.
  CHECK_MESSAGE(load_error(test_config(false, Activation::swiglu), path).find("moe.experts: checkpoint 5, model none") !=
                    std::string::npos,
                load_error(test_config(false, Activation::swiglu), path));
}

namespace {
// `path` rewritten with its metadata changed by `change` (the tensors and the data bytes as they were).
template <class Change>
void rewrite_metadata(const std::string& path, Change&& change) {
  const std::string bytes = read_all(path);
  safetensors::Header header;
  {
    const safetensors::File file(path, O_RDONLY);
    header = safetensors::read_header(file);
  }
  std::vector<safetensors::TensorEntry> entries = header.tensors;
  std::sort(entries.begin(), entries.end(), [](auto& a, auto& b) { return a.begin < b.begin; });  // data order
  checkpoint_detail::Metadata metadata = header.metadata;
  change(metadata);
  write_all(path, safetensors::encode_header(entries, metadata) + bytes.substr(std::size_t(header.data_start)));
}
void set_meta(checkpoint_detail::Metadata& m, const std::string& key, const std::string& value) {
  for (auto& [k, v] : m)
    if (k == key) {
      v = value;
      return;
    }
  m.emplace_back(key, value);
}
void drop_meta(checkpoint_detail::Metadata& m, const std::string& key) {
  std::erase_if(m, [&](auto& kv) { return kv.first == key; });
}
std::string training_error(const std::string& path) {
  try {
    read_training_checkpoint(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}
}  // namespace

TEST_CASE("checkpoint: every metadata entry is under a checksum (format v2); v1 files, without it, still load") {
  TempDir dir;
  const GptConfig c = test_config();
  const std::string path = dir.file("m.safetensors");
  train_and_save(c, 1, 5, 2, path);
  const std::string good = read_all(path);
  const auto metadata = read_checkpoint_metadata(path);
  const auto value = [&](const std::string& key) {
    for (const auto& [k, v] : metadata)
      if (k == key) return v;
    return std::string("(none)");
  };
  CHECK(value("format") == "paradyse.gpt.v2");
  CHECK(value("metadata_fnv1a64").size() == 16);
  SUBCASE("an edited value is refused by the load and by the metadata read") {
    rewrite_metadata(path, [](auto& m) { set_meta(m, "step", "7"); });
    CHECK(load_error(c, path).find("the metadata is corrupted or was edited (checksum") != std::string::npos);
    CHECK_THROWS_WITH_AS(read_checkpoint_metadata(path), doctest::Contains("the metadata is corrupted or was edited"), Error);
  }
  SUBCASE("an added entry is refused") {
    rewrite_metadata(path, [](auto& m) { set_meta(m, "train.next_step", "3"); });
    CHECK(load_error(c, path).find("the metadata is corrupted or was edited") != std::string::npos);
  }
  SUBCASE("a v2 file with a data checksum but none of its metadata is refused") {
    rewrite_metadata(path, [](auto& m) { drop_meta(m, "metadata_fnv1a64"); });
    CHECK(load_error(c, path).find("the metadata has no 'metadata_fnv1a64' checksum") != std::string::npos);
  }
  SUBCASE("a v1 file (no metadata checksum) loads, its fields parsed strictly") {
    rewrite_metadata(path, [](auto& m) {
      drop_meta(m, "metadata_fnv1a64");
      set_meta(m, "format", "paradyse.gpt.v1");
    });
    CHECK(load_error(c, path).empty());
    rewrite_metadata(path, [](auto& m) { set_meta(m, "layers", "-2"); });
    CHECK(load_error(c, path).find("metadata 'layers' = \"-2\" is out of range") != std::string::npos);
  }
  SUBCASE("another format is refused naming both") {
    rewrite_metadata(path, [](auto& m) { set_meta(m, "format", "paradyse.gpt.v9"); });
    CHECK(load_error(c, path).find("format 'paradyse.gpt.v9', expected 'paradyse.gpt.v2'") != std::string::npos);
  }
}

TEST_CASE("resume: a training checkpoint's train.* metadata is parsed strictly (field, value, expected)") {
  const auto error = [](const std::string& next_step) {
    try {
      training_checkpoint_info({{"train.args", "--steps\n8"}, {"train.next_step", next_step}, {"train.data", "d"}}, "c.st");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(error("-6").find("checkpoint c.st: metadata 'train.next_step' = \"-6\" is out of range [1, 10000000]") != std::string::npos);
  CHECK(error("x6").find("metadata 'train.next_step' = \"x6\" is not an integer") != std::string::npos);
  CHECK(error("99999999999").find("'train.next_step' = \"99999999999\" is out of range [1, 10000000]") != std::string::npos);
  CHECK(error("6 ").find("is not an integer") != std::string::npos);
  CHECK(error("0").find("is out of range [1, 10000000]") != std::string::npos);
  const TrainingCheckpointInfo info =
      training_checkpoint_info({{"train.args", "--steps\n8"}, {"train.next_step", "6"}, {"train.data", "d"}}, "c.st");
  CHECK(info.next_step == 6);
  CHECK(info.args == std::vector<std::string>{"--steps", "8"});
  CHECK_THROWS_WITH_AS(training_checkpoint_info({{"train.args", ""}, {"train.data", "d"}}, "c.st"),
                       doctest::Contains("the metadata has no 'train.next_step'"), Error);
  CHECK_THROWS_WITH_AS(training_checkpoint_info({{"train.args", ""}, {"train.next_step", "2"}, {"train.next_step", "3"},
                                                 {"train.data", "d"}}, "c.st"),
                       doctest::Contains("holds 'train.next_step' twice"), Error);
  CHECK_THROWS_WITH_AS(training_checkpoint_info({{"train.args", ""}, {"train.next_step", "2"}, {"train.data", ""}}, "c.st"),
                       doctest::Contains("'train.data' is empty"), Error);

  // In a file: an edited v2 checkpoint fails its checksum; a v1 one (no metadata checksum) fails the strict parse.
  TempDir dir;
  const GptConfig c = test_config();
  const std::string path = dir.file("training.safetensors");
  run_ranks(2, [&](ThreadCommunicator& comm) {
    Model model(c, 2, comm.rank(), 3);
    save_checkpoint(comm, model, path,
                    {.optimizer_state = true,
                     .extra = {{"train.args", "--steps\n8"}, {"train.next_step", "6"}, {"train.data", "d"}}});
  });
  CHECK(read_training_checkpoint(path).next_step == 6);
  rewrite_metadata(path, [](auto& m) { set_meta(m, "train.next_step", "-6"); });
  CHECK(training_error(path).find("the metadata is corrupted or was edited") != std::string::npos);
  rewrite_metadata(path, [](auto& m) {
    drop_meta(m, "metadata_fnv1a64");
    set_meta(m, "format", "paradyse.gpt.v1");
  });
  CHECK(training_error(path).find("metadata 'train.next_step' = \"-6\" is out of range [1, 10000000]") != std::string::npos);
}

TEST_CASE("checkpoint: a save whose writer fails throws the writer's reason on every rank; the old file stays") {
  TempDir dir;
  const GptConfig c = test_config();
  const std::string path = dir.file("blocked.safetensors");
  fs::create_directories(fs::path(path) / "inside");  // a folder where the file goes: it cannot be replaced
  std::vector<std::string> errors(2);
  run_ranks(2, [&](ThreadCommunicator& comm) {
    Model model(c, 2, comm.rank(), 3);
    try {
      save_checkpoint(comm, model, path);
    } catch (const Error& e) {
      errors[std::size_t(comm.rank())] = e.what();
    }
    comm.barrier();  // every rank left the save in step
  });
  for (const std::string& e : errors) {
    CAPTURE(e);
    CHECK(e.find("saving the checkpoint " + path + " failed") != std::string::npos);
    CHECK(e.find("is a folder") != std::string::npos);
  }
  CHECK(fs::is_directory(fs::path(path) / "inside"));
}

TEST_CASE("checkpoint: first_nonfinite_tensor names the first tensor holding nan or inf, and the element") {
  TempDir dir;
  const GptConfig c = test_config();
  const std::string path = dir.file("m.safetensors");
  train_and_save(c, 1, 5, 1, path);
  CHECK(!first_nonfinite_tensor(path).has_value());
  std::string bytes = read_all(path);
  safetensors::Header header;
  {
    const safetensors::File file(path, O_RDONLY);
    header = safetensors::read_header(file);
  }
  const safetensors::TensorEntry* e = header.find("layers.1.mlp.w_in");
  REQUIRE(e != nullptr);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(bytes.data() + header.data_start + e->begin + 3 * sizeof(float), &nan, sizeof(float));
  write_all(path, bytes);
  const std::optional<std::string> bad = first_nonfinite_tensor(path);
  REQUIRE(bad.has_value());
  CHECK(*bad == "'layers.1.mlp.w_in' holds nan at element 3");
}
