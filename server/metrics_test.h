/* For tests only: the array forms of metric_add, metric_set and
 * metric_value (server/metrics.h), which no part of the daemon calls; the
 * tests check the macros and these agree on a series. */
#ifndef ARSERVE_METRICS_TEST_H
#define ARSERVE_METRICS_TEST_H

#include "server/metrics.h"

/* label_values: exactly the family's n_labels values (the count cannot be
 * checked here). */
void metric_add_v(metric_t *m, double v, const char *const *label_values);
void metric_set_v(metric_t *m, double v, const char *const *label_values);
double metric_value_v(metric_t *m, const char *const *label_values);

#endif
