/* From engine events to response bytes, without the engine or HTTP: a response holds one output per
 * choice (n), each with its detokenizer, stop-string filter and output parser (chat: reasoning / content /
 * tool calls; completions: plain text). Streaming responses produce SSE bytes as events arrive; the others
 * accumulate and produce one JSON body at the end.
 *
 *   lunar_srv_resp *rs = lunar_srv_resp_new(&req, tok, "chatcmpl-...", time(NULL));
 *   for each engine event ev of choice i:   (on the connection thread, in order)
 *       if (lunar_srv_resp_event(rs, i, &ev, &sse) == 1 && ev.finish == LUNAR_FINISH_NONE) cancel choice i;
 *   stream: write sse as it grows; when lunar_srv_resp_done(rs): lunar_srv_resp_stream_end(rs, &sse)
 *   else:   body = lunar_srv_resp_json(rs)   (or the error, when lunar_srv_resp_error says so)
 *
 * Stream layout (chat): per choice a role chunk {"role":"assistant","content":""} before its first delta;
 * deltas {"reasoning_content"}, {"content"}, tool calls as {index,id,type,function{name,arguments:""}} once,
 * then {index,function{arguments}} fragments; a finish chunk {"delta":{},"finish_reason"} (n = 1: it also
 * carries the usage in choices[0].usage and top-level usage, Kimi style); then always a final
 * {"choices":[],"usage":{...}} chunk (OpenAI include_usage style; kvv.md §9.14 asks for usage in every
 * stream, with or without stream_options) and "data: [DONE]". An engine error mid-stream becomes
 * data: {"error":{...}} before [DONE]. */
#ifndef LUNAR_SERVER_ASSEMBLE_H
#define LUNAR_SERVER_ASSEMBLE_H

#include <jansson.h>

#include "server/request.h"

typedef struct lunar_srv_resp lunar_srv_resp;

/* The request must outlive the response (stop strings, options). */
lunar_srv_resp *lunar_srv_resp_new(const lunar_srv_req *req, const lunar_tokenizer *tok, const char *id,
                                   long long created);
void lunar_srv_resp_free(lunar_srv_resp *rs);

/* One engine event of choice `choice`. Stream: SSE bytes are appended to out (may be NULL otherwise).
 * Returns 1 when the choice has just finished (by this event, or by a stop string seen in the text: then the
 * engine request is still running and should be cancelled), 0 otherwise. Events after the finish are ignored. */
int lunar_srv_resp_event(lunar_srv_resp *rs, int choice, const lunar_event *ev, lunar_sbuf *out);
/* Every choice finished. */
int lunar_srv_resp_done(const lunar_srv_resp *rs);
/* A choice ended with an engine error (or was aborted): 1 and *e filled. */
int lunar_srv_resp_error(const lunar_srv_resp *rs, lunar_api_error *e);
/* Stream end: the usage chunk and [DONE] (or the error and [DONE]). */
void lunar_srv_resp_stream_end(lunar_srv_resp *rs, lunar_sbuf *out);
/* Non-stream body (malloc'd). */
char *lunar_srv_resp_json(const lunar_srv_resp *rs);

/* Counts for logs and metrics. */
int lunar_srv_resp_completion_tokens(const lunar_srv_resp *rs);
const char *lunar_srv_resp_finish_reason(const lunar_srv_resp *rs, int choice);

/* SSE framing: "data: " + json + "\n\n" (json has no newline: compact jansson output). */
void lunar_sse_data(lunar_sbuf *out, const char *json);
void lunar_sse_json(lunar_sbuf *out, json_t *v); /* dumps and steals v */
void lunar_sse_done(lunar_sbuf *out);

#endif
