/* Which compute backend a subcommand runs on: --backend cpu, cuda or auto
 * (cuda when this binary has it and a GPU is present, else cpu). */
#ifndef ARSERVE_BACKEND_OPEN_H
#define ARSERVE_BACKEND_OPEN_H

#include "engine/backend.h"

/* Creates the backend `name` ("cpu", "cuda" or "auto"); threads is the CPU
 * backend's thread count (0: all cores). NULL with a message in err when
 * the name is unknown, cuda is asked of a binary built without CUDA=1, or
 * the backend cannot start. */
backend_t *backend_open(const char *name, int threads, ar_error_t *err);

#endif
