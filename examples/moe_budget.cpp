// examples/moe_budget.cpp: Alloc-MoE (issue 12) on a Hugging Face MoE decoder: the model train_gpt --experts
// writes with --save DIR (a byte-level MoE GPT trained on the bundled corpus), or any Mixtral / Qwen2-MoE / OLMoE /
// Qwen3-MoE / DeepSeek-V2 (-Lite) / DeepSeek-V3 folder serve/'s loader reads (tests/data/hf holds tiny random ones
// of each family; deepseek_v2_lite has DeepSeek-V2-Lite's shape, Alloc-MoE's headline model).
//
// Text: the bundled corpus of speeches; every 8th document (by name) is held out for evaluation, the others give
// the calibration text. Tokens are bytes (the trained model's vocabulary; a smaller vocabulary takes byte % V).
// `--write-train-corpus DIR` writes the non-held-out documents to DIR, so that the model is trained without the
// evaluation text:
//     moe_budget --write-train-corpus build/sotu_train
//     train_gpt --corpus build/sotu_train --experts 8 --top-k 2 ... --save build/moe_model
//     moe_budget --model build/moe_model --table build/moe_model/sensitivity.json --csv budget.csv
// The program then, on the decoder of serve/ (serve/decoder_step.hpp, one rank, its KV cache):
//   1. profiles Alloc-L's sensitivity Delta_l(k), k = 1..top-k, by calibration loss increase (moe/sensitivity.hpp)
//      and saves the table (--table: moe_infer --budget reads it);
//   2. for budgets 100/75/50/25% of sum_l top-k (moe/budget.hpp): uniform top-k reduction, Alloc-L (the exact DP)
//      and Alloc-L + Alloc-T (pooled top-(K_l T) over each sequence's tokens, serve/routing_budget.hpp): held-out
//      perplexity, agreement of the greedy next token with the full budget, and prefill and decode time per token
//      (prefill: one sequence per step; decode: one token per step after a prefilled context, T = 1), all measured
//      in this run against the full budget;
//   3. the DP's time for a DeepSeek-V2-Lite-shaped problem (26 layers, top-6, B = 78).

#include "paradyse/cli/flags.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/csv_table.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/data/corpus.hpp"
#include "paradyse/moe/alloc_layers.hpp"
#include "paradyse/moe/budget.hpp"
#include "paradyse/moe/sensitivity.hpp"
#include "paradyse/serve/decoder_step.hpp"
#include "paradyse/serve/decoder_weights.hpp"
#include "paradyse/serve/routing_budget.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace {

// The usage, generated from the flags in parse() (usage() is also called for a bad --budgets list).
std::string& usage_text() {
  static std::string text;
  return text;
}
[[noreturn]] void usage(const std::string& problem) {
  cli::print_usage_and_exit("moe_budget", problem, usage_text());
}

struct Options {
  std::string model = "tests/data/hf/mixtral", corpus, write_train, table, csv, budgets = "100,75,50,25";
  std::int64_t eval_tokens = 16384, calib_tokens = 4096, seq = 256, batch = 8, decode = 64;
  int repeats = 3;
};

Options parse(int argc, char** argv) {
  Options o;
  cli::Flags flags(
      "moe_budget",
      "Alloc-MoE on a Hugging Face MoE decoder (train_gpt --experts ... --save DIR, or a Mixtral / Qwen2-MoE / OLMoE "
      "folder): profiles each MoE layer's sensitivity on calibration speeches, then compares uniform top-k "
      "reduction, Alloc-L and Alloc-L + Alloc-T at budgets of 100/75/50/25% of sum_l top-k: perplexity on held-out "
      "speeches (every 8th document), greedy next-token agreement with the full budget, prefill and decode time per "
      "token. With --write-train-corpus DIR it writes the documents that are not held out and exits.");
  flags.text("--model", o.model, "the model folder (default: a tiny random fixture)", "DIR")
      .nonempty("a model folder");
  flags.text("--corpus", o.corpus, "a folder of .txt documents (default: data/corpus/sotu.tar.xz extracted into build/)",
             "DIR")
      .nonempty("a folder of .txt documents");
  flags.text("--write-train-corpus", o.write_train,
             "write the documents that are not held out to DIR (train_gpt --corpus DIR) and exit", "DIR")
      .nonempty("a folder");
  flags.integer("--eval-tokens", o.eval_tokens, std::int64_t(1), std::int64_t(1) << 26, "held-out tokens evaluated");
  flags.integer("--calib-tokens", o.calib_tokens, std::int64_t(1), std::int64_t(1) << 26,
                "calibration tokens for the sensitivity profile");
  flags.integer("--seq", o.seq, std::int64_t(2), std::int64_t(1) << 16,
                "tokens per sequence: evaluation rows, a prefill, and Alloc-T's pool");
  flags.integer("--batch", o.batch, std::int64_t(1), std::int64_t(4096), "sequences per evaluation step");
  flags.integer("--decode", o.decode, std::int64_t(1), std::int64_t(1) << 16,
                "tokens decoded one at a time for the decode timing");
  flags.integer("--repeats", o.repeats, 1, 1000, "timing rounds (every row once per round); the median is reported");
  flags.text("--budgets", o.budgets, "comma-separated percentages, starting with 100", "LIST");
  flags.text("--table", o.table, "save the sensitivity table as JSON (moe_infer --sensitivity FILE)", "FILE")
      .nonempty("a file name");
  flags.text("--csv", o.csv, "also write the table as CSV (scripts/plot.py draws quality against budget)", "FILE")
      .nonempty("a file name");
  usage_text() = flags.usage();
  flags.parse(argc, argv);
  return o;
}

