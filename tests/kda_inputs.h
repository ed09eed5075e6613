/* Realistic KDA inputs for the op tests of both backends (test_ops_kda.c, test_cuda_ops.c). */
#ifndef LUNAR_TESTS_KDA_INPUTS_H
#define LUNAR_TESTS_KDA_INPUTS_H

#include <math.h>
#include <stdlib.h>

#include "ops.h"
#include "ops_util.h"

typedef struct kda_inputs {
    int T, H, dk, dv;
    float *q, *k, *v, *g, *beta, *S0;
} kda_inputs;

/* Realistic inputs: q, k L2-normalised (eps 1e-6, as the model does), g from op_kda_gate on random
 * projections (unbounded or lower-bounded), beta = sigmoid(random), a nonzero initial state. */
static inline kda_inputs kda_make(int T, int H, int dk, int dv, float lower_bound, unsigned seed) {
    kda_inputs in = {T, H, dk, dv, 0, 0, 0, 0, 0, 0};
    long nq = (long)T * H * dk;
    in.q = test_rand(nq, seed, -1, 1);
    in.k = test_rand(nq, seed + 1, -1, 1);
    op_l2norm(in.q, in.q, T * H, dk, 1e-6f);
    op_l2norm(in.k, in.k, T * H, dk, 1e-6f);
    in.v = test_rand((long)T * H * dv, seed + 2, -1, 1);
    float *f = test_rand(nq, seed + 3, -4, 2), *alog = test_rand(H, seed + 4, -2, 1);
    float *dtb = test_rand(H * dk, seed + 5, -1, 1);
    lunar_tensor A = test_tensor1(LUNAR_DTYPE_F32, H, alog), B = test_tensor1(LUNAR_DTYPE_F32, H * dk, dtb);
    in.g = test_alloc(nq);
    op_kda_gate(in.g, f, &A, &B, T, H, dk, lower_bound);
    in.beta = test_rand((long)T * H, seed + 6, -3, 3);
    for (long i = 0; i < (long)T * H; i++) in.beta[i] = 1.0f / (1.0f + expf(-in.beta[i]));
    in.S0 = test_rand((long)H * dk * dv, seed + 7, -0.5f, 0.5f);
    test_tensor_free(&A), test_tensor_free(&B);
    free(f), free(alog), free(dtb);
    return in;
}

static inline void kda_free(kda_inputs *in) {
    free(in->q), free(in->k), free(in->v), free(in->g), free(in->beta), free(in->S0);
}

#endif
