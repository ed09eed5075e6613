/* Token sampling from one row of logits: greedy, temperature, top-k, top-p, seeded.
 * Order (as vLLM): temperature scaling, then top-k, then top-p over the renormalised survivors,
 * then one draw from the request's own random stream, so a seed reproduces a generation. */
#ifndef LUNAR_ENGINE_SAMPLER_H
#define LUNAR_ENGINE_SAMPLER_H

#include <stdint.h>

typedef struct lunar_sampling {
    float temperature; /* <= 0: greedy (argmax, ties to the lower id) */
    int top_k;         /* <= 0: off */
    float top_p;       /* >= 1: off */
    uint64_t seed;
} lunar_sampling;

typedef struct lunar_rng {
    uint64_t s[4]; /* xoshiro256** state */
} lunar_rng;

void lunar_rng_seed(lunar_rng *rng, uint64_t seed);
uint64_t lunar_rng_next(lunar_rng *rng);
/* Uniform in [0, 1) with 24 bits of precision. */
float lunar_rng_uniform(lunar_rng *rng);

/* Returns the chosen token id. scratch: at least 2*vocab floats' worth of space
 * (NULL: allocated internally). logits are not modified. */
int lunar_sample(const float *logits, int vocab, const lunar_sampling *s, lunar_rng *rng,
                 void *scratch);

#endif