std::vector<int> parse_percentages(const std::string& list) {
  std::vector<int> out;
  std::size_t at = 0;
  while (at <= list.size()) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, comma - at);
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 1 || v > 100)
      usage(fmt::format("--budgets {}: \"{}\" is not a percentage in 1..100", printable(list), printable(item)));
    out.push_back(int(v));
    at = comma + 1;
  }
  if (out.front() != 100) usage(fmt::format("--budgets {}: must start with 100, the baseline of every row", list));
  for (std::size_t i = 1; i < out.size(); ++i)  // a repeated budget would print the same rows twice
    if (std::find(out.begin(), out.begin() + std::ptrdiff_t(i), out[i]) != out.begin() + std::ptrdiff_t(i))
      usage(fmt::format("--budgets {}: {} appears twice; each budget may appear once", list, out[i]));
  return out;
}

// Sequences of seq + 1 tokens (seq inputs; each position's target is the next token) cut from the documents in
// order, until `tokens` inputs (or the documents run out).
std::vector<std::vector<std::int32_t>> sequences_of(const std::vector<const paradyse::data::Document*>& docs,
                                                    std::int64_t tokens, std::int64_t seq, std::int64_t vocab) {
  std::vector<std::vector<std::int32_t>> out;
  for (const paradyse::data::Document* d : docs) {
    const std::string& b = d->bytes;
    for (std::int64_t at = 0; at + seq + 1 <= std::int64_t(b.size()); at += seq) {
      if (std::int64_t(out.size()) * seq >= tokens) return out;
      std::vector<std::int32_t> s;
      for (std::int64_t i = 0; i <= seq; ++i) s.push_back(std::int32_t(std::uint8_t(b[std::size_t(at + i)]) % vocab));
      out.push_back(std::move(s));
    }
  }
  check(!out.empty(), "moe_budget: no document is longer than --seq {} tokens", seq);
  return out;
}

// Per-token losses and greedy tokens of `rows` [n, V] against `targets`.
void score_rows(const Tensor<float>& logits, std::span<const std::int32_t> targets, double& loss_sum,
                std::vector<std::int32_t>& argmax) {
  const std::int64_t n = logits.extent(0), V = logits.extent(1);
  for (std::int64_t i = 0; i < n; ++i) {
    const float* row = logits.data() + i * V;
    const std::int64_t best = std::max_element(row, row + V) - row;
    double sum = 0;
    for (std::int64_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - double(row[best]));
    loss_sum += std::log(sum) + double(row[best]) - double(row[targets[std::size_t(i)]]);
    argmax.push_back(std::int32_t(best));
  }
}

struct Quality {
  double loss = 0;                    // mean next-token cross-entropy
  std::vector<std::int32_t> argmax;   // greedy next token of every position
};

// The decoder on one rank over sequences (each a request of its own, `batch` per step, logits of every token).
class Evaluator {
public:
  Evaluator(ThreadCommunicator& comm, const LoadedDecoder& m, std::int64_t batch, std::int64_t longest)
      : comm_(comm), m_(m), shard_(make_rank_shard(m.config, m.weights, 1, 0, MoeMode::tp)), batch_(batch),
        cache_(kv_cache_shape(m.config, shard_, batch * ((longest + 15) / 16), 16)) {}

