/* The DCP comm of a TP rank (parallel/comm.h): either transport, the same group arithmetic. */
#include "parallel/comm.h"

#include <stdio.h>

int lunar_dcp_comm(lunar_comm *tp, int dcp, lunar_comm **out, lunar_err *err) {
    *out = NULL;
    if (dcp <= 1) return 0;
    if (tp->size % dcp != 0)
        return lunar_fail(err, "decode-context-parallel size %d does not divide the TP group's %d ranks", dcp, tp->size);
    if (dcp == tp->size) { /* the TP group is the one DCP group: its comm serves (no second comm's buffers) */
        *out = tp;
        return 0;
    }
    return lunar_comm_split(tp, lunar_dcp_group(tp->rank, dcp), lunar_dcp_group_rank(tp->rank, dcp), out, err);
}

void lunar_dcp_comm_free(lunar_comm *tp, lunar_comm *dcp) {
    if (dcp != tp) lunar_comm_free(dcp);
}

void lunar_dcp_layout(char *buf, size_t n, int tp, int dcp) {
    if (dcp <= 1 || tp % dcp != 0) {
        snprintf(buf, n, "none");
        return;
    }
    const int ng = tp / dcp;
    size_t k = (size_t)snprintf(buf, n, "%d group%s of %d consecutive ranks", ng, ng > 1 ? "s" : "", dcp);
    for (int g = 0; g < ng && k < n; g++) {
        if (ng > 4 && g == 3) { /* long lists: the first three, then the last */
            k += (size_t)snprintf(buf + k, n - k, " ..");
            g = ng - 1;
        }
        k += (size_t)snprintf(buf + k, n - k, dcp == 2 ? " [%d,%d]" : " [%d-%d]", g * dcp, g * dcp + dcp - 1);
    }
    if (k < n) snprintf(buf + k, n - k, "; TP rank r is DCP rank r %% %d", dcp);
}
