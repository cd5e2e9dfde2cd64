// torpor_pool_options (torpor.h) as the C++ side reads it, through one list of fields: for each
// field its C member, its C++ member (the driver backend, or a PoolOptions member) and the check
// that converts one into the other. Defaults (torpor_pool_options_init), validation and
// conversion (torpor_pool_create, torpor_torch_configure) and comparison (torpor_torch_configure
// of pools that exist already) all walk that list, so a new pool option is one row of it in
// c_pool_options.cpp, besides the C member, the PoolOptions member it sets and the Python
// description of the options.
//
// Invariants: the defaults a C caller gets are PoolOptions' own (and the automatic backend); a
// field's check refuses what its conversion cannot carry (invalid_argument naming the field and
// what it accepts), in the C struct's field order; two options compare equal when they ask for
// the same pool (compared after conversion, so 1 and 2 are the same `exportable`).
#pragma once

#include "torpor/backend.hpp"
#include "torpor/pool.hpp"
#include "torpor/torpor.h"

namespace torpor::detail {

// What a torpor_pool_options asks for: a driver backend and the pool's options.
struct PoolSpec {
  Backend backend = Backend::automatic;
  PoolOptions pool;
};

// The C options' defaults: those of PoolSpec{}. spill_dir is NULL.
void init_c_pool_options(torpor_pool_options& o) noexcept;

// Checks each field and converts; throws invalid_argument naming the first field refused.
PoolSpec pool_spec_of(const torpor_pool_options& o);

// Whether two converted options ask for the same pool, field by field.
bool same_pool_spec(const PoolSpec& a, const PoolSpec& b);

}  // namespace torpor::detail