  Quality quality(const std::vector<std::vector<std::int32_t>>& seqs, const RoutingBudget& budget) {
    Quality q;
    std::int64_t counted = 0;
    for (std::size_t first = 0; first < seqs.size(); first += std::size_t(batch_)) {
      std::vector<SequenceChunk> chunks;
      for (std::size_t i = first; i < std::min(seqs.size(), first + std::size_t(batch_)); ++i) {
        const std::vector<std::int32_t>& s = seqs[i];
        chunks.push_back({std::int64_t(i), std::vector<std::int32_t>(s.begin(), s.end() - 1), true});
        cache_.reserve(std::int64_t(i), std::int64_t(s.size()) - 1);
      }
      const StepResult r = decoder_step(comm_, m_.config, shard_, cache_, std::span<const SequenceChunk>(chunks), pool_,
                                        {}, {}, budget);
      for (std::size_t c = 0; c < chunks.size(); ++c) {
        const std::vector<std::int32_t>& s = seqs[first + c];
        score_rows(r.logits[c], std::span<const std::int32_t>(s).subspan(1), q.loss, q.argmax);
        counted += std::int64_t(s.size()) - 1;
        cache_.release(chunks[c].request);
      }
    }
    q.loss /= double(std::max<std::int64_t>(1, counted));
    return q;
  }

  // Seconds per token: one sequence prefilled in one step.
  double prefill_time(const std::vector<std::int32_t>& s, const RoutingBudget& budget) {
    const SequenceChunk chunk{0, std::vector<std::int32_t>(s.begin(), s.end() - 1), false};
    cache_.reserve(0, std::int64_t(chunk.tokens.size()));
    const Timer timer;
    (void)decoder_step(comm_, m_.config, shard_, cache_, std::span<const SequenceChunk>(&chunk, 1), pool_, {}, {},
                       budget);
    const double t = timer.seconds();
    cache_.release(0);
    return t / double(chunk.tokens.size());
  }

  // Seconds per token: `context` prefilled (not timed), then `steps` tokens decoded one per step (the text's own
  // next tokens fed back).
  double decode_time(const std::vector<std::int32_t>& s, std::int64_t context, const RoutingBudget& budget) {
    const std::int64_t steps = std::int64_t(s.size()) - context;
    cache_.reserve(0, std::int64_t(s.size()));
    const SequenceChunk prompt{0, std::vector<std::int32_t>(s.begin(), s.begin() + context), false};
    (void)decoder_step(comm_, m_.config, shard_, cache_, std::span<const SequenceChunk>(&prompt, 1), pool_, {}, {},
                       budget);
    const Timer timer;
    for (std::int64_t i = 0; i < steps; ++i) {
      const SequenceChunk token{0, {s[std::size_t(context + i)]}, false};
      (void)decoder_step(comm_, m_.config, shard_, cache_, std::span<const SequenceChunk>(&token, 1), pool_, {}, {},
                         budget);
    }
    const double t = timer.seconds();
    cache_.release(0);
    return t / double(steps);
  }

private:
  ThreadCommunicator& comm_;
  const LoadedDecoder& m_;
  RankShard shard_;
  std::int64_t batch_;
  PagedKvCache cache_;
  BufferPool pool_;
};

std::string join(const std::vector<std::int64_t>& k) {
  std::string s;
  for (const std::int64_t v : k) s += (s.empty() ? "" : ".") + std::to_string(v);
  return s;
}

