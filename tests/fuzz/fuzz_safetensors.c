/* libFuzzer target: any byte string must parse or fail cleanly; a parsed result must be
 * self-consistent (every tensor inside the buffer, findable by name).
 * Run (new inputs go to the scratch dir, the committed corpus stays small):
 *   build/fuzz_safetensors -max_total_time=60 -dict=tests/fuzz/safetensors.dict /tmp/st tests/corpus/safetensors */
#include <stdint.h>
#include <string.h>

#include "io/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    lunar_st *st = NULL;
    lunar_err err;
    if (lunar_st_parse_buffer(&st, data, size, "fuzz.safetensors", &err) != 0) {
        if (!strstr(err.msg, "fuzz.safetensors")) __builtin_trap();
        return 0;
    }
    for (size_t i = 0; i < lunar_st_count(st); i++) {
        const lunar_tensor *t = lunar_st_at(st, i);
        const uint8_t *p = t->data;
        if (p < data || p + t->nbytes > data + size) __builtin_trap();
        if (lunar_st_find(st, t->name) != t) __builtin_trap();
        if (lunar_tensor_numel(t) * (int64_t)lunar_dtype_size(t->dtype) != (int64_t)t->nbytes) __builtin_trap();
        volatile uint8_t sum = 0; /* touch the bytes so ASan checks the range */
        for (size_t b = 0; b < t->nbytes; b++) sum += p[b];
    }
    lunar_st_metadata(st, "format");
    lunar_st_close(st);
    return 0;
}
