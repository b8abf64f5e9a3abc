/* libFuzzer target: bytes as a .safetensors file, through safetensors_open
 * (engine/format/safetensors.c, which maps a path: the input goes to a memfd), then
 * the tensor index: every tensor found by name, checked against its own shape,
 * its bytes inside the mapping and equal to its shape's size. Each input is
 * opened twice: as given, and with the 8-byte header length rewritten to end
 * at the header's last '}', so mutations inside the JSON keep a length that
 * fits them.
 * Build and run: make -f Makefile -f tests/fuzz/fuzz.mk fuzz (tests/fuzz/fuzz.mk). */
#include "engine/format/safetensors.h"
#include "tests/fuzz/fuzz.h"

static fuzz_file_t file;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_file_init(&file, "model.safetensors");
    return 0;
}

static void open_checked(const uint8_t *bytes, size_t size) {
    fuzz_file_write(&file, bytes, size);
    safetensors_t st;
    ar_error_t err = {{0}};
    if (safetensors_open(&st, file.path, &err) != AR_OK) {
        FUZZ_REQUIRE(strstr(err.msg, file.path) != NULL, "message does not name the file: %s",
                     err.msg);
        FUZZ_REQUIRE(st.map == NULL && st.tensors == NULL && st.n_tensors == 0,
                     "a failed open left state");
        return;
    }
    const unsigned char *lo = st.map, *hi = lo + st.map_size;
    size_t total = 0;
    for (int i = 0; i < st.n_tensors; i++) {
        const st_tensor_t *t = &st.tensors[i];
        FUZZ_REQUIRE(safetensors_find(&st, t->name) == t, "tensor %d not found by name", i);
        FUZZ_REQUIRE(i == 0 || strcmp(st.tensors[i - 1].name, t->name) < 0, "names not sorted");
        const st_tensor_t *got = NULL;
        FUZZ_REQUIRE(safetensors_get_any(&st, t->name, t->ndim, t->shape, &got, &err) == AR_OK &&
                         got == t,
                     "get_any with its own shape: %s", err.msg);
        uint64_t numel = 1;
        for (int d = 0; d < t->ndim; d++)
            numel *= (uint64_t)t->shape[d];
        FUZZ_REQUIRE(numel * dtype_size(t->dtype) == t->nbytes, "nbytes %zu", t->nbytes);
        FUZZ_REQUIRE((t->data == NULL) == (t->nbytes == 0), "data NULL iff empty");
        if (t->nbytes) {
            const unsigned char *p = t->data;
            FUZZ_REQUIRE(p >= lo + 8 && p + t->nbytes <= hi && p + t->nbytes > p,
                         "tensor %d outside the mapping", i);
            volatile unsigned char first = p[0], last = p[t->nbytes - 1];
            (void)first;
            (void)last;
        }
        total += t->nbytes;
    }
    FUZZ_REQUIRE(total <= st.map_size, "tensors hold %zu bytes of a %zu-byte file", total,
                 st.map_size);
    (void)safetensors_metadata(&st, "format");
    FUZZ_REQUIRE(safetensors_find(&st, "") == NULL, "a tensor with an empty name");
    safetensors_close(&st);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    open_checked(data, size);
    if (size <= 8)
        return 0;
    size_t end = size;
    while (end > 8 && data[end - 1] != '}')
        end--;
    if (end == 8)
        return 0;
    uint8_t *fixed = malloc(size);
    FUZZ_REQUIRE(fixed, "out of memory");
    memcpy(fixed, data, size);
    uint64_t n = end - 8;
    for (int i = 0; i < 8; i++)
        fixed[i] = (uint8_t)(n >> 8 * i);
    if (memcmp(fixed, data, 8) != 0)
        open_checked(fixed, size);
    free(fixed);
    return 0;
}
