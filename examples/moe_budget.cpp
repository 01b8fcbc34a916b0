// examples/moe_budget.cpp: Alloc-MoE (issue 12) on a small MoE language model trained here on the bundled corpus.
//
// The model is trained in this program (the MoE GPT of train_gpt --experts had not landed when this was written): a
// byte-level MoE LM whose token representation is the sum of the embeddings of its last C bytes (one table per
// offset, an n-gram context instead of attention), then L residual MoE blocks x += MoE(RMSNorm(x)) (DeepSeek-like:
// E fine-grained routed experts, top-k, one shared expert), a final RMSNorm and an LM head. Every piece is the
// library's: moe_forward/moe_backward (moe/moe_layer.hpp), RMSNorm, embedding, cross-entropy and AdamW (ops::Cpu).
//
// Held-out speeches (every 8th document) are the evaluation text; the others train the model and give the
// calibration text. Then:
//   1. Alloc-L's sensitivity table Delta_l(k), k = 1..top-k, by calibration loss increase (moe/sensitivity.hpp);
//   2. for budgets 100/75/50/25% of sum_l top-k (moe/budget.hpp): uniform top-k reduction, Alloc-L (the exact DP,
//      moe/alloc_layers.hpp) and Alloc-L + Alloc-T (pooled top-(K_l T) per sequence, moe/alloc_tokens.hpp): held-out
//      perplexity, agreement of the greedy next token with the full budget, prefill and decode time per token
//      (prefill: one sequence of --prefill tokens per forward; decode: one token per forward, T = 1), all measured in
//      this run against the full budget;
//   3. the DP's time for a DeepSeek-V2-Lite-shaped problem (26 layers, top-6, B = 78).
//
//   moe_budget [--steps N] [--layers L] [--hidden H] [--experts E] [--top-k K] [--expert-ffn F] [--context C]
//              [--batch-tokens N] [--lr X] [--eval-tokens N] [--calib-tokens N] [--prefill T] [--decode N]
//              [--repeats R] [--seed S] [--csv FILE] [--table FILE] [--corpus DIR]
#include "command_line.hpp"
#include "corpus.hpp"

#include "paradyse/core/rng.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/moe/alloc_layers.hpp"
#include "paradyse/moe/alloc_tokens.hpp"
#include "paradyse/moe/budget.hpp"
#include "paradyse/moe/moe_layer.hpp"
#include "paradyse/moe/sensitivity.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

using namespace paradyse;
using Cpu = ops::Cpu;

