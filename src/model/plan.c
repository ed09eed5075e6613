/* The memory planner. What is counted and why:
 *
 * STORAGE DTYPES. Every tensor is counted in the dtype the published checkpoint stores it in:
 *   - routed experts (compressed-tensors MXFP4): .weight_packed [out, in/2] + .weight_scale [out, in/32],
 *     one byte each (E2M1 pairs; E8M0 scales);
 *   - F32: KDA A_log (K3: 128 values, 96 real, SPEC 3), dt_bias, q/k/v_conv1d, o_norm, and the router's
 *     e_score_correction_bias;
 *   - BF16: everything else (projections, norms, embedding, lm_head, the vision tower, the draft).
 *   The F32 set is an assumption (k3_spec open question 2: the index carries no dtypes). It is the one
 *   that makes the real Kimi-K3 index's metadata.total_size, 1,560,860,324,864 bytes, come out to the
 *   byte (text model + the 447,358,976-parameter BF16 vision tower): with only A_log, dt_bias and the
 *   router bias in F32 the count is 20,366,592 bytes short, exactly 69 KDA layers x (3 convs x 12288 x 4
 *   + o_norm 128) x 2 more bytes -- the parameters vLLM keeps in fp32. (test_plan pins it.)
 *
 * TENSOR PARALLELISM, as ATOM's kimi_k3.py / kimi_k3_dspark.py and vLLM lay K3 out (k3_spec 2,
 * dspark_vl_api_spec 1.10):
 *   - embedding and lm_head: vocab-parallel (VocabParallelEmbedding / ParallelLMHead), rows / tp;
 *   - KDA: heads split. q/k/v/g (in_proj), b_proj, f_b_proj, the convs, A_log, dt_bias are
 *     column-parallel; o_proj row-parallel. f_a_proj (rank-128 down projection, input of every head)
 *     and o_norm (shared by all heads) are replicated -- ATOM: ReplicatedLinear / one RMSNorm;
 *   - MLA: heads split. q_b_proj, kv_b_proj, g_proj column-parallel, o_proj row-parallel. q_a_proj and
 *     kv_a_proj_with_mqa (fused_qkv_a_proj, MergedReplicatedLinear) and their norms are replicated:
 *     every rank needs the whole 1536-wide query latent and the 576-wide KV latent it caches;
 *   - DSA indexer (K3.1): replicated. It scores one shared top-k per token for all heads; DeepSeek's
 *     reference and vLLM's Indexer run it unsplit on every rank (dsa_mla_mxfp4 1.2);
 *   - dense MLP and shared experts: gate/up column-, down row-parallel;
 *   - routed experts: TP on the intermediate dim (3072 / tp per rank, all 896 experts on every rank;
 *     ATOM FusedMoE, "inter=3072/TP8=384"), MXFP4 scales split with their rows (w1/w3) or groups (w2);
 *   - router (gate.weight + e_score_correction_bias): replicated (ATOM ReplicatedLinear): every rank
 *     routes every token;
 *   - latent MoE projections routed_expert_{down,up}_proj + routed_expert_norm: replicated (ATOM
 *     ReplicatedLinear): the experts all-reduce their partial sums before the (nonlinear) norm, so the
 *     latent entering and leaving them is full width on every rank. ATOM re-quantises the two
 *     projections to MXFP4 at load; lunar keeps BF16 (k3_spec 2.2) unless opts.latent_moe_mxfp4;
 *   - norms and AttnRes pseudo-queries: replicated (tiny);
 *   - vision tower + projector: replicated (recipes/Kimi-K3.md:75);
 *   - DSpark draft: q_b/kv_b/gate/up column-, o_proj/down row-parallel (heads split like the target's
 *     MLA); context_proj, fused q_a/kv_a, norms and the Markov tables replicated (ATOM: the taps arrive
 *     replicated, the Markov bias is added to full-vocab logits). Its embedding and lm_head are the
 *     target's and are not loaded; nor is the training-only confidence head.
 *
 * CACHES (per GPU):
 *   - MLA latent: one [c(512) | kpe(64)] row per token per MLA layer, FP8 e4m3 with a per-tensor scale
 *     (576 B) or BF16 (1152 B). MLA has a single latent "KV head", so every TP rank holds every row;
 *     decode context parallelism (dcp) shards tokens round-robin over dcp ranks. The draft's five
 *     layers add five rows in the same pool (SPEC 1.2), same dtype.
 *   - DSA index keys: one 128-dim key per token per MLA layer: FP8 128 B + fp32 scale = 132 B, or MXFP4
 *     64 B + 4 E8M0 = 68 B. Replicated with the indexer; sharded by dcp with the latent rows they sit
 *     beside (same block tables).
 *   - KDA state per request per KDA layer: recurrent H/tp x dk x dk (fp32, or fp16), conv (K-1) x 3·H·dk/tp
 *     bf16. With a draft of T drafts each request owns 1 + T recurrent slots (one per verified position,
 *     rollback = choosing a slot) and the conv window grows to (K-1) + T rows (dspark 1.9).
 *   Blocks are 128 tokens: max-model-len is rounded up to a whole block.
 *
 * ACTIVATION WORKSPACE (an estimate; the peak of one forward, bf16 activations):
 *   ws = B x (stream + widest) x 2 B  +  R x V x 4 B  +  R x max_model_len x 4 B (indexer only)
 *   B = max-num-batched-tokens (one prefill chunk), R = max-num-seqs x (1 + num_spec) decode rows;
 *   stream = the per-token residual state: AttnRes keeps every banked block (ceil(L/S) + 1 of them,
 *            9 for K3) plus the running partial sum, i.e. (ceil(L/S) + 2) x D; without AttnRes 2 x D;
 *   widest = the largest per-rank intermediate of one layer:
 *            KDA: [q|k|v|g|b|f_a] 4·H·dk/tp + H/tp + dk, conv out 3·H·dk/tp, f_b out and core out 2·H·dk/tp
 *            MLA (prefill, MHA form): q_lora + kv_lora + rope + nh/tp x (qk + nope + 3·v) (+ indexer q
 *                 n_idx x d_idx + scores n_idx)
 *            MoE: D_e + top_k x (2·D_e + 2·I/tp) + 2·I_shared/tp + 2·D (permuted inputs, gate|up,
 *                 expert outputs, shared gate|up, routed + shared sums)
 *            dense: 3·I/tp;
 *   R x V x 4: fp32 logits, gathered to the full vocabulary; R x max_model_len x 4: the indexer's decode
 *   scores over the whole context (DeepGEMM fp8_paged_mqa_logits writes [rows, max_model_len] fp32).
 *   Not counted: CUDA context, NCCL buffers, graphs -- the (1 - utilisation) headroom is for those, as
 *   in vLLM. Prefill index scores are assumed chunked into the same workspace. */
