// One rowsum variant as one translation unit: the benchmark binary and the in-process library
// (tilecast's builder compiles it once into an object and links both from it, so the library
// runs the machine code the binary was validated with).
#include "rowsum.cpp"
#include "rowsum_lib.cpp"
