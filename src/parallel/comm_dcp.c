/* The DCP comm of a TP rank (parallel/comm.h): either transport, the same group arithmetic. */
#include "parallel/comm.h"

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