#include "model/plan.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "parallel/comm.h"

#define GB 1e9
#define BLOCK_TOKENS 128

void lunar_plan_opts_default(lunar_plan_opts *o) {
    memset(o, 0, sizeof *o);
    o->tp = 1;
    o->dcp = 1;
    o->kv_dtype = LUNAR_CACHE_FP8;
    o->index_dtype = LUNAR_CACHE_FP8;
    o->state_dtype = LUNAR_CACHE_FP32;
    o->max_model_len = 1048576;
    o->max_num_seqs = 256;
    o->max_num_batched_tokens = 8192;
    o->gpu_memory_gb = 141;
    o->gpu_util = 0.9;
}

const char *lunar_wkind_name(lunar_wkind k) {
    static const char *names[LUNAR_W_COUNT] = {
        "embedding", "lm_head", "KDA attention", "MLA attention", "DSA indexer", "dense MLP",
        "shared experts", "routed experts", "routers", "latent MoE proj", "norms + AttnRes",
        "vision tower", "DSpark draft"};
    return k < LUNAR_W_COUNT ? names[k] : "?";
}

/* How each kind is laid out under TP, for the printout. */
static const char *wkind_split(lunar_wkind k) {
    static const char *s[LUNAR_W_COUNT] = {
        "vocab rows / tp",
        "vocab rows / tp",
        "heads / tp; f_a_proj, o_norm replicated",
        "heads / tp; q_a, kv_a (+norms) replicated",
        "replicated",
        "intermediate / tp",
        "intermediate / tp",
        "intermediate / tp (all experts per rank)",
        "replicated",
        "replicated",
        "replicated",
        "replicated",
        "heads, MLP / tp; context_proj, q_a/kv_a, Markov replicated"};
    return k < LUNAR_W_COUNT ? s[k] : "?";
}

