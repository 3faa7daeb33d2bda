// One GEMM variant as one translation unit: the benchmark's job runner and main (gemm.cpp)
// and the in-process entry (gemm_lib.cpp), with the same -D parameters. The build stage
// compiles it once, with -fPIC, into an object that both the benchmark executable and the
// in-process shared library are linked from, so the variant's kernel code is compiled once
// and the library runs the very machine code the executable was validated and timed with.
// The GEMV-class path is not compiled here: it depends only on the dtype, ISA, scheme and
// prefetch, and comes from gemm_skinny.cpp's object, compiled once for the variants sharing
// those and linked beside this one (gemm.cpp and gemm_lib.cpp alone still compile it in).
#define TC_SKINNY_SEPARATE
#include "gemm.cpp"
#include "gemm_lib.cpp"
