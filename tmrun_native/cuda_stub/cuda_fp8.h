/* tmrun: empty types-only stand-in, see cuda_runtime.h in this folder. */