const char *lunar_cache_dtype_name(lunar_cache_dtype d) {
    switch (d) {
    case LUNAR_CACHE_BF16: return "bf16";
    case LUNAR_CACHE_FP8: return "fp8";
    case LUNAR_CACHE_MXFP4: return "mxfp4";
    case LUNAR_CACHE_FP32: return "fp32";
    case LUNAR_CACHE_FP16: return "fp16";
    }
    return "?";
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* ---- weights ------------------------------------------------------------------------------ */

typedef struct acc {
    const lunar_config *cfg;
    const lunar_plan_opts *o;
    lunar_plan *p;
} acc;

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

static void add(lunar_plan *p, int tp, lunar_wkind k, lunar_sdtype dt, int64_t params, int64_t bytes,
                int replicated) {
    lunar_plan_row *r = &p->w[k];
    r->params += params;
    r->bytes[dt] += bytes;
    r->total_bytes += bytes;
    int64_t g = replicated ? bytes : ceil_div(bytes, tp);
    r->gpu_bytes += g;
    if (replicated) r->gpu_replicated += g;
}

/* One tensor of the target's text model, as the walk names it. */
static void visit_target(void *ctx, const char *name, int ndim, const int64_t *shape) {
    acc *a = ctx;
    const lunar_config *c = a->cfg;
    int64_t numel = 1;
    for (int i = 0; i < ndim; i++) numel *= shape[i];

    const char *lp = strstr(name, "layers.");
    int layer = lp ? atoi(lp + 7) : -1;
    int kda = layer >= 0 && layer < c->num_hidden_layers && c->attn_kind[layer] == LUNAR_ATTN_KDA;

    lunar_sdtype dt = LUNAR_SD_BF16;
    int64_t params = numel, bytes;
    lunar_wkind k;
    int repl = 0;

    if (ends_with(name, ".weight_packed") || ends_with(name, ".weight_scale")) {
        dt = LUNAR_SD_U8;
        k = LUNAR_W_ROUTED;
        /* the walk shapes are the stored ones; count logical params on the packed half only */
        params = ends_with(name, ".weight_packed") ? numel * 2 : 0;
    } else if (strstr(name, "embed_tokens.")) {
        k = LUNAR_W_EMBED;
    } else if (strstr(name, "lm_head.")) {
        k = LUNAR_W_LM_HEAD;
    } else if (strstr(name, ".experts.")) {
        k = LUNAR_W_ROUTED;
    } else if (strstr(name, ".block_sparse_moe.gate.")) {
        k = LUNAR_W_ROUTER;
        repl = 1;
        if (ends_with(name, "e_score_correction_bias")) dt = LUNAR_SD_F32;
    } else if (strstr(name, ".routed_expert_")) {
        k = LUNAR_W_LATENT;
        repl = 1;
    } else if (strstr(name, ".shared_experts.")) {
        k = LUNAR_W_SHARED;
    } else if (strstr(name, ".mlp.")) {
        k = LUNAR_W_DENSE_MLP;
    } else if (strstr(name, ".self_attn.indexer.")) {
        k = LUNAR_W_INDEXER;
        repl = 1;
    } else if (strstr(name, ".self_attn.")) {
        k = kda ? LUNAR_W_KDA : LUNAR_W_MLA;
        if (kda) {
            if (ends_with(name, "A_log")) {
                dt = LUNAR_SD_F32;
                /* K3 stores the 96 per-head values padded to 128 (SPEC 3); the rest exactly */
                if (c->arch == LUNAR_ARCH_KIMI_K3) numel = (numel + 127) / 128 * 128;
            } else if (ends_with(name, "dt_bias") || ends_with(name, "_conv1d.weight") ||
                       ends_with(name, "o_norm.weight")) {
                dt = LUNAR_SD_F32;
            }
            repl = ends_with(name, "f_a_proj.weight") || ends_with(name, "g_a_proj.weight") ||
                   ends_with(name, "o_norm.weight");
        } else {
            repl = strstr(name, ".q_a_proj.") || strstr(name, ".q_a_layernorm.") ||
                   strstr(name, ".kv_a_proj_with_mqa.") || strstr(name, ".kv_a_layernorm.");
        }
    } else {
        k = LUNAR_W_NORMS; /* layer norms, AttnRes proj/norm, final norms */
        repl = 1;
    }
    if (k == LUNAR_W_NORMS || (k == LUNAR_W_MLA && strstr(name, "layernorm"))) repl = 1;

    bytes = dt == LUNAR_SD_U8 ? numel : numel * (dt == LUNAR_SD_F32 ? 4 : 2);
    if (k == LUNAR_W_LATENT && a->o->latent_moe_mxfp4 && ndim == 2) {
        /* ATOM's load-time re-quantisation: 4-bit codes + one E8M0 per 32 inputs */
        dt = LUNAR_SD_U8;
        bytes = numel / 2 + numel / 32;
    }
    add(a->p, a->o->tp, k, dt, params, bytes, repl);
}

int64_t lunar_vision_params_load(const char *path, lunar_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return lunar_fail(err, "%s: cannot open: %s", path, strerror(errno));
    json_error_t je;
    json_t *root = json_loadf(f, 0, &je);
    fclose(f);
    if (!root) return lunar_fail(err, "%s: not valid JSON: %s (line %d)", path, je.text, je.line);
    json_t *v = json_object_get(root, "vision_config");
    int64_t n = 0;
    if (json_is_object(v)) {
        const char *keys[] = {"vt_hidden_size", "qkv_hidden_size", "vt_intermediate_size",
                              "vt_num_hidden_layers", "patch_size", "init_pos_emb_height",
                              "init_pos_emb_width", "mm_hidden_size", "text_hidden_size"};
        int64_t x[9];
        for (int i = 0; i < 9; i++) {
            json_t *e = json_object_get(v, keys[i]);
            if (!json_is_integer(e) || json_integer_value(e) <= 0) {
                json_decref(root);
                return lunar_fail(err, "%s: key 'vision_config.%s': expected a positive integer", path,
                                  keys[i]);
            }
            x[i] = json_integer_value(e);
        }
        int64_t merge = 1;
        json_t *mk = json_object_get(v, "merge_kernel_size");
        size_t i;
        json_t *e;
        json_array_foreach(mk, i, e) merge *= json_is_integer(e) ? json_integer_value(e) : 1;
        const int64_t h = x[0], q = x[1], I = x[2], L = x[3], P = x[4], mm = x[7] * merge, t = x[8];
        /* MoonViT3d (dspark_vl_api_spec 4.3-4.5): patch conv 3·P·P -> h, pos_emb H0 x W0 x h; per block
         * norm0, norm1, wqkv [3q, h], wo [h, q], fc0 [I, h], fc1 [h, I]; final norm; patchmergerv2
         * projector [mm, mm], [t, mm], post_norm [t]. No biases. */
        n = 3 * P * P * h + x[5] * x[6] * h + L * (2 * h + 3 * q * h + h * q + 2 * h * I) + h +
            mm * mm + t * mm + t;
    }
    json_decref(root);
    return n;
}

/* The draft's loaded tensors (dspark_vl_api_spec 1.1 table), all BF16. */
static int64_t draft_walk(const lunar_draft_config *d, lunar_plan *p, int tp) {
    const int64_t D = d->hidden_size, nh = d->num_attention_heads, Q = d->q_lora_rank,
                  R = d->kv_lora_rank, P = d->qk_rope_head_dim, qk = d->qk_nope_head_dim + P,
                  Vd = d->v_head_dim, N = d->qk_nope_head_dim, I = d->intermediate_size;
    int64_t repl = D * d->target_hidden_size * d->n_taps + 2 * D; /* context_proj, context/final norm */
    repl += 2 * (int64_t)d->vocab_size * d->markov_rank;           /* markov_w1, markov_w2 */
    int64_t shard = 0;
    for (int l = 0; l < d->num_hidden_layers; l++) {
        repl += 2 * D + (Q + R + P) * D + Q + R; /* layer norms, q_a + kv_a, their norms */
        shard += nh * qk * Q + nh * (N + Vd) * R + D * nh * Vd + 3 * I * D;
    }
    if (p) {
        add(p, tp, LUNAR_W_DRAFT, LUNAR_SD_BF16, repl, repl * 2, 1);
        add(p, tp, LUNAR_W_DRAFT, LUNAR_SD_BF16, shard, shard * 2, 0);
    }
    return repl + shard;
}

int64_t lunar_draft_count_params(const lunar_draft_config *d) { return draft_walk(d, NULL, 1); }

/* ---- the plan ----------------------------------------------------------------------------- */

static int check_div(const char *opt, int v, const char *what, int64_t n, lunar_err *err) {
    if (n % v != 0)
        return lunar_fail(err, "%s %d: %s = %" PRId64 " is not divisible by it", opt, v, what, n);
    return 0;
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

int lunar_plan_compute(lunar_plan *p, const lunar_config *c, int64_t vision_params,
                       const lunar_draft_config *d, const lunar_plan_opts *o, lunar_err *err) {
    memset(p, 0, sizeof *p);
    p->opts = *o;
    const int tp = o->tp, dcp = o->dcp;
    if (tp < 1) return lunar_fail(err, "--tp %d: must be at least 1", tp);
    if (dcp < 1 || tp % dcp != 0)
        return lunar_fail(err, "--dcp %d: must divide --tp %d (decode context parallelism shards the KV "
                          "pool inside the TP group)", dcp, tp);
    if (check_div("--tp", tp, "vocab_size", c->vocab_size, err) ||
        (c->n_mla_layers && check_div("--tp", tp, "num_attention_heads", c->num_attention_heads, err)) ||
        (c->n_kda_layers && check_div("--tp", tp, "linear_attn_config.num_heads", c->kda_num_heads, err)) ||
        (c->num_experts && check_div("--tp", tp, "moe_intermediate_size", c->moe_intermediate_size, err)) ||
        check_div("--tp", tp, "intermediate_size", c->intermediate_size, err))
        return -1;
    if (c->experts_mxfp4 && (c->moe_intermediate_size / tp) % 32 != 0)
        return lunar_fail(err, "--tp %d: moe_intermediate_size / tp = %d is not a whole number of MXFP4 "
                          "scale groups (32)", tp, c->moe_intermediate_size / tp);
    if (d && (check_div("--tp", tp, "the draft's num_attention_heads", d->num_attention_heads, err) ||
              check_div("--tp", tp, "the draft's intermediate_size", d->intermediate_size, err)))
        return -1;
    if (d && d->vocab_size != c->vocab_size)
        return lunar_fail(err, "--draft: vocab_size %d differs from the target's %d (the draft shares "
                          "the target's embedding and lm_head)", d->vocab_size, c->vocab_size);
    if (d && d->kv_lora_rank + d->qk_rope_head_dim != c->kv_lora_rank + c->qk_rope_head_dim)
        return lunar_fail(err, "--draft: latent width %d differs from the target's %d (its rows live in "
                          "the target's MLA pool)", d->kv_lora_rank + d->qk_rope_head_dim,
                          c->kv_lora_rank + c->qk_rope_head_dim);
    if (o->kv_dtype != LUNAR_CACHE_FP8 && o->kv_dtype != LUNAR_CACHE_BF16)
        return lunar_fail(err, "--kv-cache-dtype: expected fp8 or bf16");
    if (o->index_dtype != LUNAR_CACHE_FP8 && o->index_dtype != LUNAR_CACHE_MXFP4)
        return lunar_fail(err, "--index-cache-dtype: expected fp8 or mxfp4");
    if (o->state_dtype != LUNAR_CACHE_FP32 && o->state_dtype != LUNAR_CACHE_FP16)
        return lunar_fail(err, "--kda-state-dtype: expected fp32 or fp16");
    if (o->max_model_len < 1) return lunar_fail(err, "--max-model-len: must be at least 1");
    if (o->max_num_seqs < 1) return lunar_fail(err, "--max-num-seqs: must be at least 1");
    if (o->max_num_batched_tokens < 1) return lunar_fail(err, "--max-num-batched-tokens: must be at least 1");
    if (!(o->gpu_memory_gb > 0)) return lunar_fail(err, "--gpu-memory: must be positive");
    if (!(o->gpu_util > 0 && o->gpu_util <= 1))
        return lunar_fail(err, "--gpu-memory-utilization: must be in (0, 1]");

    /* weights */
    acc a = {c, o, p};
    lunar_config_walk_tensors(c, visit_target, &a);
    if (vision_params > 0) add(p, tp, LUNAR_W_VISION, LUNAR_SD_BF16, vision_params, vision_params * 2, 1);
    for (int k = 0; k < LUNAR_W_COUNT; k++) p->checkpoint_bytes += p->w[k].total_bytes;
    if (o->latent_moe_mxfp4) { /* report the checkpoint as stored, not as re-quantised */
        int64_t lat = 0;
        for (int l = 0; l < c->num_hidden_layers; l++)
            if (c->ffn_kind[l] == LUNAR_FFN_MOE) lat += 2 * (int64_t)c->routed_expert_hidden_size * c->hidden_size;
        p->checkpoint_bytes += lat * 2 - (lat / 2 + lat / 32);
    }
    lunar_param_counts pc;
    lunar_config_count_params(c, &pc);
    p->params_total = pc.total;
    p->params_active = pc.active;
    if (d) {
        p->has_draft = 1;
        p->num_spec = d->block_size;
        draft_walk(d, p, tp);
        p->draft_bytes = p->w[LUNAR_W_DRAFT].total_bytes;
    }
    for (int k = 0; k < LUNAR_W_COUNT; k++) p->weights_gpu += p->w[k].gpu_bytes;

    /* caches */
    const int64_t latent_w = c->kv_lora_rank + c->qk_rope_head_dim;
    p->latent_row_bytes = (int)(latent_w * (o->kv_dtype == LUNAR_CACHE_FP8 ? 1 : 2));
    p->n_latent_rows = c->n_mla_layers + (d ? d->num_hidden_layers : 0);
    if (c->index_topk > 0) {
        const int di = c->index_head_dim;
        p->index_row_bytes = o->index_dtype == LUNAR_CACHE_FP8 ? di + 4 : di / 2 + di / 32;
        p->n_index_rows = c->n_mla_layers;
    }
    p->kv_bytes_per_token = (int64_t)p->n_latent_rows * p->latent_row_bytes +
                            (int64_t)p->n_index_rows * p->index_row_bytes;
    p->state_slots = 1 + p->num_spec;
    const int64_t Hl = c->kda_num_heads / tp, dk = c->kda_head_dim;
    const int sb = o->state_dtype == LUNAR_CACHE_FP32 ? 4 : 2;
    p->kda_ssm_bytes = (int64_t)c->n_kda_layers * Hl * dk * dk * sb * p->state_slots;
    p->kda_conv_bytes = (int64_t)c->n_kda_layers * (c->kda_conv_size - 1 + p->num_spec) * 3 * Hl * dk * 2;
    p->kda_state_bytes = p->kda_ssm_bytes + p->kda_conv_bytes;

    /* workspace */
    const int64_t D = c->hidden_size, B = o->max_num_batched_tokens;
    int64_t stream = 2 * D;
    if (c->attn_res_block_size > 0)
        stream = (ceil_div(c->num_hidden_layers, c->attn_res_block_size) + 2) * D;
    int64_t widest = 0;
    if (c->n_kda_layers) widest = max64(widest, 9 * Hl * dk + Hl + dk);
    if (c->n_mla_layers) {
        const int64_t nhl = c->num_attention_heads / tp;
        int64_t mla = c->q_lora_rank + latent_w +
                      nhl * (c->qk_nope_head_dim + c->qk_rope_head_dim + c->qk_nope_head_dim + 3 * c->v_head_dim);
        if (c->index_topk > 0) mla += (int64_t)c->index_n_heads * c->index_head_dim + c->index_n_heads;
        widest = max64(widest, mla);
    }
    if (c->num_experts) {
        const int64_t De = c->routed_expert_hidden_size ? c->routed_expert_hidden_size : D,
                      Il = c->moe_intermediate_size / tp;
        widest = max64(widest, De + c->num_experts_per_token * (2 * De + 2 * Il) +
                                   2 * (int64_t)c->moe_intermediate_size * c->num_shared_experts / tp + 2 * D);
    }
    widest = max64(widest, 3 * (int64_t)c->intermediate_size / tp);
    const int64_t rows = o->max_num_seqs * (1 + p->num_spec);
    p->ws_stream = B * stream * 2;
    p->ws_layer = B * widest * 2;
    p->ws_logits = rows * c->vocab_size * 4;
    p->ws_index = c->index_topk > 0 ? rows * o->max_model_len * 4 : 0;
    p->workspace_bytes = p->ws_stream + p->ws_layer + p->ws_logits + p->ws_index;

    /* what is left */
    p->budget_bytes = (int64_t)(o->gpu_memory_gb * GB * o->gpu_util);
    p->cache_bytes = p->budget_bytes - p->weights_gpu - p->workspace_bytes;
    const int64_t len = ceil_div(o->max_model_len, BLOCK_TOKENS) * BLOCK_TOKENS;
    /* a request's tokens spread over dcp ranks: each holds ceil(len / dcp) of them */
    p->seq_bytes = ceil_div(len, dcp) * p->kv_bytes_per_token + p->kda_state_bytes;
    if (p->cache_bytes > 0) {
        p->seqs_at_max_len = p->cache_bytes / p->seq_bytes;
        int64_t left = p->cache_bytes - o->max_num_seqs * p->kda_state_bytes;
        p->tokens_fit = left > 0 && p->kv_bytes_per_token ? left / p->kv_bytes_per_token * dcp : 0;
    }
    return 0;
}

int lunar_plan_min_tp(const lunar_config *c, int64_t vision_params, const lunar_draft_config *d,
                      const lunar_plan_opts *o, int dcp_all) {
    for (int tp = 1; tp <= 64; tp *= 2) {
        lunar_plan_opts t = *o;
        t.tp = tp;
        t.dcp = dcp_all ? tp : (o->dcp < tp ? o->dcp : tp);
        t.max_num_seqs = 1;
        lunar_plan p;
        lunar_err err;
        if (lunar_plan_compute(&p, c, vision_params, d, &t, &err) != 0) continue;
        if (p.cache_bytes >= p.seq_bytes) return tp;
    }
    return 0;
}

/* ---- printing ----------------------------------------------------------------------------- */

void lunar_plan_print(FILE *f, const lunar_plan *p, const lunar_config *c, const lunar_draft_config *d,
                      int64_t vision_params) {
    const lunar_plan_opts *o = &p->opts;
    fprintf(f, "model: %s, %d layers (%d KDA, %d MLA%s)%s\n", c->model_type, c->num_hidden_layers,
            c->n_kda_layers, c->n_mla_layers, c->index_topk > 0 ? " with DSA indexer" : "",
            d ? ", DSpark draft" : "");
    fprintf(f, "parameters: %.3f B total, %.3f B active per token (text model)", p->params_total / GB,
            p->params_active / GB);
    if (vision_params) fprintf(f, "; vision %.3f B", vision_params / GB);
    if (d) fprintf(f, "; draft %.3f B", lunar_draft_count_params(d) / GB);
    fprintf(f, "\ncheckpoint: %" PRId64 " bytes (%.2f GB) in storage dtypes%s\n", p->checkpoint_bytes,
            p->checkpoint_bytes / GB, d ? ", without the draft" : "");
    fprintf(f, "layout: tp %d, dcp %d; kv cache %s%s%s, KDA state %s%s\n", o->tp, o->dcp,
            lunar_cache_dtype_name(o->kv_dtype), c->index_topk > 0 ? ", index cache " : "",
            c->index_topk > 0 ? lunar_cache_dtype_name(o->index_dtype) : "",
            lunar_cache_dtype_name(o->state_dtype), o->latent_moe_mxfp4 ? ", latent MoE proj as MXFP4" : "");
    if (o->dcp > 1) { /* the groups the ranks form (parallel/comm.h), as serve's ranks log them */
        char groups[192];
        lunar_dcp_layout(groups, sizeof groups, o->tp, o->dcp);
        fprintf(f, "dcp groups: %s\n", groups);
    }

    fprintf(f, "\nweights per GPU (GB = 1e9 B)\n");
    fprintf(f, "  %-17s %10s %10s %9s %9s %8s %8s  %s\n", "kind", "params(B)", "total GB", "BF16 GB",
            "F32/U8 GB", "GPU GB", "repl GB", "tensor parallel");
    for (int k = 0; k < LUNAR_W_COUNT; k++) {
        const lunar_plan_row *r = &p->w[k];
        if (!r->total_bytes) continue;
        fprintf(f, "  %-17s %10.3f %10.3f %9.3f %9.3f %8.3f %8.3f  %s\n", lunar_wkind_name((lunar_wkind)k),
                r->params / GB, r->total_bytes / GB, r->bytes[LUNAR_SD_BF16] / GB,
                (r->bytes[LUNAR_SD_F32] + r->bytes[LUNAR_SD_U8]) / GB, r->gpu_bytes / GB,
                r->gpu_replicated / GB, wkind_split((lunar_wkind)k));
    }
    int64_t repl = 0;
    for (int k = 0; k < LUNAR_W_COUNT; k++) repl += p->w[k].gpu_replicated;
    fprintf(f, "  %-17s %10s %10.3f %9s %9s %8.3f %8.3f\n", "total", "",
            (p->checkpoint_bytes + p->draft_bytes) / GB, "", "", p->weights_gpu / GB, repl / GB);
    fprintf(f, "start-up (weights on each GPU): %.2f GB = %.2f GiB\n", p->weights_gpu / GB,
            p->weights_gpu / 1073741824.0);

    fprintf(f, "\ncaches per GPU\n");
    fprintf(f, "  MLA latent: %d B/token/layer (%s) x %d rows (%d MLA%s)\n", p->latent_row_bytes,
            lunar_cache_dtype_name(o->kv_dtype), p->n_latent_rows, c->n_mla_layers,
            d ? " + draft layers" : "");
    if (p->n_index_rows)
        fprintf(f, "  index keys: %d B/token/layer (%s) x %d rows  [fp8 132 B, mxfp4 68 B: -48.5 %%]\n",
                p->index_row_bytes, lunar_cache_dtype_name(o->index_dtype), p->n_index_rows);
    fprintf(f, "  KV bytes/token: %" PRId64 " B on the rank holding it; /%d with dcp\n",
            p->kv_bytes_per_token, o->dcp);
    if (c->n_kda_layers)
        fprintf(f, "  KDA state/request: %.1f MiB (%d slot%s: recurrent %.1f MiB %s + conv %.2f MiB bf16)\n",
                p->kda_state_bytes / 1048576.0, p->state_slots, p->state_slots > 1 ? "s" : "",
                p->kda_ssm_bytes / 1048576.0, lunar_cache_dtype_name(o->state_dtype),
                p->kda_conv_bytes / 1048576.0);

    fprintf(f, "\nactivation workspace: %.2f GB (B=%" PRId64 " tokens: stream %.2f + widest layer %.2f; "
            "logits %.2f; index scores %.2f)\n", p->workspace_bytes / GB, o->max_num_batched_tokens,
            p->ws_stream / GB, p->ws_layer / GB, p->ws_logits / GB, p->ws_index / GB);
    fprintf(f, "budget: %.1f GB x %.2f = %.2f GB; weights %.2f + workspace %.2f -> caches %.2f GB\n",
            o->gpu_memory_gb, o->gpu_util, p->budget_bytes / GB, p->weights_gpu / GB,
            p->workspace_bytes / GB, p->cache_bytes / GB);
    if (p->cache_bytes <= 0) {
        fprintf(f, "does not fit: the weights and workspace exceed the budget\n");
    } else {
        fprintf(f, "one request at max-model-len %" PRId64 ": %.2f GB per GPU\n", o->max_model_len,
                p->seq_bytes / GB);
        fprintf(f, "fits: %" PRId64 " KV tokens beside %" PRId64 " KDA states (max-num-seqs); %" PRId64
                " concurrent requests at max-model-len\n", p->tokens_fit, o->max_num_seqs, p->seqs_at_max_len);
    }
}
