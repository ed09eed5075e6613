/* The engine on CUDA tensor-parallel ranks: rank setup, rank 0's links, the follower loop
 * (engine_tp.h). */
#include "engine/engine_tp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/forward_cuda_tp.h"

int lunar_cuda_rank_open(lunar_cuda_rank *r, const lunar_model *full, const lunar_engine_options *o,
                         const lunar_tp_link *l, lunar_err *err) {
    memset(r, 0, sizeof *r);
    const int dcp = o->decode_context_parallel_size > 1 ? o->decode_context_parallel_size : 1;
    const lunar_tp_opts t = {l->world, dcp, o->enable_expert_parallel};
    const double util = o->gpu_memory_utilization > 0 ? o->gpu_memory_utilization : 0.9;
    /* the comm first: NCCL takes its buffers outside the arena, which then takes what is left */
    if (lunar_tp_check(&full->cfg, &t, err) ||
        lunar_comm_nccl_init(&r->comm, l->id, l->rank, l->world, l->local_rank, err))
        return -1;
    /* the DCP group's comm: the TP comm (DCP = TP) or a split of it, before the arena as well */
    if (lunar_dcp_comm(r->comm, dcp, &r->dcp, err)) {
        lunar_cuda_rank_close(r);
        return -1;
    }
    if (lunar_cuda_rank_init(l->local_rank, util, err) ||
        lunar_shard_model(&r->rank_m, full, &t, l->rank, r->comm, r->dcp, err) ||
        lunar_cuda_tp_check(r->rank_m, err) ||
        lunar_cuda_model_upload(&r->gpu, r->rank_m, err)) {
        lunar_cuda_rank_close(r);
        return -1;
    }
    return 0;
}

void lunar_cuda_rank_close(lunar_cuda_rank *r) {
    lunar_cuda_model_free(r->gpu);
    lunar_model_free(r->rank_m);
    lunar_dcp_comm_free(r->comm, r->dcp);
    lunar_comm_free(r->comm);
    memset(r, 0, sizeof *r);
}

static int kv_fp8_of(const lunar_engine_options *o) {
    return (lunar_engine_cuda_cache_flags(o) & LUNAR_CUDA_CACHE_FP8_LATENT) != 0;
}

int lunar_engine_cuda_cache_flags(const lunar_engine_options *o) {
    const int fp8 = o->kv_cache_dtype && strncmp(o->kv_cache_dtype, "fp8", 3) == 0; /* engine.c validates the name */
    return (fp8 ? LUNAR_CUDA_CACHE_FP8_LATENT : 0) | (o->kda_state_fp16 ? LUNAR_CUDA_CACHE_FP16_STATE : 0);
}

lunar_rank_room lunar_cuda_rank_room(const lunar_model *rank_m, const lunar_engine_options *o) {
    const int64_t step = (int64_t)lunar_cuda_step_bytes(rank_m, o->max_num_batched_tokens, o->max_num_seqs,
                                                        o->max_model_len);
    lunar_rank_room r = {(int64_t)lunar_cuda_arena_left() - step, (int64_t)lunar_cuda_block_bytes(rank_m, kv_fp8_of(o)),
                         (int64_t)lunar_cuda_slot_bytes(rank_m, o->kda_state_fp16)};
    if (o->cache_memory_bytes > 0 && o->cache_memory_bytes < r.budget) r.budget = o->cache_memory_bytes;
    return r;
}

static int64_t join64(const int32_t *w) { return (int64_t)((uint64_t)(uint32_t)w[0] | (uint64_t)(uint32_t)w[1] << 32); }
static void push64(lunar_wire_msg *m, int64_t v) {
    lunar_wire_push(m, (int32_t)(uint32_t)(uint64_t)v);
    lunar_wire_push(m, (int32_t)(uint32_t)((uint64_t)v >> 32));
}

int lunar_tp_link_rooms(const lunar_tp_link *l, lunar_rank_room *rooms, int timeout_ms, lunar_err *err) {
    lunar_wire_msg m = {0};
    int rc = 0;
    for (int j = 1; j < l->world && rc == 0; j++) {
        lunar_err e;
        int k = lunar_wire_recv(l->fds[j - 1], &m, timeout_ms, &e);
        if (k <= 0 || m.kind != LUNAR_WIRE_READY || m.n != 6)
            rc = lunar_fail(err, "tensor-parallel rank %d did not come up: %s", j,
                            k < 0 ? e.msg : k == 0 ? "it exited (see its message above)" : "unexpected message");
        else
            rooms[j - 1] = (lunar_rank_room){join64(m.w), join64(m.w + 2), join64(m.w + 4)};
    }
    lunar_wire_free(&m);
    return rc;
}

