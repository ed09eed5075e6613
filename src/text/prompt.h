/* From an OpenAI chat request to prompt token ids: the model's chat format (XTML for kimi_k3, K2
 * for kimi_linear) renders segments, and each segment becomes ids — text through BPE with special
 * tokens OFF, control segments as their single special id. */
#ifndef LUNAR_TEXT_PROMPT_H
#define LUNAR_TEXT_PROMPT_H

#include <jansson.h>

#include "base/err.h"
#include "io/config.h"
#include "text/chat.h"
#include "text/tokenizer.h"

/* Renders req with the format of `arch`. Errors are request errors (HTTP 400). */
int lunar_chat_render(lunar_arch arch, const json_t *req, lunar_chat_prompt *out, lunar_err *err);

/* Appends the ids of a rendered prompt. Image segments need the vision encoder: an error for now. */
int lunar_prompt_ids(const lunar_tokenizer *tok, const lunar_chat_prompt *p, lunar_ids *ids,
                     lunar_err *err);

#endif
