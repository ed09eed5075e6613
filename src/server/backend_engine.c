/* The real engine behind the server's backend table (compiled only when src/engine/engine.c exists). */
#include <string.h>

#include "server/backend.h"

int lunar_srv_have_engine(void) { return 1; }

void lunar_srv_engine_options_default(lunar_engine_options *o) { lunar_engine_options_default(o); }

static int submit(void *ctx, const lunar_request *r, uint64_t *id, lunar_err *err) {
    return lunar_engine_submit(ctx, r, id, err);
}
static void cancel(void *ctx, uint64_t id) { lunar_engine_cancel(ctx, id); }
static void metrics(void *ctx, lunar_engine_metrics *m) { lunar_engine_metrics_get(ctx, m); }
static void destroy(void *ctx) { lunar_engine_destroy(ctx); }

int lunar_srv_backend_engine(lunar_srv_backend *b, const lunar_engine_options *o, lunar_err *err) {
    memset(b, 0, sizeof *b);
    lunar_engine *e;
    if (lunar_engine_create(&e, o, err)) return -1;
    *b = (lunar_srv_backend){.ctx = e, .submit = submit, .cancel = cancel, .metrics = metrics, .destroy = destroy};
    return 0;
}
