/* CPU reference: sigmoid MoE router with selection bias and group-limited top-k, as HF
 * KimiLinearTopkRouter (DeepSeek-V3 style). Ties go to the lower index everywhere (torch.topk
 * leaves tie order unspecified; this is the deterministic choice). */
#include <math.h>
#include <stdlib.h>

#include "base/err.h"
#include "ops.h"

/* Index of the best eligible entry of v[0..n) (highest value, lower index on ties), or -1. */
static int argmax_eligible(const float *v, const unsigned char *ok, int n) {
    int best = -1;
    for (int i = 0; i < n; i++)
        if (ok[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* Per token:
 *   s      = sigmoid(logits)                 the weights come from s
 *   choice = s + bias                        selection only
 *   group score = sum of the two best choice scores of the group (HF: topk(2).sum); the
 *   topk_group best groups are eligible (n_group <= 1: one group, everything eligible);
 *   experts = the k best eligible by choice, in decreasing order
 *   weights = s[experts] / (sum + 1e-20) if renorm, then * scale. */
void op_router_topk(int32_t *experts, float *weights, const float *logits, const lunar_tensor *bias,
                    int n, int E, int k, int n_group, int topk_group, int renorm, float scale) {
    if (n_group < 1) n_group = 1;
    LUNAR_ASSERT(E % n_group == 0 && k >= 1);
    const int gs = E / n_group;
    if (n_group > 1) LUNAR_ASSERT(topk_group >= 1 && topk_group <= n_group && k <= topk_group * gs);
    else LUNAR_ASSERT(k <= E);
    float *b = NULL;
    if (bias) {
        LUNAR_ASSERT(lunar_tensor_numel(bias) == E);
        b = lunar_xmalloc((size_t)E * sizeof(float));
        lunar_tensor_read_f32(bias, 0, E, b);
    }
    float *s = lunar_xmalloc((size_t)E * sizeof(float));
    float *choice = lunar_xmalloc((size_t)E * sizeof(float));
    float *gscore = lunar_xmalloc((size_t)n_group * sizeof(float));
    unsigned char *ok = lunar_xmalloc((size_t)(E > n_group ? E : n_group));
    unsigned char *gok = lunar_xmalloc((size_t)n_group);

    for (int t = 0; t < n; t++) {
        const float *lg = logits + (size_t)t * E;
        for (int e = 0; e < E; e++) {
            s[e] = 1.0f / (1.0f + expf(-lg[e]));
            choice[e] = s[e] + (b ? b[e] : 0.0f);
            /* a NaN logit (an overflowed activation) ranks last but stays a valid choice: the
             * selection is total and every expert index it returns is in range */
            if (isnan(choice[e])) choice[e] = -INFINITY;
        }
        for (int e = 0; e < E; e++) ok[e] = 1;
        if (n_group > 1) {
            for (int gi = 0; gi < n_group; gi++) { /* top-2 sum of the group */
                const float *cg = choice + (size_t)gi * gs;
                float m1 = -INFINITY, m2 = -INFINITY;
                for (int e = 0; e < gs; e++) {
                    if (cg[e] > m1) m2 = m1, m1 = cg[e];
                    else if (cg[e] > m2) m2 = cg[e];
                }
                gscore[gi] = gs >= 2 ? m1 + m2 : m1;
            }
            for (int gi = 0; gi < n_group; gi++) ok[gi] = 1, gok[gi] = 0;
            for (int sel = 0; sel < topk_group; sel++) {
                int gi = argmax_eligible(gscore, ok, n_group);
                gok[gi] = 1, ok[gi] = 0;
            }
            for (int e = 0; e < E; e++) ok[e] = gok[e / gs];
        }
        int32_t *ex = experts + (size_t)t * k;
        float *w = weights + (size_t)t * k;
        float sum = 0.0f;
        for (int sel = 0; sel < k; sel++) {
            int e = argmax_eligible(choice, ok, E);
            LUNAR_ASSERT(e >= 0);
            ok[e] = 0;
            ex[sel] = e;
            w[sel] = s[e];
            sum += s[e];
        }
        if (renorm)
            for (int sel = 0; sel < k; sel++) w[sel] /= sum + 1e-20f;
        for (int sel = 0; sel < k; sel++) w[sel] *= scale;
    }
    free(b);
    free(s);
    free(choice);
    free(gscore);
    free(ok);
    free(gok);
}
