// The doctest runner, in its own translation unit (it takes seconds to compile; test files then rebuild fast).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
