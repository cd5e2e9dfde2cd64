// Which sanitizer the test executable is built with, the same way for GCC and clang: GCC defines
// __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__, clang answers __has_feature. Tests that scale their
// work down under a sanitizer (which slows every instrumented access) ask these, so a sanitizer
// build with either compiler runs the same amount.
#pragma once

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TORPOR_TEST_ASAN 1
#endif
#if __has_feature(thread_sanitizer)
#define TORPOR_TEST_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(TORPOR_TEST_ASAN)
#define TORPOR_TEST_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__) && !defined(TORPOR_TEST_TSAN)
#define TORPOR_TEST_TSAN 1
#endif
