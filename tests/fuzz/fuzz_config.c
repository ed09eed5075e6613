/* libFuzzer target: any byte string must parse as a config or fail cleanly; a parsed config
 * must satisfy the invariants the engine relies on.
 * Run (new inputs go to the scratch dir, the committed corpus stays small):
 *   build/fuzz_config -max_total_time=60 -dict=tests/fuzz/config.dict /tmp/cf tests/corpus/config */
#include <stdint.h>
#include <string.h>

#include "io/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    lunar_config c;
    lunar_err err;
    if (lunar_config_parse(&c, (const char *)data, size, "fuzz.json", &err) != 0) {
        if (!strstr(err.msg, "fuzz.json")) __builtin_trap();
        return 0;
    }
    if (c.num_hidden_layers < 1 || c.num_hidden_layers > LUNAR_MAX_LAYERS) __builtin_trap();
    if (c.n_kda_layers + c.n_mla_layers != c.num_hidden_layers) __builtin_trap();
    if (c.hidden_size < 1 || c.vocab_size < 1 || c.kda_num_heads < 1 || c.moe_layer_freq < 1) __builtin_trap();
    if (c.num_experts > 0 && c.num_experts_per_token > c.num_experts) __builtin_trap();
    return 0;
}
