# How libtorpor gets fmt (included once from the top CMakeLists.txt, after find_package(fmt)).
#
# fmt's compiled part is compiled once into libtorpor (allocator/src/common/fmt_once.cpp), so
# nothing links the system's libfmt.so (the wheel runs on machines without it) and no translation
# unit compiles fmt's implementation again (fmt's header-only mode does, in every file that
# includes it). fmt_once.cpp holds the explicit instantiations of the fmt versions it knows: a
# probe links it with no fmt library first, and where it does not link (another fmt), fmt is used
# header-only instead, as before.
#
# Sets TORPOR_FMT_MODE (compiled-once | header-only) and defines torpor_use_fmt(target), which
# gives libtorpor its fmt: the headers without FMT_HEADER_ONLY plus fmt_once.cpp in the build,
# and fmt::fmt-header-only for projects that use the installed package (their own copy of the
# inline parts; the exported symbols of libtorpor then never decide which fmt they get).

get_target_property(_torpor_fmt_includes fmt::fmt-header-only INTERFACE_INCLUDE_DIRECTORIES)
if(NOT _torpor_fmt_includes)
  set(_torpor_fmt_includes "")
endif()

# Probed again when fmt's version changes under an existing build directory (a stale answer would
# fail libtorpor's link on the new fmt's missing instantiations).
if(NOT DEFINED TORPOR_FMT_COMPILED_ONCE_WORKS OR NOT TORPOR_FMT_PROBED_VERSION STREQUAL fmt_VERSION)
  try_compile(_torpor_fmt_probe ${CMAKE_BINARY_DIR}/torpor_fmt_probe
              SOURCES ${PROJECT_SOURCE_DIR}/allocator/src/common/fmt_once.cpp ${PROJECT_SOURCE_DIR}/cmake/fmt_probe.cpp
                      ${PROJECT_SOURCE_DIR}/cmake/fmt_probe_core.cpp
              CMAKE_FLAGS "-DINCLUDE_DIRECTORIES=${_torpor_fmt_includes}"
              CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON
              OUTPUT_VARIABLE _torpor_fmt_probe_out)
  set(TORPOR_FMT_COMPILED_ONCE_WORKS ${_torpor_fmt_probe} CACHE INTERNAL "fmt_once.cpp links with this fmt")
  set(TORPOR_FMT_PROBED_VERSION ${fmt_VERSION} CACHE INTERNAL "the fmt version the probe ran with")
  if(NOT _torpor_fmt_probe)
    message(STATUS "torpor: allocator/src/common/fmt_once.cpp does not fit fmt ${fmt_VERSION}: "
                   "fmt is used header-only (a slower build, the same library)")
  endif()
endif()

if(TORPOR_FMT_COMPILED_ONCE_WORKS)
  set(TORPOR_FMT_MODE compiled-once)
else()
  set(TORPOR_FMT_MODE header-only)
endif()
message(STATUS "torpor: fmt ${fmt_VERSION}, ${TORPOR_FMT_MODE}")

function(torpor_use_fmt target)
  if(TORPOR_FMT_MODE STREQUAL compiled-once)
    target_sources(${target} PRIVATE ${PROJECT_SOURCE_DIR}/allocator/src/common/fmt_once.cpp)
    target_include_directories(${target} SYSTEM PUBLIC "$<BUILD_INTERFACE:${_torpor_fmt_includes}>")
    target_link_libraries(${target} PUBLIC $<INSTALL_INTERFACE:fmt::fmt-header-only>)
  else()
    target_link_libraries(${target} PUBLIC fmt::fmt-header-only)
  endif()
endfunction()
