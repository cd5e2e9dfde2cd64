/* torpor's backends as the C API numbers them (torpor_pool_options.backend, torpor_backend_name).
 * A header of its own so that the one table of backends (torpor/backend_table.hpp), which the
 * options module reads, names the values without including the C API. */
#ifndef TORPOR_BACKEND_H
#define TORPOR_BACKEND_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum torpor_backend {
  TORPOR_BACKEND_AUTO = 0,
  TORPOR_BACKEND_HOST = 1,
  TORPOR_BACKEND_CUDA = 2
} torpor_backend;

#ifdef __cplusplus
}
#endif

#endif /* TORPOR_BACKEND_H */