namespace {

constexpr const char* kUsage =
    "usage: moe_budget [--steps N] [--layers L] [--hidden H] [--experts E] [--top-k K] [--expert-ffn F]\n"
    "                  [--context C] [--batch-tokens N] [--lr X] [--eval-tokens N] [--calib-tokens N]\n"
    "                  [--prefill T] [--decode N] [--repeats R] [--seed S] [--csv FILE] [--table FILE] [--corpus DIR]\n"
    "\n"
    "Trains a small byte-level MoE LM on the bundled corpus (n-gram context of C bytes, L MoE blocks of E experts,\n"
    "top-K, one shared expert), profiles each layer's sensitivity on calibration text, and compares uniform top-k\n"
    "reduction, Alloc-L and Alloc-L + Alloc-T at budgets of 100/75/50/25% of sum_l top-k: held-out perplexity,\n"
    "greedy next-token agreement with the full budget, prefill and decode time per token.\n"
    "  --steps N         training steps (default 400)\n"
    "  --layers L        MoE blocks (default 6)\n"
    "  --hidden H        model width (default 64)\n"
    "  --experts E       routed experts per block (default 16)\n"
    "  --top-k K         experts per token (default 6)\n"
    "  --expert-ffn F    ffn width of one routed expert (default 32); the shared expert is 2F wide\n"
    "  --context C       bytes of context (default 8)\n"
    "  --batch-tokens N  tokens per training step (default 2048)\n"
    "  --lr X            AdamW learning rate (default 3e-3)\n"
    "  --eval-tokens N   held-out tokens evaluated (default 32768)\n"
    "  --calib-tokens N  calibration tokens for the sensitivity profile (default 8192)\n"
    "  --prefill T       tokens per sequence: a prefill's length and Alloc-T's pool (default 256)\n"
    "  --decode N        tokens decoded one at a time for the decode timing (default 256)\n"
    "  --repeats R       timing repeats, the median is reported (default 5)\n"
    "  --seed S          seed of the weights and the data (default 1)\n"
    "  --csv FILE        also write the table as CSV\n"
    "  --table FILE      save the sensitivity table as JSON\n"
    "  --corpus DIR      a folder of .txt documents (default: data/corpus/sotu.tar.xz extracted into build/)\n";

[[noreturn]] void usage(const std::string& problem) {
  examples::print_usage_and_exit("moe_budget", problem, kUsage);
}

struct Options {
  int steps = 400;
  int layers = 6;
  std::int64_t hidden = 64, experts = 16, top_k = 6, expert_ffn = 32, context = 8, batch_tokens = 2048;
  double lr = 3e-3;
  std::int64_t eval_tokens = 32768, calib_tokens = 8192, prefill = 256, decode = 256;
  int repeats = 5;
  std::uint64_t seed = 1;
  std::string csv, table, corpus;
};

Options parse(int argc, char** argv) {
  Options o;
  examples::CommandLine cli(argc, argv, usage);
  while (cli.next()) {
    const std::string& f = cli.flag();
    if (f == "--steps") o.steps = cli.integer<int>(0, 1'000'000);
    else if (f == "--layers") o.layers = cli.integer<int>(1, 64);
    else if (f == "--hidden") o.hidden = cli.integer<std::int64_t>(4, 4096);
    else if (f == "--experts") o.experts = cli.integer<std::int64_t>(2, 256);
    else if (f == "--top-k") o.top_k = cli.integer<std::int64_t>(1, 256);
    else if (f == "--expert-ffn") o.expert_ffn = cli.integer<std::int64_t>(1, 16384);
    else if (f == "--context") o.context = cli.integer<std::int64_t>(1, 64);
    else if (f == "--batch-tokens") o.batch_tokens = cli.integer<std::int64_t>(1, 1 << 20);
    else if (f == "--lr") o.lr = cli.number({.min = 0, .max = 1, .min_open = true});
    else if (f == "--eval-tokens") o.eval_tokens = cli.integer<std::int64_t>(1, 1 << 24);
    else if (f == "--calib-tokens") o.calib_tokens = cli.integer<std::int64_t>(1, 1 << 24);
    else if (f == "--prefill") o.prefill = cli.integer<std::int64_t>(1, 1 << 16);
    else if (f == "--decode") o.decode = cli.integer<std::int64_t>(1, 1 << 16);
    else if (f == "--repeats") o.repeats = cli.integer<int>(1, 1000);
    else if (f == "--seed") o.seed = cli.integer<std::uint64_t>(0);
    else if (f == "--csv") o.csv = cli.value();
    else if (f == "--table") o.table = cli.value();
    else if (f == "--corpus") o.corpus = cli.value();
    else cli.unknown();
  }
  if (o.top_k > o.experts) cli.fail(fmt::format("--top-k {} exceeds --experts {}", o.top_k, o.experts));
  return o;
}

constexpr std::int64_t kVocab = 256;

// ---- data: each position is its C context bytes (newest first) and the next byte ----

struct Batch {
  std::int64_t n = 0;
  Tensor<std::int32_t> context;  // [C, n]: context[j][i] = byte i - j of position i's text
  Tensor<std::int32_t> target;   // [n]
};

// Positions [first, first + n) of `text` (first >= C - 1, first + n < size).
void append_positions(const std::string& text, std::int64_t first, std::int64_t n, std::int64_t c,
                      std::vector<std::vector<std::int32_t>>& ctx, std::vector<std::int32_t>& target) {
  for (std::int64_t i = first; i < first + n; ++i) {
    for (std::int64_t j = 0; j < c; ++j) ctx[std::size_t(j)].push_back(std::int32_t(std::uint8_t(text[std::size_t(i - j)])));
    target.push_back(std::int32_t(std::uint8_t(text[std::size_t(i + 1)])));
  }
}

Batch make_batch(const std::vector<std::vector<std::int32_t>>& ctx, const std::vector<std::int32_t>& target) {
  Batch b;
  b.n = std::int64_t(target.size());
  b.context = Tensor<std::int32_t>(Shape{std::int64_t(ctx.size()), b.n});
  b.target = Tensor<std::int32_t>(Shape{b.n});
  for (std::size_t j = 0; j < ctx.size(); ++j)
    std::copy(ctx[j].begin(), ctx[j].end(), b.context.span().begin() + std::ptrdiff_t(j) * b.n);
  std::copy(target.begin(), target.end(), b.target.span().begin());
  return b;
}

// `sequences` runs of `length` consecutive positions from the documents `docs` (in order, wrapping), one run per
// document at a time: a run is one prefill sequence.
Batch sequences_of(const std::vector<const corpus::Document*>& docs, std::int64_t total, std::int64_t length,
                   std::int64_t c) {
  std::vector<std::vector<std::int32_t>> ctx(static_cast<std::size_t>(c));
  std::vector<std::int32_t> target;
  std::size_t d = 0;
  std::vector<std::int64_t> at(docs.size(), c - 1);
  std::int64_t misses = 0;
  while (std::int64_t(target.size()) < total) {
    const std::string& text = docs[d]->bytes;
    const std::int64_t n = std::min(length, total - std::int64_t(target.size()));
    if (at[d] + n < std::int64_t(text.size())) {
      append_positions(text, at[d], n, c, ctx, target);
      at[d] += n;
      misses = 0;
    } else {
      check(++misses <= std::int64_t(docs.size()), "moe_budget: the documents hold fewer than {} tokens", total);
    }
    d = (d + 1) % docs.size();
  }
  return make_batch(ctx, target);
}

// ---- the model ----

// Weights, and with the same shapes its gradients and AdamW moments.
struct Model {
  std::vector<Tensor<float>> embed;  // [C] x [vocab, h]
  std::vector<MoeShard> layer;       // [L]: router, experts, shared expert (one rank: every expert)
  std::vector<Tensor<float>> norm;   // [L] x [h]: RMSNorm gains before each block
  Tensor<float> final_norm;          // [h]
  Tensor<float> head;                // [vocab, h]

