// The tile layout's kernels without AMX, VNNI for every row count: blocks_amx.cpp built without -mamx-int8.
#include "blocks_amx.cpp"
