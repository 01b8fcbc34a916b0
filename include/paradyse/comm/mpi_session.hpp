// paradyse/comm/mpi_session.hpp: MPI's lifetime in a program (MpiSession: initialise, finalise) and the end of the
// whole job when one rank fails (abort_mpi_job: the reason naming the rank, then MPI_Abort).
#pragma once

#include "paradyse/comm/mpi_h.hpp"
#include "paradyse/core/error.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

namespace paradyse {

// Initialises MPI for the lifetime of the object (unless already initialised) and finalises it after.
class MpiSession {
public:
  MpiSession(int* argc, char*** argv, int required = MPI_THREAD_FUNNELED) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      if (MPI_Init_thread(argc, argv, required, &provided) != MPI_SUCCESS) throw CommError("MPI_Init_thread failed");
      owns_ = true;
    }
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  ~MpiSession() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_ && !finalized) MPI_Finalize();
  }

private:
  bool owns_ = false;
};

// Ends the whole job because this rank failed: prints the reason naming the rank, then MPI_Abort.
[[noreturn]] inline void abort_mpi_job(std::string_view reason, int exit_code = 1) {
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string message = fmt::format("paradyse: MPI world rank {} failed: {}\n", rank, reason);
  std::fputs(message.c_str(), stderr);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::abort();
}

}  // namespace paradyse
