// paradyse/cost/json.hpp: the JSON value, reader and writer now live in core/json.hpp (every layer may use them, moe/
// included); this header keeps the old include path working.
#pragma once

#include "paradyse/core/json.hpp"
