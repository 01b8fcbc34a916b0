// Uses the installed headers: a tensor through the memory tracker, an all-reduce on 3 thread ranks, and a JSON
// round trip (core/json.hpp needs the package's nlohmann_json dependency).
#include <paradyse/comm/threads.hpp>
#include <paradyse/core/json.hpp>
#include <paradyse/core/tensor.hpp>

#include <cstdio>

int main() {
  using namespace paradyse;
  bool ok = true;
  run_ranks(3, [&](ThreadCommunicator& comm) {
    Tensor<float> x({4});
    x.fill(float(comm.rank() + 1));
    comm.all_reduce(x.span(), x.span(), ReduceOp::sum);
    if (x(0) != 6.0f) ok = false;
  });
  const json::Value doc = json::parse(json::dump(json::Value{{"rate", 0.1}}));
  if (json::Field(doc, "consumer")["rate"].number() != 0.1) ok = false;
  std::printf("package consumer: %s\n", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