  std::vector<Tensor<float>*> tensors() {
    std::vector<Tensor<float>*> t;
    for (Tensor<float>& e : embed) t.push_back(&e);
    for (MoeShard& s : layer)
      for (Tensor<float>* x : {&s.router, &s.expert_in, &s.expert_out, &s.shared_in, &s.shared_out}) t.push_back(x);
    for (Tensor<float>& n : norm) t.push_back(&n);
    t.push_back(&final_norm);
    t.push_back(&head);
    return t;
  }
};

Model zero_model(const MoeConfig& c, std::int64_t context, int layers) {
  Model m;
  for (std::int64_t j = 0; j < context; ++j) m.embed.emplace_back(Shape{kVocab, c.hidden});
  for (int l = 0; l < layers; ++l) {
    m.layer.push_back(MoeShard::zeros(c, 1, 0));
    m.norm.emplace_back(Shape{c.hidden});
  }
  m.final_norm = Tensor<float>(Shape{c.hidden});
  m.head = Tensor<float>(Shape{kVocab, c.hidden});
  return m;
}

void fill(Tensor<float>& t, Rng& rng, double scale) { rng.fill_uniform(t.span(), -scale, scale); }
void fill_ones(Tensor<float>& t) { std::fill(t.span().begin(), t.span().end(), 1.0f); }

Model init_model(const MoeConfig& c, std::int64_t context, int layers, std::uint64_t seed) {
  Model m = zero_model(c, context, layers);
  Rng rng(seed);
  const double h = double(c.hidden), f = double(c.expert_ffn), fs = double(c.shared_width()), depth = 2.0 * layers;
  for (Tensor<float>& e : m.embed) fill(e, rng, 1.0 / std::sqrt(double(context)));
  for (int l = 0; l < layers; ++l) {
    MoeShard& s = m.layer[std::size_t(l)];
    fill(s.router, rng, 0.5 / std::sqrt(h));
    fill(s.expert_in, rng, std::sqrt(3.0 / h));
    fill(s.expert_out, rng, std::sqrt(3.0 / f / depth));
    fill(s.shared_in, rng, std::sqrt(3.0 / h));
    fill(s.shared_out, rng, std::sqrt(3.0 / fs / depth));
    fill_ones(m.norm[std::size_t(l)]);
  }
  fill_ones(m.final_norm);
  fill(m.head, rng, 1.0 / std::sqrt(h));
  return m;
}

// How the MoE blocks route one forward.
struct Allocation {
  std::vector<std::int64_t> k;         // [L]: K_l
  bool pooled = false;                 // Alloc-T: pooled top-(K_l T)
  std::vector<std::int64_t> pools;     // rows of each pool (a sequence each); empty: one pool
};

// What a forward keeps for backward.
struct Forward {
  std::vector<Tensor<float>> x;      // [L + 1] x [n, h]: the residual stream before each block, and after the last
  std::vector<Tensor<float>> normed; // [L] x [n, h]
  std::vector<Tensor<float>> rstd;   // [L + 1] x [n]
  std::vector<MoeSaved> saved;       // [L]
  Tensor<float> final_normed;        // [n, h]
  Tensor<float> logits;              // [n, vocab]
};

Forward forward(const MoeConfig& c, const Model& m, const Batch& b, const Allocation& r, BufferPool& pool) {
  const std::int64_t n = b.n, h = c.hidden;
  const int layers = int(m.layer.size());
  Forward f;
  Tensor<float> x(Shape{n, h}), e(Shape{n, h});
  for (std::size_t j = 0; j < m.embed.size(); ++j) {
    const TensorView<const std::int32_t> tokens = b.context.view().slice(0, std::int64_t(j), 1).reshape(Shape{n});
    Cpu::embedding_forward(tokens, m.embed[j].view(), e.view());
    Cpu::add_into(x.view(), e.view());
  }
  for (int l = 0; l < layers; ++l) {
    Tensor<float> normed(Shape{n, h}), rstd(Shape{n}), y(Shape{n, h});
    Cpu::rms_norm_forward(x.view(), m.norm[std::size_t(l)].view(), 1e-6f, normed.view(), rstd.view());
    TopK k{r.k.empty() ? 0 : r.k[std::size_t(l)]};
    k.pool_tokens = r.pooled;
    k.pools = r.pools;
    f.saved.push_back(moe_forward<Cpu>(MoeContext(c, pool, k), m.layer[std::size_t(l)], normed.view(), y.view()));
    Tensor<float> next(Shape{n, h});
    Cpu::copy(x.view(), next.view());
    Cpu::add_into(next.view(), y.view());
    f.x.push_back(std::move(x));
    f.normed.push_back(std::move(normed));
    f.rstd.push_back(std::move(rstd));
    x = std::move(next);
  }
  f.final_normed = Tensor<float>(Shape{n, h});
  Tensor<float> rstd(Shape{n});
  Cpu::rms_norm_forward(x.view(), m.final_norm.view(), 1e-6f, f.final_normed.view(), rstd.view());
  f.rstd.push_back(std::move(rstd));
  f.x.push_back(std::move(x));
  f.logits = Tensor<float>(Shape{n, kVocab});
  Cpu::matmul(f.final_normed.view(), ops::Transpose::no, m.head.view(), ops::Transpose::yes, f.logits.view());
  return f;
}

// One training step's backward into `g` (zeroed here); returns the mean cross-entropy.
double backward(const MoeConfig& c, const Model& m, const Batch& b, Forward& f, Model& g, BufferPool& pool) {
  const std::int64_t n = b.n, h = c.hidden;
  const int layers = int(m.layer.size());
  for (Tensor<float>* t : g.tensors()) Cpu::fill(t->view(), 0.0f);
  Tensor<float> dlogits(Shape{n, kVocab});
  const ops::cpu::CrossEntropyResult ce =
      Cpu::cross_entropy_forward_backward(f.logits.view(), b.target.view(), dlogits.view(), float(1.0 / double(n)));
  Tensor<float> dnormed(Shape{n, h}), dx(Shape{n, h});
  Cpu::matmul(dlogits.view(), ops::Transpose::no, m.head.view(), ops::Transpose::no, dnormed.view());
  Cpu::matmul(dlogits.view(), ops::Transpose::yes, f.final_normed.view(), ops::Transpose::no, g.head.view(), 1.0f,
              1.0f);
  Cpu::rms_norm_backward(f.x[std::size_t(layers)].view(), m.final_norm.view(), f.rstd[std::size_t(layers)].view(),
                         dnormed.view(), dx.view(), g.final_norm.view());
  for (int l = layers - 1; l >= 0; --l) {
    const std::size_t i = std::size_t(l);
    Tensor<float> dn(Shape{n, h});
    moe_backward<Cpu>(MoeContext(c, pool), m.layer[i], f.saved[i], dx.view(), dn.view(), g.layer[i]);
    // dx (the residual) stays; the block's branch adds through the norm.
    Cpu::rms_norm_backward(f.x[i].view(), m.norm[i].view(), f.rstd[i].view(), dn.view(), dx.view(), g.norm[i].view());
  }
  for (std::size_t j = 0; j < m.embed.size(); ++j) {
    const TensorView<const std::int32_t> tokens = b.context.view().slice(0, std::int64_t(j), 1).reshape(Shape{n});
    Cpu::embedding_backward(tokens, dx.view(), g.embed[j].view());
  }
  return ce.loss_sum / double(ce.counted);
}

// Mean cross-entropy of the logits and, when `full` is given, the fraction of rows whose argmax equals full's.
struct Quality {
  double loss = 0, agreement = 0;
};
std::vector<std::int32_t> argmax_rows(const Tensor<float>& logits) {
  const std::int64_t n = logits.extent(0);
  std::vector<std::int32_t> best(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const float* row = logits.data() + i * kVocab;
    best[std::size_t(i)] = std::int32_t(std::max_element(row, row + kVocab) - row);
  }
  return best;
}
Quality quality(const Tensor<float>& logits, const Batch& b, const std::vector<std::int32_t>& full_argmax) {
  Tensor<float> scratch(logits.shape());
  const ops::cpu::CrossEntropyResult ce =
      Cpu::cross_entropy_forward_backward(logits.view(), b.target.view(), scratch.view(), 1.0f);
  Quality q;
  q.loss = ce.loss_sum / double(ce.counted);
  const std::vector<std::int32_t> mine = argmax_rows(logits);
  std::int64_t same = 0;
  if (!full_argmax.empty())
    for (std::size_t i = 0; i < mine.size(); ++i) same += mine[i] == full_argmax[i];
  q.agreement = full_argmax.empty() ? 1.0 : double(same) / double(mine.size());
  return q;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

template <class F>
double seconds_of(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string join(const std::vector<std::int64_t>& k) {
  std::string s;
  for (const std::int64_t v : k) s += std::to_string(v);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    MoeConfig c;
    c.hidden = o.hidden;
    c.experts = o.experts;
    c.top_k = o.top_k;
    c.expert_ffn = o.expert_ffn;
    c.norm_topk_prob = true;
    c.shared_experts = 1;
    c.shared_ffn = 2 * o.expert_ffn;
    c.aux_loss_coef = 0.01;
    c.validate();

    // ---- data ----
    const std::filesystem::path dir = o.corpus.empty()
                                          ? corpus::ensure_extracted("data/corpus/sotu.tar.xz", "build", "sotu")
                                          : std::filesystem::path(o.corpus);
    const std::vector<corpus::Document> docs = corpus::load(dir);
    std::vector<const corpus::Document*> train, held_out;
    for (std::size_t i = 0; i < docs.size(); ++i) {
      if (std::int64_t(docs[i].bytes.size()) < o.context + 2) continue;
      (i % 8 == 7 ? held_out : train).push_back(&docs[i]);
    }
    check(!train.empty() && !held_out.empty(), "moe_budget: {} documents: too few to hold some out", docs.size());
    std::int64_t held_bytes = 0, train_bytes = 0;
    for (const auto* d : held_out) held_bytes += std::int64_t(d->bytes.size());
    for (const auto* d : train) train_bytes += std::int64_t(d->bytes.size());
    fmt::print("corpus: {} documents; {} held out for evaluation ({} bytes), {} for training and calibration ({} "
               "bytes)\n",
               docs.size(), held_out.size(), held_bytes, train.size(), train_bytes);
    fmt::print("model: trained here (n-gram context of {} bytes, no attention), {} MoE blocks, h = {}, E = {} routed "
               "experts of ffn {}, top-{}, 1 shared expert of ffn {}; full budget B = {} routed activations/token\n",
               o.context, o.layers, o.hidden, o.experts, o.expert_ffn, o.top_k, c.shared_width(),
               std::int64_t(o.layers) * o.top_k);

    // ---- training ----
    Model m = init_model(c, o.context, o.layers, o.seed);
    Model g = zero_model(c, o.context, o.layers), adam_m = zero_model(c, o.context, o.layers),
          adam_v = zero_model(c, o.context, o.layers);
    BufferPool pool;
    Rng rng(o.seed * 7919 + 1);
    ops::AdamWConfig adam;
    adam.weight_decay = 0.0f;
    const auto wt = m.tensors(), gt = g.tensors(), mt = adam_m.tensors(), vt = adam_v.tensors();
    const auto t_train = std::chrono::steady_clock::now();
    double recent = 0;
    for (int step = 1; step <= o.steps; ++step) {
      std::vector<std::vector<std::int32_t>> ctx(static_cast<std::size_t>(o.context));
      std::vector<std::int32_t> target;
      while (std::int64_t(target.size()) < o.batch_tokens) {  // runs of 64 positions at random places
        const corpus::Document& d = *train[std::size_t(rng.below(train.size()))];
        const std::int64_t size = std::int64_t(d.bytes.size()), run = std::min<std::int64_t>(64, size - o.context);
        if (run < 1) continue;
        const std::int64_t first = o.context - 1 + std::int64_t(rng.below(std::uint64_t(size - o.context - run + 1)));
        append_positions(d.bytes, first, std::min(run, o.batch_tokens - std::int64_t(target.size())), o.context, ctx,
                         target);
      }
      const Batch b = make_batch(ctx, target);
      Forward f = forward(c, m, b, Allocation{}, pool);
      const double loss = backward(c, m, b, f, g, pool);
      adam.learning_rate = float(o.lr * std::min(1.0, double(step) / 30.0) *
                                 (0.1 + 0.9 * 0.5 * (1.0 + std::cos(3.14159265358979 * double(step) / o.steps))));
      for (std::size_t i = 0; i < wt.size(); ++i)
        Cpu::adamw_step(wt[i]->view(), gt[i]->view(), mt[i]->view(), vt[i]->view(), adam, step);
      recent = step == 1 ? loss : 0.9 * recent + 0.1 * loss;
      if (step % 50 == 0 || step == o.steps)
        fmt::print("step {:4d}  loss {:.3f} (smoothed {:.3f})  {:.1f} s\n", step, loss, recent,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t_train).count());
      std::fflush(stdout);
    }

    // ---- evaluation and calibration text ----
    const std::int64_t seq = o.prefill;
    const std::int64_t eval_n = (o.eval_tokens + seq - 1) / seq * seq, calib_n = (o.calib_tokens + seq - 1) / seq * seq;
    const Batch eval = sequences_of(held_out, eval_n, seq, o.context);
    const Batch calib = sequences_of(train, calib_n, seq, o.context);
    const std::vector<std::int64_t> eval_pools(static_cast<std::size_t>(eval_n / seq), seq);
    const std::vector<std::int64_t> top_k(static_cast<std::size_t>(o.layers), o.top_k);

    // ---- Alloc-L: sensitivity by calibration loss ----
    const auto t_profile = std::chrono::steady_clock::now();
    const SensitivityTable table = profile_loss_sensitivity(top_k, top_k, calib.n, [&](std::span<const std::int64_t> k) {
      Allocation r;
      r.k.assign(k.begin(), k.end());
      const Forward f = forward(c, m, calib, r, pool);
      return quality(f.logits, calib, {}).loss;
    });
    fmt::print("\nsensitivity Delta_l(k) (calibration loss increase, {} tokens, base loss {:.4f}; {:.1f} s):\n",
               calib.n, table.base,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t_profile).count());
    fmt::print("  layer");
    for (std::int64_t k = 1; k <= o.top_k; ++k) fmt::print(" {:>9}", fmt::format("k={}", k));
    fmt::print("\n");
    for (int l = 0; l < o.layers; ++l) {
      fmt::print("  {:5d}", l);
      for (const double d : table.delta[std::size_t(l)]) fmt::print(" {:9.5f}", d);
      fmt::print("\n");
    }
    if (!o.table.empty()) {
      save_sensitivity(table, o.table);
      fmt::print("sensitivity table saved to {}\n", o.table);
    }

    // ---- the table ----
    struct Row {
      int percent;
      std::int64_t budget;
      std::string method, k;
      double ppl, agreement, prefill_us, decode_us, prefill_speedup, decode_speedup;
    };
    std::vector<Row> rows;
    Batch prefill_batch = sequences_of(held_out, seq, seq, o.context);
    const Batch decode_batch = sequences_of(held_out, o.decode, o.decode, o.context);
    std::vector<Batch> decode_tokens;
    for (std::int64_t i = 0; i < decode_batch.n; ++i) {
      std::vector<std::vector<std::int32_t>> ctx(static_cast<std::size_t>(o.context));
      for (std::int64_t j = 0; j < o.context; ++j) ctx[std::size_t(j)].push_back(decode_batch.context.span()[std::size_t(j * decode_batch.n + i)]);
      decode_tokens.push_back(make_batch(ctx, {decode_batch.target.span()[std::size_t(i)]}));
    }
    std::vector<std::int32_t> full_argmax;
    double full_prefill = 0, full_decode = 0;
    const std::vector<std::int64_t> prefill_pool{seq};
    for (const int percent : {100, 75, 50, 25}) {
      if (std::llround(percent / 100.0 * double(full_budget(top_k))) < o.layers) {
        fmt::print("budget {}%: below one expert in each of the {} layers, skipped\n", percent, o.layers);
        continue;
      }
      const std::int64_t budget = resolve_budget(BudgetSpec::of_share(percent / 100.0), top_k);
      const std::vector<std::int64_t> uniform = uniform_allocation(top_k, budget);
      const std::vector<std::int64_t> alloc_l = allocate_layers(table.delta, budget).k;
      struct Method {
        const char* name;
        std::vector<std::int64_t> k;
        bool pooled;
      };
      const Method methods[] = {{"uniform top-k", uniform, false}, {"Alloc-L", alloc_l, false},
                                {"Alloc-L + Alloc-T", alloc_l, true}};
      for (const Method& method : methods) {
        if (percent == 100 && method.pooled == false && std::string(method.name) == "Alloc-L") continue;  // = uniform
        Allocation r{method.k, method.pooled, eval_pools};
        const Forward f = forward(c, m, eval, r, pool);
        if (full_argmax.empty()) full_argmax = argmax_rows(f.logits);
        const Quality q = quality(f.logits, eval, full_argmax);
        std::vector<double> prefill_times, decode_times;
        const Allocation rp{method.k, method.pooled, prefill_pool};
        const Allocation rd{method.k, method.pooled, {}};
        for (int rep = 0; rep < o.repeats; ++rep) {
          prefill_times.push_back(seconds_of([&] { (void)forward(c, m, prefill_batch, rp, pool); }) / double(seq));
          decode_times.push_back(seconds_of([&] {
                                   for (const Batch& t : decode_tokens) (void)forward(c, m, t, rd, pool);
                                 }) /
                                 double(decode_tokens.size()));
        }
        const double prefill_us = 1e6 * median(prefill_times), decode_us = 1e6 * median(decode_times);
        if (percent == 100 && !method.pooled) full_prefill = prefill_us, full_decode = decode_us;
        rows.push_back({percent, budget, method.name, join(method.k), std::exp(q.loss), q.agreement, prefill_us,
                        decode_us, full_prefill / prefill_us, full_decode / decode_us});
      }
    }
    fmt::print("\nheld-out: {} tokens in sequences of {} (Alloc-T pools per sequence); timing: median of {} runs, "
               "prefill = one sequence of {} tokens per forward, decode = {} forwards of one token (T = 1)\n",
               eval.n, seq, o.repeats, seq, decode_tokens.size());
    fmt::print("{:>6} {:>4} {:<18} {:<10} {:>8} {:>8} {:>11} {:>11} {:>8} {:>8}\n", "budget", "B", "method",
               "K_l", "ppl", "agree", "prefill us", "decode us", "prefill", "decode");
    for (const Row& r : rows)
      fmt::print("{:>5}% {:>4} {:<18} {:<10} {:8.3f} {:7.2f}% {:11.2f} {:11.2f} {:7.2f}x {:7.2f}x\n", r.percent,
                 r.budget, r.method, r.k, r.ppl, 100 * r.agreement, r.prefill_us, r.decode_us, r.prefill_speedup,
                 r.decode_speedup);
    if (!o.csv.empty()) {
      std::FILE* out = std::fopen(o.csv.c_str(), "w");
      check(out != nullptr, "moe_budget: cannot open {} for writing", o.csv);
      fmt::print(out, "budget_percent,budget,method,k,perplexity,agreement,prefill_us_per_token,decode_us_per_token,"
                      "prefill_speedup,decode_speedup\n");
      for (const Row& r : rows)
        fmt::print(out, "{},{},{},{},{:.6f},{:.6f},{:.4f},{:.4f},{:.4f},{:.4f}\n", r.percent, r.budget, r.method, r.k,
                   r.ppl, r.agreement, r.prefill_us, r.decode_us, r.prefill_speedup, r.decode_speedup);
      check(std::fclose(out) == 0, "moe_budget: writing {} failed", o.csv);
      fmt::print("table written to {}\n", o.csv);
    }

    // ---- the DP's time on a DeepSeek-V2-Lite-shaped problem ----
    {
      Rng dp_rng(o.seed + 26);
      std::vector<std::vector<double>> delta(26, std::vector<double>(6, 0.0));
      for (auto& row : delta)
        for (std::size_t k = 0; k + 1 < row.size(); ++k) row[k] = dp_rng.uniform(0.0, 1.0) / double(k + 1);
      std::vector<double> times;
      std::int64_t sink = 0;
      for (int rep = 0; rep < 2000; ++rep)
        times.push_back(seconds_of([&] { sink += allocate_layers(delta, 78).k[0]; }));
      std::vector<double> ours;
      for (int rep = 0; rep < 2000; ++rep)
        ours.push_back(seconds_of([&] { sink += allocate_layers(table.delta, std::int64_t(o.layers) * o.top_k / 2).k[0]; }));
      fmt::print("\nAlloc-L DP: 26 layers, K_max 6, B = 78 (DeepSeek-V2-Lite at half budget): median {:.2f} us "
                 "(2000 runs); this model ({} layers, B = {}): {:.2f} us  [{}]\n",
                 1e6 * median(times), o.layers, std::int64_t(o.layers) * o.top_k / 2, 1e6 * median(ours), sink > 0);
    }
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "moe_budget: {}\n", e.what());
    return 1;
  }
}
