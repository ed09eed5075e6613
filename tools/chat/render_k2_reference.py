#!/usr/bin/env python3
"""Reference K2-format prompt renderer for Kimi-Linear, written from reference/api.md §2 (the semantics of the
Kimi K2 chat templates as rendered by transformers' apply_chat_template), used to generate the golden prompts
that src/text/chat_k2.c must reproduce byte for byte.

  python3 tools/chat/render_k2_reference.py     # regenerate tests/data/chat/k2_cases.jsonl

Rules (api.md §2 "Common frame"; Kimi-Linear has no thinking channel, so no <think> parts):
  - tools first: <|im_system|>tool_declare<|im_middle|>{tools}<|im_end|>, tools deep key-sorted
    (apply_chat_template's deep_sort_dict) and dumped compact, ensure_ascii=False (tojson(separators=(',', ':')));
  - a default system turn when the first message is not system;
  - each message: header + body + <|im_end|>; header <|im_user|>{name or 'user'} / <|im_assistant|>{name or
    'assistant'} / <|im_system|>{name or role}, then <|im_middle|>;
  - content: a string as is; text parts concatenated; None renders nothing;
  - assistant tool calls after the content: <|tool_calls_section_begin|> + per call <|tool_call_begin|>{id}
    <|tool_call_argument_begin|>{arguments}<|tool_call_end|> + <|tool_calls_section_end|>; arguments verbatim
    when a string, else tojson (HF tojson = json.dumps(ensure_ascii=False), default ', ' ': ' separators);
    a missing id becomes functions.{name}:{n}, n counting all calls of the conversation so far (as SGLang
    rebuilds ids: history count + index);
  - tool result body: "## Return of {tool_call_id}\\n{content}";
  - generation prompt <|im_assistant|>assistant<|im_middle|>.
Segments are (text, special): specials are control tokens; the text between two specials is one segment
(transformers renders one string and tokenizes each run between special tokens as a whole), never containing
special ids even if it spells one (lunar's choice: user text never becomes control tokens)."""
import json
import os

IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE, IM_END = (
    '<|im_user|>', '<|im_assistant|>', '<|im_system|>', '<|im_middle|>', '<|im_end|>')
SEC_BEGIN, SEC_END, CALL_BEGIN, ARG_BEGIN, CALL_END = (
    '<|tool_calls_section_begin|>', '<|tool_calls_section_end|>', '<|tool_call_begin|>',
    '<|tool_call_argument_begin|>', '<|tool_call_end|>')
DEFAULT_SYSTEM = 'You are Kimi, an AI assistant created by Moonshot AI.'


def deep_sort(o):
    if isinstance(o, dict):
        return {k: deep_sort(v) for k, v in sorted(o.items())}
    if isinstance(o, list):
        return [deep_sort(x) for x in o]
    return o


class Out:
    def __init__(self):
        self.segs = []

    def special(self, t):
        self.segs.append([t, True])

    def text(self, t):
        if t == '':
            return
        if self.segs and not self.segs[-1][1]:
            self.segs[-1][0] += t
        else:
            self.segs.append([t, False])


def content(c):
    if c is None:
        return ''
    if isinstance(c, str):
        return c
    return ''.join(part['text'] for part in c)


def render(req):
    o = Out()
    tools = req.get('tools')
    if tools:
        o.special(IM_SYSTEM), o.text('tool_declare'), o.special(IM_MIDDLE)
        o.text(json.dumps(deep_sort(tools), ensure_ascii=False, separators=(',', ':')))
        o.special(IM_END)
    msgs = req['messages']
    if not msgs or msgs[0]['role'] != 'system':
        o.special(IM_SYSTEM), o.text('system'), o.special(IM_MIDDLE), o.text(DEFAULT_SYSTEM), o.special(IM_END)
    n_calls = 0
    for m in msgs:
        role = m['role']
        name = m.get('name') or None
        if role == 'user':
            o.special(IM_USER), o.text(name or 'user')
        elif role == 'assistant':
            o.special(IM_ASSISTANT), o.text(name or 'assistant')
        else:
            o.special(IM_SYSTEM), o.text(name or role)
        o.special(IM_MIDDLE)
        if role == 'tool':
            o.text('## Return of %s\n' % m['tool_call_id'] + content(m.get('content')))
        else:
            o.text(content(m.get('content')))
        if role == 'assistant' and m.get('tool_calls'):
            o.special(SEC_BEGIN)
            for tc in m['tool_calls']:
                fn = tc['function']
                tid = tc.get('id') or 'functions.%s:%d' % (fn['name'], n_calls)
                n_calls += 1
                o.special(CALL_BEGIN), o.text(tid), o.special(ARG_BEGIN)
                a = fn.get('arguments')
                o.text(a if isinstance(a, str) else json.dumps(a, ensure_ascii=False) if a is not None else '')
                o.special(CALL_END)
            o.special(SEC_END)
        o.special(IM_END)
    o.special(IM_ASSISTANT), o.text('assistant'), o.special(IM_MIDDLE)
    return o.segs


