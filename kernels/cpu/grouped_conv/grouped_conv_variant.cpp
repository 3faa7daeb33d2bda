// One grouped-convolution variant as one translation unit: the benchmark's job runner and
// main (grouped_conv.cpp) and the in-process entry (grouped_conv_lib.cpp), with the same -D
// parameters. The build stage compiles it once, with -fPIC, into an object that both the
// benchmark executable and the in-process shared library are linked from, so the variant's
// kernel code is compiled once and the library runs the very machine code the executable was
// validated and timed with.
#if TC_PIPELINE == 3 || TC_PIPELINE == 4
// the gemm and winograd pipelines' GEMM library takes its GEMV-class path from
// kernels/cpu/gemm/gemm_skinny.cpp's object (the GEMM family's, for the same parameters)
#define TC_SKINNY_SEPARATE
#endif
#include "grouped_conv.cpp"
#include "grouped_conv_lib.cpp"
