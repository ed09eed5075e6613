/* K2-format prompt rendering for Kimi-Linear (reference/api.md §2-3; SPEC §5 last line):
 *   [<|im_system|>tool_declare<|im_middle|>{tools: key-sorted compact JSON}<|im_end|>]
 *   [<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>]  (first message not system)
 *   per message: <|im_user|>{name|user} / <|im_assistant|>{name|assistant} / <|im_system|>{name|role}, <|im_middle|>, body, <|im_end|>
 *     assistant body: content, then <|tool_calls_section_begin|> (<|tool_call_begin|>{id}<|tool_call_argument_begin|>{arguments}
 *       <|tool_call_end|>)* <|tool_calls_section_end|>; id verbatim (functions.{name}:{n} when missing; n counts calls
 *       across the conversation); arguments verbatim when a string, else Jinja tojson (json.dumps, ", " ": ")
 *     tool body: "## Return of {tool_call_id}\n{content}"
 *   <|im_assistant|>assistant<|im_middle|>                         (generation prompt)
 * Kimi-Linear has no thinking channel and no vision: thinking is always off, image parts are a 400.
 * Segments: the text between two special tokens is ONE text segment (transformers BPEs each such run whole);
 * text never becomes special ids. Golden: tests/data/chat/k2_cases.jsonl from tools/chat/render_k2_reference.py.
 * Extension beyond the template: role "developer" is rendered as "system" (also for the default-system check).
 * usage.prompt_tokens = all prompt ids (stub_tokens = 0). */
#ifndef LUNAR_TEXT_CHAT_K2_H
#define LUNAR_TEXT_CHAT_K2_H

#include "text/chat.h"

enum {
    LUNAR_K2_ID_IM_END = 163586, /* the stop token */
    LUNAR_K2_ID_IM_USER = 163587,
    LUNAR_K2_ID_IM_ASSISTANT = 163588,
    LUNAR_K2_ID_IM_SYSTEM = 163594,
    LUNAR_K2_ID_TOOL_CALLS_SECTION_BEGIN = 163595,
    LUNAR_K2_ID_TOOL_CALLS_SECTION_END = 163596,
    LUNAR_K2_ID_TOOL_CALL_BEGIN = 163597,
    LUNAR_K2_ID_TOOL_CALL_ARGUMENT_BEGIN = 163598,
    LUNAR_K2_ID_TOOL_CALL_END = 163599,
    LUNAR_K2_ID_IM_MIDDLE = 163601,
    LUNAR_K2_ID_THINK = 163606,     /* <think>, not special */
    LUNAR_K2_ID_THINK_END = 163607, /* </think> */
};

int lunar_chat_k2_render(const json_t *req, lunar_chat_prompt *out, lunar_err *err);

#endif
