// The doctest runner for the multi-process tests: MPI is initialised around the whole run, and only rank 0 reports.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context context(argc, argv);
  if (rank != 0) context.setOption("out", "/dev/null");
  int failures = context.run();
  // Any rank's failure fails the whole run.
  int any_failure = 0;
  MPI_Allreduce(&failures, &any_failure, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any_failure ? 1 : 0;
}
