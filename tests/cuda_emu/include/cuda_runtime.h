/* Forwards to the CUDA emulator (tests/cuda_emu/cuda_emu.h) in emulated builds. */
#include "../cuda_emu.h"
