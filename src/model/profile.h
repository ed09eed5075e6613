/* Wall time per op family of the CPU forward (model/forward.c), for `lunar bench --profile`.
 * Off unless a profile is installed: then each marked region adds its elapsed time to its family.
 * The CPU backend is synchronous, so region times are the ops' own times and sum to the step
 * (less the untimed glue: residual adds, copies). Not thread-safe: one profiled forward at a time. */
#ifndef LUNAR_MODEL_PROFILE_H
#define LUNAR_MODEL_PROFILE_H

#include <stdint.h>
#include <time.h>

typedef enum lunar_prof_family {
    LUNAR_PROF_EMBED,      /* token embedding lookup */
    LUNAR_PROF_NORM,       /* pre-norms / AttnRes mixes feeding each sub-layer, final norm */
    LUNAR_PROF_KDA_PROJ,   /* KDA q/k/v projections + short convs, gate and beta projections */
    LUNAR_PROF_KDA_CORE,   /* KDA recurrence (decode) or chunked WY form (prefill) */
    LUNAR_PROF_KDA_OUT,    /* KDA output gate, gated RMSNorm, o_proj */
    LUNAR_PROF_MLA_PROJ,   /* MLA q / kv_a projections, latent norm, cache writes */
    LUNAR_PROF_DSA,        /* K3.1 indexer: projections, rotation, scoring and top-k */
    LUNAR_PROF_MLA_ATTN,   /* MLA attention core (absorbed / naive / sparse) */
    LUNAR_PROF_MLA_OUT,    /* MLA output gate and o_proj */
    LUNAR_PROF_ROUTER,     /* router logits and top-k */
    LUNAR_PROF_EXPERTS,    /* routed experts (gather, GLU MLPs, weighted scatter) */
    LUNAR_PROF_LATENT,     /* latent MoE down / norm / up projections (K3) */
    LUNAR_PROF_SHARED,     /* shared experts and dense MLP layers */
    LUNAR_PROF_LM_HEAD,    /* lm_head over the requested rows */
    LUNAR_PROF_MLA_ABSORB, /* CUDA only: q_nope -> latent and latent -> v through kv_b (the CPU's
                            * attention ops do it inside mla_attn) */
    LUNAR_PROF_N
} lunar_prof_family;

typedef struct lunar_profile {
    double seconds[LUNAR_PROF_N];
    int64_t calls[LUNAR_PROF_N];
} lunar_profile;

extern const char *const lunar_prof_names[LUNAR_PROF_N];

/* The profile regions of the forward accumulate into (NULL: profiling off). */
void lunar_profile_install(lunar_profile *p);
extern lunar_profile *lunar_prof_active;

static inline double lunar_prof_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A region: t0 = lunar_prof_begin(); ...; lunar_prof_end(LUNAR_PROF_X, t0); (regions never nest) */
static inline double lunar_prof_begin(void) { return lunar_prof_active ? lunar_prof_now() : 0.0; }
static inline void lunar_prof_end(lunar_prof_family f, double t0) {
    if (lunar_prof_active) {
        lunar_prof_active->seconds[f] += lunar_prof_now() - t0;
        lunar_prof_active->calls[f]++;
    }
}

/* PROF(f, statement): the same around one statement. */
#define PROF(f, ...)                                                                     \
    do {                                                                                 \
        const double prof_t0_ = lunar_prof_active ? lunar_prof_now() : 0.0;             \
        __VA_ARGS__;                                                                     \
        if (lunar_prof_active) {                                                         \
            lunar_prof_active->seconds[LUNAR_PROF_##f] += lunar_prof_now() - prof_t0_;   \
            lunar_prof_active->calls[LUNAR_PROF_##f]++;                                  \
        }                                                                                \
    } while (0)

#endif
