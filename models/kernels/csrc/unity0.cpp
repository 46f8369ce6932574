// A translation unit of the kernels' build (models/kernels/native.py: UNITS): each .cpp spent 13 of its 15-20 s of
// compile on torch's headers, so the build compiles the sources as two units that include them, one per core (56 s
// as seven units, 30 s as two, on a 2-core Intel Xeon). The .cpp files keep their names apart for it: no type or
// function name twice in the anonymous namespaces of one unit.
#include "matvec.cpp"
#include "decode_attention.cpp"
#include "block_glue.cpp"
#include "decode_block.cpp"
