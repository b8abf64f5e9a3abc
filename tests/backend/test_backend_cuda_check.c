/* ARSERVE_CUDA_CHECK=1 blames a device fault on the op that caused it. On
 * a GPU a kernel faults after its launch has returned, so without the
 * switch the fault surfaces in whatever call comes next, in a later op;
 * with it, the backend synchronises after every op and the first error
 * names the op. The faults are planted in the CUDA emulator
 * (tests/cuda_emu), asynchronously as a GPU reports them
 * (cuda_emu_fault_launch_async), so this test needs the emulator. */
#include <stdlib.h>
#include <string.h>

#include "engine/backend/backend.h"
#include "tests/cuda_emu/cuda_emu.h"
#include "tests/test.h"

#define RESERVE ((size_t)128 << 20)
#define ROWS 3
#define DIM 64

/* A backend made with ARSERVE_CUDA_CHECK set to value (NULL: unset). */
static backend_t *create_with(const char *value, ar_error_t *err) {
    if (value)
        setenv("ARSERVE_CUDA_CHECK", value, 1);
    else
        unsetenv("ARSERVE_CUDA_CHECK");
    backend_t *be = backend_cuda_create(0, RESERVE, err);
    unsetenv("ARSERVE_CUDA_CHECK");
    return be;
}

/* Two ops in a row, the first one's kernel faulting after its launch:
 * rmsnorm (one launch), then silu, then (wait) a wait for the stream,
 * with graphs as given. The backend's status, in err. */
static void fault_in_rmsnorm_then_silu(const char *check, backend_graphs_t graphs, int wait,
                                       ar_error_t *out) {
    ar_error_t err = {{0}};
    backend_t *be = create_with(check, &err);
    CHECK_MSG(be != NULL, "%s", err.msg);
    out->msg[0] = 0;
    if (!be)
        return;
    be->graphs = graphs;
    float host[ROWS * DIM];
    for (int i = 0; i < ROWS * DIM; i++)
        host[i] = (float)(i % 7) - 3.0f;
    tensor_t w;
    const int64_t shape[1] = {DIM};
    CHECK(be->weight_load(be, &w, host, DTYPE_F32, 1, shape, &err) == AR_OK);
    float *x = be->alloc(be, sizeof host);
    be->upload(be, x, host, sizeof host);
    CHECK(backend_status(be, &err) == AR_OK);
    cuda_emu_fault_launch_async(0, cudaErrorIllegalAddress);
    be->rmsnorm(be, x, x, &w, ROWS, DIM, 1e-6f);
    be->silu(be, x, (size_t)ROWS * DIM);
    if (wait)
        be->sync(be);
    CHECK(backend_status(be, out) == AR_ERR);
    const char *why = backend_unusable(be);
    CHECK(why != NULL);
    be->destroy(be);
    cudaDeviceReset();
}

/* Without the switch, op by op, the fault surfaces at silu's launch: the
 * error names silu's kernel, not rmsnorm. This is why the switch exists,
 * and it shows that the emulator's fault is as late as a GPU's. */
static void test_without_check_a_fault_is_blamed_on_a_later_op(void) {
    ar_error_t err = {{0}};
    fault_in_rmsnorm_then_silu(NULL, GRAPHS_OFF, 0, &err);
    const char *msg = err.msg;
    CHECK_STR_CONTAINS(msg, "kern_silu");
    CHECK_MSG(!strstr(msg, "rmsnorm"), "\"%s\" names rmsnorm without the switch", msg);
}

/* With it, the synchronisation after rmsnorm reports the fault, naming
 * the op; silu is not blamed. */
static void test_check_names_the_op_that_faulted(void) {
    ar_error_t err = {{0}};
    fault_in_rmsnorm_then_silu("1", GRAPHS_ON, 0, &err);
    const char *msg = err.msg;
    CHECK_STR_CONTAINS(msg, "in op rmsnorm: ");
    CHECK_STR_CONTAINS(msg, "ARSERVE_CUDA_CHECK=1");
    CHECK_STR_CONTAINS(msg, "illegal memory access");
    CHECK_MSG(!strstr(msg, "silu"), "\"%s\" blames silu", msg);
}

/* With graphs, the step's ops are recorded, not run: nothing fails until
 * the step is launched, at the wait that ends it, which reports the
 * device's error (the emulator's faulting kernel stops its graph's launch;
 * a GPU's surfaces at the wait). The switch turns graphs off. */
static void test_with_graphs_a_fault_surfaces_when_the_step_runs(void) {
    ar_error_t err = {{0}};
    fault_in_rmsnorm_then_silu(NULL, GRAPHS_ON, 1, &err);
    CHECK_STR_CONTAINS(err.msg, "illegal memory access");
    CHECK_MSG(strstr(err.msg, "cudaGraphLaunch") || strstr(err.msg, "cudaStreamSynchronize"),
              "\"%s\" is not the step's launch or wait", err.msg);
}

