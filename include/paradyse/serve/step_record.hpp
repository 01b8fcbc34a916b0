// paradyse/serve/step_record.hpp: what the decoder step's own element loops record (the loops that are not backend
// ops: bias adds, OLMoE's q/k norm sums, the KV append, the attention over the paged cache). A dry run
// (ops::Counting) skips the loops and records them; a CPU step runs them and records them too when a Trace is
// installed, so its kernel list can be read off and compared with the dry run's (serve/decoder_step.hpp).
#pragma once

#include "paradyse/core/trace.hpp"

namespace paradyse::serve::step_detail {

// The backend records a trace instead of computing (ops::Counting).
template <class Backend>
inline constexpr bool records = requires { requires Backend::records_trace; };

// What an element loop of the step does, into the thread's Trace when one is installed.
inline void note(const TraceEvent& e) {
  if (Trace* t = Trace::current()) t->record(e);
}
inline void note_stream(double floats, ElementwiseFamily family = ElementwiseFamily::other) {
  note({.kind = TraceKind::elementwise, .family = family, .bytes = 4 * floats});
}

}  // namespace paradyse::serve::step_detail
