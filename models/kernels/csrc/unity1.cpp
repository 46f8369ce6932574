// The other translation unit of the kernels' build (unity0.cpp says why).
#include "prompt_gemm.cpp"
#include "prompt_attention.cpp"
#include "router.cpp"
