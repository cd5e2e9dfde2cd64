/* torpor's status codes: what every C entry point returns (torpor.h), and the vocabulary of
 * errors across the library (common/error_kind.hpp maps each to its exception). A header of its
 * own so that the library's lowest wing names the codes without including the C API. */
#ifndef TORPOR_STATUS_H
#define TORPOR_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum torpor_status {
  TORPOR_OK = 0,
  TORPOR_ERROR_INVALID_ARGUMENT = 1, /* bad size, pointer, tag, class, level ... */
  TORPOR_ERROR_INVALID_STATE = 2,    /* e.g. allocate into a sleeping tag */
  TORPOR_ERROR_OUT_OF_MEMORY = 3,    /* device, VA or host backing store */
  TORPOR_ERROR_DRIVER = 4,           /* a CUDA driver call failed */
  TORPOR_ERROR_TIMEOUT = 5,
  TORPOR_ERROR_INVALID_HANDLE = 6, /* pool handle destroyed or never created */
  TORPOR_ERROR_INTERNAL = 7,
  TORPOR_ERROR_UNAVAILABLE = 8 /* the backend or feature is not available here (no usable GPU, ...) */
} torpor_status;

#ifdef __cplusplus
}
#endif

#endif /* TORPOR_STATUS_H */