int lunar_tp_link_send(const lunar_tp_link *l, const lunar_wire_msg *m, lunar_err *err) {
    for (int j = 1; j < l->world; j++) {
        lunar_err e;
        if (lunar_wire_send(l->fds[j - 1], m, &e)) return lunar_fail(err, "tensor-parallel rank %d: %s", j, e.msg);
    }
    return 0;
}

/* The replay loop of a follower whose rank is up and whose caches are made. */
static int follow_loop(const lunar_cuda_rank *r, lunar_cuda_caches *c, int fd, lunar_err *err) {
    lunar_wire_msg m = {0};
    int rc = -1;
    for (;;) {
        const int k = lunar_wire_recv(fd, &m, -1, err);
        if (k < 0) break;
        if (k == 0) { /* rank 0 went away without a STOP: it failed (its message says why) */
            lunar_fail(err, "rank 0 closed the link without a stop");
            break;
        }
        if (m.kind == LUNAR_WIRE_STOP) {
            rc = 0;
            break;
        }
        if (m.kind == LUNAR_WIRE_CLEAR && m.n == 1 && m.w[0] >= 0 && m.w[0] < c->n_slots) {
            lunar_cuda_state_clear(c, m.w[0]);
        } else if (m.kind == LUNAR_WIRE_COPY && m.n == 2 && m.w[0] >= 0 && m.w[0] < c->n_slots && m.w[1] >= 0 &&
                   m.w[1] < c->n_slots) {
            lunar_cuda_state_copy(c, m.w[0], m.w[1]);
        } else if (m.kind == LUNAR_WIRE_STEP) {
            lunar_batch_seq *seqs;
            int n, rows;
            if (lunar_wire_step_decode(&m, &seqs, &n, &rows, err)) break;
            (void)rows; /* rank 0 alone samples: the gathered logits stay on this device */
            const int frc = lunar_forward_batch_cuda(r->gpu, c, seqs, n, NULL, err);
            free(seqs);
            if (frc) break;
        } else {
            lunar_fail(err, "rank link: unexpected message kind %u (%zu words)", m.kind, m.n);
            break;
        }
    }
    lunar_wire_free(&m);
    return rc;
}

int lunar_engine_follow(const lunar_engine_options *o, const lunar_tp_link *l, lunar_err *err) {
    const int fd = l->fds[0];
    lunar_model *full = NULL;
    /* dummy weights: generated on this rank's device, its shards only (model/dummy.h) */
    lunar_load_options lo = {.load_format = o->load_format, .num_layers = o->num_layers, .tp_slice = o->tp_slice,
                             .seed = o->dummy_seed, .device_lazy = 1, .ptpc_fp8 = o->ptpc_fp8};
    if (lunar_model_load_ex(&full, o->model_dir, &lo, err)) return -1;
    lunar_cuda_rank r;
    if (lunar_cuda_rank_open(&r, full, o, l, err)) {
        lunar_model_free(full);
        return -1;
    }
    const lunar_rank_room room = lunar_cuda_rank_room(r.rank_m, o);
    lunar_wire_msg m = {0};
    lunar_wire_reset(&m, LUNAR_WIRE_READY);
    push64(&m, room.budget), push64(&m, room.block_bytes), push64(&m, room.slot_bytes);
    lunar_cuda_caches c;
    memset(&c, 0, sizeof c);
    int rc = -1;
    if (lunar_wire_send(fd, &m, err) == 0) {
        const int k = lunar_wire_recv(fd, &m, -1, err);
        if (k == 0) lunar_fail(err, "rank 0 closed the link before the caches were planned");
        else if (k > 0 && (m.kind != LUNAR_WIRE_INIT || m.n != 2))
            lunar_fail(err, "rank link: expected the cache plan, got message kind %u", m.kind);
        else if (k > 0 && lunar_cuda_caches_init(&c, r.rank_m, m.w[0], m.w[1], lunar_engine_cuda_cache_flags(o), err) == 0)
            rc = follow_loop(&r, &c, fd, err);
    }
    lunar_wire_free(&m);
    lunar_cuda_caches_free(&c); /* before the weights: the arena is a stack */
    lunar_cuda_rank_close(&r);
    lunar_model_free(full);
    return rc;
}
