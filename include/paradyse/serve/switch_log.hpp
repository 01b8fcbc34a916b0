// paradyse/serve/switch_log.hpp: where a layout policy switched, step by step: one CSV row per served step (the trace
// and policy it belongs to, its index, the clock's time at its end, its tokens and the layout its MoE layers computed
// in), the file scripts/plot.py draws as batch size and layout over time. moe_simulate and moe_infer write it for
// `--switch-csv FILE`.
//
//   SwitchLog log(path, "--switch-csv");               // an empty path logs nothing
//   clock.observer = log.observer("Poisson 4 req/s", "dynamic TP/EP");
//   ... serve ...
//   log.close();                                        // in place (atomically); log.failed() for the exit status
//
// A side output: a write that fails warns once on stderr and the run goes on without the log (core/csv_table.hpp).
#pragma once

#include "paradyse/core/csv_table.hpp"
#include "paradyse/serve/clock.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace paradyse::serve {

class SwitchLog {
public:
  SwitchLog(const std::string& path, const std::string& flag)
      : csv_(std::make_unique<CsvTable>(path, std::vector<std::string>{"trace", "policy", "step", "time_s", "tokens",
                                                                       "layout"},
                                        CsvTable::OnFailure::warns, flag)) {}

  bool enabled() const noexcept { return csv_ && csv_->enabled(); }
  bool failed() const noexcept { return csv_ && csv_->failed(); }
  void close() {
    if (csv_) csv_->close();
  }

  // A clock observer (EngineClock::observer) that logs the steps of one run of `trace` under `policy`, numbered from
  // 0, each with the layout it computed in (step_trace.hpp computed_layout: "TP", "EP", or "dense"). Empty when the
  // log is not enabled.
  std::function<void(const StepTrace&, const StepTiming&, double)> observer(std::string trace, std::string policy) {
    if (!enabled()) return {};
    return [table = csv_.get(), step = std::int64_t(0), trace = std::move(trace), policy = std::move(policy)](
               const StepTrace& t, const StepTiming&, double end) mutable {
      table->row(trace, policy, step++, fmt::format("{:.6g}", end), t.tokens(), computed_layout(t));
    };
  }

private:
  std::unique_ptr<CsvTable> csv_;  // behind a pointer: the observers hold the table, and the log may move
};

}  // namespace paradyse::serve
