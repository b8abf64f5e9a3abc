/* The launch counter behind AR_LAUNCH (launch.h), in a file of its own so
 * that anything launching kernels links it without the kernels. */
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.h"

thread_local unsigned long long ar_kernels_started = 0;

unsigned long long kern_kernels_started(void) { return ar_kernels_started; }
