# Turns a binary file into a C++ source defining `extern const unsigned char SYMBOL[]` and
# `extern const std::size_t SYMBOL_size`. Usage: cmake -DINPUT=.. -DOUTPUT=.. -DSYMBOL=.. -P embed.cmake
file(READ "${INPUT}" hex HEX)
string(LENGTH "${hex}" hex_length)
math(EXPR size "${hex_length} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
file(WRITE "${OUTPUT}" "// Generated from ${INPUT} by cmake/embed.cmake. Do not edit.\n#include <cstddef>\n"
  "alignas(8) extern const unsigned char ${SYMBOL}[] = {${bytes}};\n"
  "extern const std::size_t ${SYMBOL}_size = ${size};\n")