/* Where the device cannot capture a graph (the probe at creation fails),
 * the backend is made all the same and runs its steps op by op, with the
 * same results: no graph launches, an upload per staged array. */
static void test_a_device_without_graphs_runs_op_by_op(void) {
    ar_error_t err = {{0}};
    cuda_emu_refuse_capture(1);
    backend_t *be = create_with(NULL, &err);
    cuda_emu_refuse_capture(0);
    CHECK_MSG(be != NULL, "%s", err.msg);
    if (!be)
        return;
    CHECK(be->graphs == GRAPHS_ON); /* the setting stands; the device declines it */
    float host[ROWS * DIM], out[ROWS * DIM];
    for (int i = 0; i < ROWS * DIM; i++)
        host[i] = (float)(i % 5);
    float *x = be->alloc(be, sizeof host);
    be->upload(be, x, host, sizeof host);
    const int pos[ROWS] = {1, 2, 3};
    backend_stats_t t, d;
    backend_stats(be, &t);
    be->scale(be, x, (size_t)ROWS * DIM, 2.0f);
    be->rope(be, x, pos, ROWS, 2, DIM / 2, 10000.0f);
    be->download(be, out, x, sizeof out);
    backend_stats(be, &d);
    CHECK_MSG(d.graph_launches == t.graph_launches && d.h2d_copies == t.h2d_copies + 1 &&
                  d.syncs == t.syncs + 1,
              "%llu graph launches, %llu uploads, %llu waits",
              (unsigned long long)(d.graph_launches - t.graph_launches),
              (unsigned long long)(d.h2d_copies - t.h2d_copies),
              (unsigned long long)(d.syncs - t.syncs));
    CHECK(backend_status(be, &err) == AR_OK);
    CHECK(out[DIM * 2 + 1] != 0.0f || out[DIM * 2] != 0.0f); /* the ops ran */
    be->destroy(be);
    /* and a device that captures gets graphs: the same step, one graph launch */
    be = create_with(NULL, &err);
    CHECK_MSG(be != NULL, "%s", err.msg);
    if (!be)
        return;
    x = be->alloc(be, sizeof host);
    be->upload(be, x, host, sizeof host);
    backend_stats(be, &t);
    be->scale(be, x, (size_t)ROWS * DIM, 2.0f);
    be->rope(be, x, pos, ROWS, 2, DIM / 2, 10000.0f);
    be->download(be, host, x, sizeof host);
    backend_stats(be, &d);
    CHECK(d.graph_launches == t.graph_launches + 1);
    CHECK_MSG(!memcmp(host, out, sizeof out), "graphs and op by op differ");
    be->destroy(be);
}

/* A fault that an op's own later call already sees (matmul with a 16-bit
 * weight: the activation split faults, its GEMM fails) names the op too,
 * with the call that saw it. */
static void test_check_names_the_op_when_its_own_call_fails(void) {
    ar_error_t err = {{0}};
    backend_t *be = create_with("1", &err);
    CHECK_MSG(be != NULL, "%s", err.msg);
    if (!be)
        return;
    uint16_t wh[4 * 8];
    for (int i = 0; i < 4 * 8; i++)
        wh[i] = 0x3f80; /* bf16 1.0 */
    tensor_t w;
    const int64_t shape[2] = {4, 8};
    CHECK(be->weight_load(be, &w, wh, DTYPE_BF16, 2, shape, &err) == AR_OK);
    float *x = be->alloc(be, 2 * 8 * sizeof(float)), *y = be->alloc(be, 2 * 4 * sizeof(float));
    cuda_emu_fault_launch_async(0, cudaErrorIllegalAddress);
    be->matmul(be, y, x, &w, NULL, 2);
    CHECK(backend_status(be, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "in op matmul: cublasGemmEx");
    be->destroy(be);
    cudaDeviceReset();
}

/* Any value but 0 or 1 is refused at creation, naming the variable. */
static void test_check_refuses_other_values(void) {
    ar_error_t err = {{0}};
    CHECK(create_with("yes", &err) == NULL);
    CHECK_STR_CONTAINS(err.msg, "ARSERVE_CUDA_CHECK=yes: expected 1");
    backend_t *be = create_with("0", &err);
    CHECK_MSG(be != NULL, "%s", err.msg);
    if (be)
        be->destroy(be);
}

int main(void) {
    TEST_RUN(test_without_check_a_fault_is_blamed_on_a_later_op);
    TEST_RUN(test_check_names_the_op_that_faulted);
    TEST_RUN(test_with_graphs_a_fault_surfaces_when_the_step_runs);
    TEST_RUN(test_a_device_without_graphs_runs_op_by_op);
    TEST_RUN(test_check_names_the_op_when_its_own_call_fails);
    TEST_RUN(test_check_refuses_other_values);
    return TEST_SUMMARY();
}