WEATHER = {'type': 'function', 'function': {'name': 'get_weather', 'description': 'Weather in a city, °C',
                                            'parameters': {'type': 'object', 'required': ['city'],
                                                           'properties': {'city': {'type': 'string'},
                                                                          'days': {'type': 'integer',
                                                                                   'minimum': 1}}}}}
SEARCH = {'type': 'function', 'function': {'name': 'search', 'parameters': {'type': 'object', 'properties': {
    'q': {'type': 'string', 'description': '查询 "quoted"\n'}}}}}

CASES = [
    ('default_system', {'messages': [{'role': 'user', 'content': 'Hello!'}]}),
    ('own_system', {'messages': [{'role': 'system', 'content': 'Be brief.'},
                                 {'role': 'user', 'content': '你好，世界 😀'}]}),
    ('multi_turn', {'messages': [{'role': 'system', 'content': 'S'}, {'role': 'user', 'content': 'Hi'},
                                 {'role': 'assistant', 'content': 'Hello. How can I help?'},
                                 {'role': 'user', 'content': 'Tell me a joke.\n\nA short one.'}]}),
    ('tools', {'tools': [WEATHER, SEARCH], 'messages': [{'role': 'user', 'content': 'Weather in Paris?'}]}),
    ('tool_calls_history', {'tools': [WEATHER], 'messages': [
        {'role': 'user', 'content': 'Weather in Paris and Rome?'},
        {'role': 'assistant', 'content': 'Checking both.', 'tool_calls': [
            {'id': 'functions.get_weather:0', 'type': 'function',
             'function': {'name': 'get_weather', 'arguments': '{"city": "Paris"}'}},
            {'id': 'functions.get_weather:1', 'type': 'function',
             'function': {'name': 'get_weather', 'arguments': '{"city":"Rome","days":2}'}}]},
        {'role': 'tool', 'tool_call_id': 'functions.get_weather:0', 'content': '{"temp": 21}'},
        {'role': 'tool', 'tool_call_id': 'functions.get_weather:1', 'name': 'get_weather', 'content': '18°C'},
        {'role': 'assistant', 'content': 'Paris 21°C, Rome 18°C.'},
        {'role': 'user', 'content': 'Thanks'}]}),
    ('tool_calls_dict_args_no_id', {'tools': [SEARCH, WEATHER], 'messages': [
        {'role': 'user', 'content': 'Search twice'},
        {'role': 'assistant', 'content': None, 'tool_calls': [
            {'type': 'function', 'function': {'name': 'search', 'arguments': {'q': 'a "b"', 'n': [1, 2.5, None]}}}]},
        {'role': 'tool', 'tool_call_id': 'functions.search:0', 'content': 'r1'},
        {'role': 'assistant', 'content': '', 'tool_calls': [
            {'type': 'function', 'function': {'name': 'get_weather', 'arguments': {'city': 'Zürich'}}},
            {'id': 'call_abc', 'type': 'function', 'function': {'name': 'search', 'arguments': '{}'}}]},
        {'role': 'tool', 'tool_call_id': 'functions.get_weather:1', 'content': 'sunny'},
        {'role': 'tool', 'tool_call_id': 'call_abc', 'content': ''}]}),
    ('names_and_parts', {'messages': [
        {'role': 'system', 'name': 'ops', 'content': [{'type': 'text', 'text': 'Part one. '},
                                                      {'type': 'text', 'text': 'Part two.'}]},
        {'role': 'user', 'name': 'alice', 'content': [{'type': 'text', 'text': 'Hi '}, {'type': 'text', 'text': 'there'}]},
        {'role': 'assistant', 'name': 'kimi', 'content': 'Hey alice'},
        {'role': 'user', 'content': 'literal <|im_end|> and <|tool_call_begin|> stay text'}]}),
    ('tool_result_parts', {'tools': [SEARCH], 'messages': [
        {'role': 'user', 'content': 'q'},
        {'role': 'assistant', 'content': 'ok', 'tool_calls': [
            {'id': 'functions.search:0', 'type': 'function', 'function': {'name': 'search', 'arguments': '{"q":"x"}'}}]},
        {'role': 'tool', 'tool_call_id': 'functions.search:0', 'content': [{'type': 'text', 'text': 'line 1\n'},
                                                                             {'type': 'text', 'text': 'line 2'}]}]}),
]


def main():
    path = os.path.join(os.path.dirname(__file__), '..', '..', 'tests', 'data', 'chat', 'k2_cases.jsonl')
    with open(path, 'w', encoding='utf-8') as f:
        for name, req in CASES:
            segs = render(req)
            f.write(json.dumps({'name': name, 'request': req, 'text': ''.join(s for s, _ in segs), 'segments': segs},
                               ensure_ascii=False) + '\n')
    print('wrote %d cases to %s' % (len(CASES), os.path.normpath(path)))


if __name__ == '__main__':
    main()
