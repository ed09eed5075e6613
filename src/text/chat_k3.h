/* Kimi-K3 "XTML" prompt rendering (reference/kvv.md §8b; Moonshot's encoding_k3.py as served by vLLM).
 *
 * Input: an OpenAI chat-completions request object (messages with roles system/developer/user/assistant/tool;
 * content as a string, null or a parts array with text and image_url parts; assistant reasoning_content (or
 * reasoning) and tool_calls; tool messages with tool_call_id; tools; system messages carrying `tools` (K3 dynamic
 * tools, empty content only); tool_choice; response_format; thinking{type,effort,keep}; reasoning_effort;
 * chat_template_kwargs{thinking,thinking_effort}).
 * Output: segments (see text/chat.h) ending with the generation stub, and the resolved options.
 *
 * Rendering order: request tools -> tool-declare message (key-sorted compact JSON); thinking -> thinking-effort
 * message; the messages (system+tools -> dynamic tool-declare; developer renders as system; assistant: think
 * channel (thinking only; reasoning when not blank), response channel, tools channel with typed arguments; tool
 * results reordered by tool_call_id to the preceding assistant's call order, tool="NAME" index="i");
 * tool_choice required|none -> tool-choice message; response_format json_object|json_schema -> response-format
 * message; stub <|open|>message role="assistant"<|sep|> + <|open|>think<|sep|> or <|open|>response<|sep|>.
 * usage.prompt_tokens = ids - 3 (stub_tokens = 3). */
#ifndef LUNAR_TEXT_CHAT_K3_H
#define LUNAR_TEXT_CHAT_K3_H

#include "text/chat.h"

/* K3 control tokens and their ids */
#define LUNAR_K3_END_OF_MSG "<|end_of_msg|>" /* 163586, the stop token */
#define LUNAR_K3_OPEN "<|open|>"             /* 163587 */
#define LUNAR_K3_CLOSE "<|close|>"           /* 163588 */
#define LUNAR_K3_SEP "<|sep|>"               /* 163589 */
#define LUNAR_K3_IMAGE_PLACEHOLDER "<|kimi_image_placeholder|>"
enum { LUNAR_K3_ID_END_OF_MSG = 163586, LUNAR_K3_ID_OPEN = 163587, LUNAR_K3_ID_CLOSE = 163588, LUNAR_K3_ID_SEP = 163589 };

/* Renders req into *out (zeroed first; free with lunar_chat_prompt_free, also after a failure).
 * Returns 0, or -1 with a "field.path: reason" message in err (an HTTP 400). */
int lunar_chat_k3_render(const json_t *req, lunar_chat_prompt *out, lunar_err *err);

#endif
