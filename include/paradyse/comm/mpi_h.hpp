// paradyse/comm/mpi_h.hpp: <mpi.h> without the deprecated MPI C++ bindings (they are not used, and warn under
// -Wextra). Every MPI header of comm/ includes MPI through this one.
#pragma once

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