int run(const Options& o) {
  const std::filesystem::path dir = o.corpus.empty() ? paradyse::data::ensure_extracted("data/corpus/sotu.tar.xz", "build", "sotu")
                                                     : std::filesystem::path(o.corpus);
  const std::vector<paradyse::data::Document> docs = paradyse::data::load(dir);
  std::vector<const paradyse::data::Document*> calibration, held_out;
  for (std::size_t i = 0; i < docs.size(); ++i) (i % 8 == 7 ? held_out : calibration).push_back(&docs[i]);
  check(!calibration.empty() && !held_out.empty(), "moe_budget: {} documents in {}: too few to hold some out",
        docs.size(), dir.string());
  if (!o.write_train.empty()) {
    std::error_code error;  // "filesystem error: cannot create directories" named no flag
    std::filesystem::create_directories(o.write_train, error);
    check(!error && std::filesystem::is_directory(o.write_train),
          "--write-train-corpus {}: cannot make the folder: {}", printable(o.write_train),
          error ? error.message() : std::string("it is not a folder"));
    for (const paradyse::data::Document* d : calibration) {
      paradyse::write_file_atomically((std::filesystem::path(o.write_train) / d->name).string(),
                                      std::string_view(d->bytes.data(), d->bytes.size()), "--write-train-corpus");
    }
    fmt::print("wrote {} of {} documents (every 8th by name is held out) to {}\n", calibration.size(), docs.size(),
               o.write_train);
    return 0;
  }
  const std::vector<int> percentages = parse_percentages(o.budgets);
  const LoadedDecoder m = load_decoder(o.model);
  const DecoderConfig& c = m.config;
  const std::vector<std::int64_t> top_k = moe_layer_top_k(c);
  check(!top_k.empty(), "moe_budget: {} has no MoE layer", o.model);
  fmt::print("model {}: {} layers ({} MoE), h = {}, {} heads ({} kv), {} experts of ffn {}, top-{}, {} shared, vocab "
             "{}; full budget B = {} routed activations/token\n",
             o.model, c.layers, top_k.size(), c.hidden, c.heads, c.kv_heads, c.moe.experts, c.moe.expert_ffn,
             c.moe.top_k, c.moe.shared_experts, c.vocab, full_budget(top_k));
  const auto eval = sequences_of(held_out, o.eval_tokens, o.seq, c.vocab);
  const auto calib = sequences_of(calibration, o.calib_tokens, o.seq, c.vocab);
  fmt::print("text: {} documents, {} held out ({} sequences of {} tokens evaluated), calibration {} sequences{}\n",
             docs.size(), held_out.size(), eval.size(), o.seq, calib.size(),
             c.vocab < 256 ? fmt::format(" (tokens: byte % {}, the model's vocabulary)", c.vocab) : "");
  std::vector<std::int32_t> decode_text;  // a prefilled context of seq tokens, then the decoded ones
  for (const auto& s : eval) {
    decode_text.insert(decode_text.end(), s.begin(), s.end() - 1);
    if (std::int64_t(decode_text.size()) >= o.seq + o.decode) break;
  }
  decode_text.resize(std::size_t(std::min<std::int64_t>(std::int64_t(decode_text.size()), o.seq + o.decode)));
  const std::int64_t context = std::min<std::int64_t>(o.seq, std::int64_t(decode_text.size()) - 1);

  int status = 0;
  run_ranks(1, [&](ThreadCommunicator& comm) {
    Evaluator ev(comm, m, o.batch, std::max<std::int64_t>(o.seq + 1, std::int64_t(decode_text.size())));
    // ---- Alloc-L: sensitivity by calibration loss ----
    const Timer calibration_timer;
    std::int64_t calib_tokens = 0;
    for (const auto& s : calib) calib_tokens += std::int64_t(s.size()) - 1;
    SensitivityTable table =
        profile_loss_sensitivity(top_k, top_k, calib_tokens, [&](std::span<const std::int64_t> k) {
          return ev.quality(calib, routing_budget_of(c, std::vector<std::int64_t>(k.begin(), k.end()), false)).loss;
        });
    table.model = model_identity(c);  // a table is applied only to the model it was measured on
    fmt::print("\nsensitivity Delta_l(k): calibration loss increase over {} tokens (base loss {:.4f}), {:.1f} s\n",
               calib_tokens, table.base, calibration_timer.seconds());
    fmt::print("  MoE layer");
    for (std::int64_t k = 1; k <= c.moe.top_k; ++k) fmt::print(" {:>9}", fmt::format("k={}", k));
    fmt::print("\n");
    for (std::size_t l = 0; l < table.delta.size(); ++l) {
      fmt::print("  {:9d}", l);
      for (const double d : table.delta[l]) fmt::print(" {:9.5f}", d);
      fmt::print("\n");
    }
    if (!o.table.empty()) {
      save_sensitivity(table, o.table, "--table");
      fmt::print("sensitivity table saved to {} (moe_infer --sensitivity)\n", o.table);
    }

    // ---- the budgets ----
    struct Row {
      int percent;
      std::int64_t budget;
      std::string method, k;
      RoutingBudget routing;
      double ppl, agreement, prefill_us = 0, decode_us = 0, prefill_speedup = 0, decode_speedup = 0;
      std::vector<double> prefill, decode;  // seconds per token, one per timing round
    };
    std::vector<Row> rows;
    std::vector<std::int32_t> full_argmax;
    for (const int percent : percentages) {
      const std::int64_t budget = std::llround(percent / 100.0 * double(full_budget(top_k)));
      if (budget < std::int64_t(top_k.size())) {
        fmt::print("budget {}%: {} activations, below one expert in each of the {} MoE layers: skipped\n", percent,
                   budget, top_k.size());
        continue;
      }
      const BudgetSpec spec = BudgetSpec::of_share(percent / 100.0);
      struct Method {
        const char* name;
        RoutingBudget routing;
      };
      std::vector<Method> methods = {{"uniform top-k", make_routing_budget(c, spec, nullptr, false)},
                                     {"Alloc-L", make_routing_budget(c, spec, &table, false)},
                                     {"Alloc-L + Alloc-T", make_routing_budget(c, spec, &table, true)}};
      for (const Method& method : methods) {
        const Quality q = ev.quality(eval, method.routing);
        if (full_argmax.empty()) full_argmax = q.argmax;  // the first row: the full budget, uniform
        std::int64_t same = 0;
        for (std::size_t i = 0; i < q.argmax.size(); ++i) same += q.argmax[i] == full_argmax[i];
        std::vector<std::int64_t> ks;
        for (std::int64_t l = 0; l < c.layers; ++l)
          if (c.is_moe(l)) ks.push_back(method.routing.layer_k[std::size_t(l)]);
        rows.push_back({percent, budget, method.name, join(ks), method.routing, std::exp(q.loss),
                        double(same) / double(std::max<std::size_t>(1, q.argmax.size()))});
        fmt::print(stderr, "\r  quality: {}% {:<18} done   ", percent, method.name);
      }
    }
    // Timing in rounds, every row once per round (a load change on the shared machine hits every row alike).
    for (int rep = 0; rep < o.repeats; ++rep) {
      for (Row& r : rows) {
        r.prefill.push_back(ev.prefill_time(eval[std::size_t(rep) % eval.size()], r.routing));
        r.decode.push_back(ev.decode_time(decode_text, context, r.routing));
      }
      fmt::print(stderr, "\r  timing: round {} of {} done            ", rep + 1, o.repeats);
    }
    fmt::print(stderr, "\n");
    for (Row& r : rows) {
      r.prefill_us = 1e6 * median(r.prefill), r.decode_us = 1e6 * median(r.decode);
      r.prefill_speedup = rows.front().prefill_us / r.prefill_us;
      r.decode_speedup = rows.front().decode_us / r.decode_us;
    }
    fmt::print("\nheld-out: {} tokens in sequences of {} (Alloc-T pools each sequence); time per token, median of {} rounds (each row once per round): "
               "prefill = one sequence of {} tokens per step, decode = {} steps of one token after a context of {}\n",
               full_argmax.size(), o.seq, o.repeats, o.seq, std::int64_t(decode_text.size()) - context, context);
    fmt::print("{:>6} {:>4} {:<18} {:<12} {:>9} {:>8} {:>11} {:>11} {:>8} {:>8}\n", "budget", "B", "method", "K_l",
               "ppl", "agree", "prefill us", "decode us", "prefill", "decode");
    for (const Row& r : rows)
      fmt::print("{:>5}% {:>4} {:<18} {:<12} {:9.4f} {:7.2f}% {:11.1f} {:11.1f} {:7.2f}x {:7.2f}x\n", r.percent,
                 r.budget, r.method, r.k, r.ppl, 100 * r.agreement, r.prefill_us, r.decode_us, r.prefill_speedup,
                 r.decode_speedup);
    if (!o.csv.empty()) {
      CsvTable csv(o.csv, {"budget_percent", "budget", "method", "k", "perplexity", "agreement", "prefill_us_per_token",
                           "decode_us_per_token", "prefill_speedup", "decode_speedup"});
      for (const Row& r : rows)
        csv.row(r.percent, r.budget, r.method, r.k, fmt::format("{:.6f}", r.ppl), fmt::format("{:.6f}", r.agreement),
                fmt::format("{:.4f}", r.prefill_us), fmt::format("{:.4f}", r.decode_us),
                fmt::format("{:.4f}", r.prefill_speedup), fmt::format("{:.4f}", r.decode_speedup));
      csv.close();  // throws (naming the file and the reason) before saying it was written
      fmt::print("table written to {}\n", o.csv);
    }

    // ---- the DP's time on a DeepSeek-V2-Lite-shaped problem ----
    Rng rng(26);
    std::vector<std::vector<double>> delta(26, std::vector<double>(6, 0.0));
    for (auto& row : delta)
      for (std::size_t k = 0; k + 1 < row.size(); ++k) row[k] = rng.uniform(0.0, 1.0) / double(k + 1);
    std::vector<double> times;
    std::int64_t sink = 0;
    for (int rep = 0; rep < 2000; ++rep) {
      const Timer timer;
      sink += allocate_layers(delta, 78).k[0];
      times.push_back(timer.seconds());
    }
    fmt::print("\nAlloc-L DP: 26 layers, K_max 6, B = 78 (DeepSeek-V2-Lite at half budget): median {:.2f} us over 2000 "
               "runs [{}]\n",
               1e6 * median(times), sink > 0);
    status = 0;
  });
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "moe_budget: {}\n", paradyse::bounded_message(e.what()));  // a filesystem_error echoes paths whole
    return 1;
  }
}
