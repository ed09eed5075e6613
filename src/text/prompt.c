#include "text/prompt.h"

#include <string.h>

#include "text/chat_k2.h"
#include "text/chat_k3.h"

int lunar_chat_render(lunar_arch arch, const json_t *req, lunar_chat_prompt *out, lunar_err *err) {
    return arch == LUNAR_ARCH_KIMI_K3 ? lunar_chat_k3_render(req, out, err)
                                      : lunar_chat_k2_render(req, out, err);
}

int lunar_prompt_ids(const lunar_tokenizer *tok, const lunar_chat_prompt *p, lunar_ids *ids,
                     lunar_err *err) {
    for (size_t i = 0; i < p->n_segs; i++) {
        const lunar_chat_seg *s = &p->segs[i];
        const char *bytes = p->bytes.p + s->off;
        if (s->kind == LUNAR_SEG_TEXT) {
            if (lunar_tokenize(tok, bytes, s->len, false, ids, err)) return -1;
        } else if (s->kind == LUNAR_SEG_SPECIAL) {
            char name[64];
            if (s->len >= sizeof name) return lunar_fail(err, "control token too long in the prompt");
            memcpy(name, bytes, s->len);
            name[s->len] = '\0';
            int32_t id = lunar_token_id(tok, name);
            if (id < 0) return lunar_fail(err, "the tokenizer has no control token %s", name);
            lunar_ids_push(ids, id);
        } else {
            return lunar_fail(err, "messages: image inputs need the vision encoder, which this build "
                                   "does not have yet");
        }
    }
    return 0;
}
