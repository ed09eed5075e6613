/* The stand-in for backend_engine.c in builds without src/engine/engine.c (the Makefile picks one). */
#include <string.h>

#include "server/backend.h"

int lunar_srv_have_engine(void) { return 0; }

void lunar_srv_engine_options_default(lunar_engine_options *o) {
    memset(o, 0, sizeof *o);
    o->backend = "auto";
    o->max_num_seqs = 64;
    o->max_num_batched_tokens = 2048;
    o->max_model_len = 8192;
    o->gpu_memory_utilization = 0.9;
    o->kv_cache_dtype = "auto";
    o->enable_prefix_caching = 1;
    o->prefix_checkpoint_blocks = 1;
}

int lunar_srv_backend_engine(lunar_srv_backend *b, const lunar_engine_options *o, lunar_err *err) {
    (void)o;
    memset(b, 0, sizeof *b);
    return lunar_fail(err, "this build has no engine (src/engine/engine.c); use --fake-engine to test the server");
}
