#!/usr/bin/env python3
"""Reference K3 "XTML" prompt renderer, written from reference/kvv.md §8b and
reference/dspark_vl_api_spec.md §3 (behaviour of Moonshot's encoding_k3.py as served by vLLM), used to
generate the golden prompts that src/text/chat_k3.c must reproduce segment for segment.

  python3 tools/chat/render_k3_reference.py            # regenerate tests/data/chat/k3_cases.jsonl
  python3 tools/chat/render_k3_reference.py --check    # only check the KVV token counts

Segments are (text, special). Special segments are control tokens; text segments are BPE'd on their own
with special-token recognition off. Token counts use tiktoken with the real Kimi tiktoken.model."""
import base64, json, os, sys

OPEN, CLOSE, SEP, EOM = '<|open|>', '<|close|>', '<|sep|>', '<|end_of_msg|>'
IMAGE = '<|kimi_image_placeholder|>'
EFFORTS = ('low', 'high', 'max')


def seg(out, text, special=False):
    if text != '':
        out.append((text, special))


def open_tag(out, tag, attrs=()):
    seg(out, OPEN, True)
    seg(out, tag)
    for k, v in attrs:
        seg(out, ' ' + k)
        seg(out, '="')
        seg(out, str(v).replace('&', '&amp;').replace('"', '&quot;'))
        seg(out, '"')
    seg(out, SEP, True)


def close_tag(out, tag):
    seg(out, CLOSE, True)
    seg(out, tag)
    seg(out, SEP, True)


def deep_sort(o):
    if isinstance(o, dict):
        return {k: deep_sort(v) for k, v in sorted(o.items())}
    if isinstance(o, list):
        return [deep_sort(x) for x in o]
    return o


def compact(v):
    return json.dumps(v, ensure_ascii=False, separators=(',', ':'))


def content(out, c):
    if isinstance(c, str):
        seg(out, c)
    elif c is not None:
        for part in c:
            if part['type'] in ('image', 'image_url'):
                seg(out, IMAGE, True)
            else:
                seg(out, part['text'])


def internal(out, typ, body):
    open_tag(out, 'message', [('role', 'system'), ('type', typ)])
    seg(out, body.strip())
    close_tag(out, 'message')
    seg(out, EOM, True)


def tool_declare(out, tools, dynamic):
    if dynamic:
        body = ('## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n'
                'You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n'
                '```json\n' + compact(deep_sort(tools)) + '\n```')
    else:
        body = ('# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n'
                + compact(deep_sort(tools)) + '\n```')
    open_tag(out, 'message', [('role', 'system'), ('type', 'tool-declare')])
    seg(out, body)
    close_tag(out, 'message')
    seg(out, EOM, True)


def options(req):
    """thinking / effort from the request (SPEC §5, kvv.md §5, §9.5)."""
    kw = req.get('chat_template_kwargs') or {}
    th = req.get('thinking') or {}
    thinking = kw.get('thinking', True)
    if 'type' in th:
        thinking = th['type'] != 'disabled'
    effort = th.get('effort', kw.get('thinking_effort'))
    re_ = req.get('reasoning_effort')
    if re_ == 'none':
        thinking = False
    elif effort is None and re_ is not None:
        effort = re_
    if effort is None:
        effort = 'max'
    assert effort in EFFORTS
    return thinking, effort


def reorder_tool_results(msgs):
    out, index, i = [], {}, 0
    while i < len(msgs):
        m = msgs[i]
        if m['role'] == 'assistant':
            index = {}
            for pos, tc in enumerate(m.get('tool_calls') or [], 1):
                if tc.get('id') is not None and str(tc['id']) not in index:
                    index[str(tc['id'])] = (pos, tc.get('function', tc).get('name'))
            out.append(m)
            i += 1
            continue
        if m['role'] != 'tool':
            out.append(m)
            i += 1
            continue
        run, ok = [], True
        while i < len(msgs) and msgs[i]['role'] == 'tool':
            t = msgs[i]
            cid = t.get('tool_call_id', t.get('id'))
            hit = index.get(str(cid)) if cid is not None else None
            if hit is None:
                ok = False
            run.append((hit[0] if hit else 0, len(run), t, hit[1] if hit else None))
            i += 1
        if ok:
            run.sort(key=lambda r: (r[0], r[1]))
            for _, _, t, name in run:
                t = dict(t)
                t['tool'] = name
                if 'name' in t:
                    t['name'] = name
                out.append(t)
        else:
            out.extend(r[2] for r in run)
    return out


def arguments(a):
    """-> (dict, raw-json-block or None)"""
    if a is None:
        return {}, None
    if isinstance(a, dict):
        return a, None
    if not a.strip():
        return {}, None
    try:
        v = json.loads(a)
    except json.JSONDecodeError:
        return {}, a
    if not isinstance(v, dict):
        raise ValueError('arguments must be a JSON object')
    return v, None


def xtml_type(v):
    if isinstance(v, bool):
        return 'boolean'
    if v is None:
        return 'null'
    if isinstance(v, (int, float)):
        return 'number'
    if isinstance(v, str):
        return 'string'
    if isinstance(v, dict):
        return 'object'
    return 'array'


def render(req):
    thinking, effort = options(req)
    msgs = reorder_tool_results([dict(m, role='system') if m['role'] == 'developer' else m
                                 for m in req['messages']])
    out = []
    if req.get('tools'):
        tool_declare(out, req['tools'], False)
    if thinking:
        internal(out, 'thinking-effort',
                 '`thinking_effort` guides on how much to think in your thinking channel (not including the '
                 'response channel), supported values include `low`, `medium`, `high`, and `max`.\n'
                 f'Now the system is invoked with `thinking_effort={effort}`.')
    calls, tool_index = None, 0
    for m in msgs:
        role = m['role']
        if role == 'system' and m.get('tools'):
            tool_declare(out, m['tools'], True)
        elif role in ('user', 'system'):
            attrs = [('role', role)] + ([('name', m['name'])] if m.get('name') else [])
            open_tag(out, 'message', attrs)
            content(out, m.get('content'))
            close_tag(out, 'message')
            seg(out, EOM, True)
        elif role == 'tool':
            tool_index += 1
            name = m.get('tool', m.get('name'))
            if name is None and calls is not None and tool_index <= len(calls):
                name = calls[tool_index - 1].get('function', calls[tool_index - 1])['name']
            assert name is not None
            open_tag(out, 'message', [('role', 'tool'), ('tool', name), ('index', tool_index)])
            content(out, m.get('content'))
            close_tag(out, 'message')
            seg(out, EOM, True)
        elif role == 'assistant':
            calls, tool_index = m.get('tool_calls'), 0
            attrs = [('role', 'assistant')] + ([('name', m['name'])] if m.get('name') else [])
            open_tag(out, 'message', attrs)
            if thinking:
                r = m.get('reasoning_content') or m.get('reasoning')
                open_tag(out, 'think')
                if r is not None and str(r).strip():
                    seg(out, r)
                close_tag(out, 'think')
            open_tag(out, 'response')
            content(out, m.get('content'))
            close_tag(out, 'response')
            if calls:
                open_tag(out, 'tools')
                for j, tc in enumerate(calls, 1):
                    fn = tc.get('function', tc)
                    open_tag(out, 'call', [('tool', fn['name']), ('index', j)])
                    args, block = arguments(fn.get('arguments'))
                    if block is not None:
                        open_tag(out, 'json', [('type', 'object')])
                        seg(out, block)
                        close_tag(out, 'json')
                    else:
                        for k, v in args.items():
                            open_tag(out, 'argument', [('key', k), ('type', xtml_type(v))])
                            seg(out, v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
                            close_tag(out, 'argument')
                    close_tag(out, 'call')
                close_tag(out, 'tools')
            close_tag(out, 'message')
            seg(out, EOM, True)
        else:
            raise ValueError('role ' + role)
    tc = req.get('tool_choice')
    if tc == 'required':
        internal(out, 'tool-choice', 'The system is invoked with `tool_choice=required`.\n'
                 'You MUST call tools in the next message.')
    elif tc == 'none':
        internal(out, 'tool-choice', 'The system is invoked with `tool_choice=none`.\n'
                 'You MUST NOT call any tools in the next message.')
    rf = req.get('response_format')
    rft = rf.get('type') if isinstance(rf, dict) else rf
    head = ('Your response must be raw JSON data without markdown code blocks (```json) or any '
            'additional formatting.')
    if rft == 'json_object':
        internal(out, 'response-format', 'The system is invoked with `response_format=json_object`.\n' + head)
    elif rft == 'json_schema':
        js = rf['json_schema']
        schema = deep_sort(js.get('schema', js.get('json_schema', js)))
        internal(out, 'response-format', 'The system is invoked with `response_format=json_schema`.\n' + head +
                 '\nThe JSON data must match the following schema:\n```json\n' + compact(schema) + '\n```')
    open_tag(out, 'message', [('role', 'assistant')])
    open_tag(out, 'think' if thinking else 'response')
    return out


# ---- token counting with the real tokenizer ----
PAT = '|'.join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
TOK_DIR = os.environ.get('KIMI_TOKENIZER', '/work/shared/data/kimi-tokenizer')


def encoding():
    import tiktoken
    ranks = {}
    with open(os.path.join(TOK_DIR, 'tiktoken.model'), 'rb') as f:
        for line in f:
            if line.strip():
                b, r = line.split()
                ranks[base64.b64decode(b)] = int(r)
    cfg = json.load(open(os.path.join(TOK_DIR, 'tokenizer_config.k3.json')))
    specials = {v['content']: int(k) for k, v in cfg['added_tokens_decoder'].items()}
    specials.setdefault(IMAGE, 163605)  # stand-in id: the processor expands it
    return tiktoken.Encoding('kimi', pat_str=PAT, mergeable_ranks=ranks, special_tokens=specials), specials


def ids_of(enc, specials, segs):
    ids = []
    for text, special in segs:
        ids.extend([specials[text]] if special else enc.encode_ordinary(text))
    return ids


CAPITAL = '请用 JSON 格式回答：北京是中国的首都吗？答案需要包含键 capital。'
WEATHER = {'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'Get the weather for a city',
    'parameters': {'type': 'object', 'properties': {
        'city': {'type': 'string', 'description': '城市名称'},
        'unit': {'type': 'string', 'enum': ['celsius', 'fahrenheit']}}, 'required': ['city']}}}
STOCK = {'type': 'function', 'function': {
    'name': 'get_stock_price', 'parameters': {'type': 'object', 'required': ['symbol'],
                                              'properties': {'symbol': {'type': 'string'}}}, 'strict': True}}

CASES = [
    # name, request, expected prompt_tokens (KVV constants) or None
    ('kvv_36_json_text', {'messages': [{'role': 'user', 'content': CAPITAL}], 'thinking': {'type': 'disabled'}}, 36),
    ('kvv_119_json_schema', {'messages': [{'role': 'user', 'content': CAPITAL}], 'thinking': {'type': 'disabled'},
                             'response_format': {'type': 'json_schema', 'json_schema': {
                                 'name': 'capital_answer', 'strict': True, 'schema': {
                                     'type': 'object', 'properties': {'capital': {'type': 'boolean'}},
                                     'required': ['capital'], 'additionalProperties': False}}}}, 119),
    ('kvv_99_assistant_only', {'messages': [{'role': 'assistant', 'content': '你好'}], 'reasoning_effort': 'high',
                               'temperature': 1, 'top_p': 0.95, 'n': 1}, 99),
    ('hello_thinking_off', {'messages': [{'role': 'user', 'content': 'hello'}], 'thinking': {'type': 'disabled'}}, 19),
    ('hello_thinking_on', {'messages': [{'role': 'user', 'content': 'hello'}]}, 86),
    ('effort_low_kwargs', {'messages': [{'role': 'system', 'content': 'You are Kimi.', 'name': 'sys&"x'},
                                        {'role': 'user', 'content': 'Say \'OK\' and nothing else.'}],
                           'chat_template_kwargs': {'thinking': True, 'thinking_effort': 'low'}}, None),
    ('reasoning_effort_none', {'messages': [{'role': 'user', 'content': 'hi'}], 'reasoning_effort': 'none'}, None),
    ('effort_object_wins', {'messages': [{'role': 'user', 'content': 'hi'}], 'reasoning_effort': 'max',
                            'thinking': {'type': 'enabled', 'effort': 'low', 'keep': 'all'}}, None),
    ('tools_required', {'messages': [{'role': 'user', 'content': 'Weather in Paris?'}], 'tools': [WEATHER],
                        'tool_choice': 'required'}, None),
    ('tool_choice_none_no_tools', {'messages': [{'role': 'user', 'content': 'x'}], 'tool_choice': 'none',
                                   'thinking': {'type': 'disabled'}}, None),
    ('json_object', {'messages': [{'role': 'user', 'content': 'json please'}],
                     'response_format': {'type': 'json_object'}}, None),
    ('history_tool_calls', {
        'tools': [STOCK],
        'messages': [
            {'role': 'system', 'content': '', 'tools': [WEATHER]},
            {'role': 'developer', 'content': 'Be brief.'},
            {'role': 'user', 'content': [{'type': 'text', 'text': 'Weather in Paris and '},
                                         {'type': 'text', 'text': 'AAPL price?'}]},
            {'role': 'assistant', 'content': None, 'reasoning_content': 'Two tools.',
             'tool_calls': [
                 {'id': 'call_a', 'type': 'function', 'function': {'name': 'get_weather', 'arguments':
                  '{"city": "Paris", "days": 3, "ratio": 1.0, "small": 1e-05, "ok": true, "none": null, '
                  '"tags": ["a", "b"], "opts": {"z": 1, "a": [1, 2]}, "q": "say \\"hi\\" & <|open|>"}'}},
                 {'id': 'call_b', 'type': 'function', 'function': {'name': 'get_stock_price',
                                                                   'arguments': '{"symbol":"AAPL"}'}},
                 {'id': 'call_c', 'type': 'function', 'function': {'name': 'get_weather', 'arguments': '{bad json'}},
                 {'id': 'call_d', 'type': 'function', 'function': {'name': 'get_weather', 'arguments': '  '}}]},
            {'role': 'tool', 'tool_call_id': 'call_b', 'content': '{"price": 189.5}'},
            {'role': 'tool', 'tool_call_id': 'call_d', 'content': 'n/a'},
            {'role': 'tool', 'tool_call_id': 'call_a', 'content': 'Sunny, 22°C'},
            {'role': 'tool', 'tool_call_id': 'call_c', 'content': 'error'},
            {'role': 'assistant', 'content': 'Paris is sunny; AAPL is 189.5.', 'reasoning_content': '   '},
            {'role': 'user', 'content': 'Thanks <|end_of_msg|> <|open|>'}],
        'tool_choice': 'auto',
        'response_format': {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {
            'type': 'object', 'properties': {'b': {'type': 'number', 'minimum': 0.5}, 'a': {'type': 'string'}}}}},
        'thinking': {'effort': 'high'}, 'max_completion_tokens': 1}, None),
    ('history_thinking_off', {
        'messages': [{'role': 'user', 'content': 'q'},
                     {'role': 'assistant', 'content': 'a', 'reasoning_content': 'dropped when off'},
                     {'role': 'user', 'content': 'q2', 'name': 'bob'}],
        'chat_template_kwargs': {'thinking': False}}, None),
    ('unmatched_tool_results', {
        'messages': [{'role': 'user', 'content': 'go'},
                     {'role': 'assistant', 'content': '', 'tool_calls': [
                         {'id': 'x1', 'type': 'function', 'function': {'name': 'f1', 'arguments': '{}'}},
                         {'id': 'x2', 'type': 'function', 'function': {'name': 'f2', 'arguments': '{"k":[]}'}}]},
                     {'role': 'tool', 'tool_call_id': 'zz', 'content': 'r1'},
                     {'role': 'tool', 'tool_call_id': 'x1', 'name': 'custom', 'content': 'r2'}]}, None),
    ('images', {'messages': [{'role': 'user', 'content': [
        {'type': 'text', 'text': 'Before '},
        {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,iVBORw0KGgo=', 'detail': 'low'}},
        {'type': 'text', 'text': ' between '},
        {'type': 'image_url', 'image_url': {'url': 'https://example.com/a.png'}},
        {'type': 'text', 'text': ' after.'}]}], 'thinking': {'type': 'disabled'}}, None),
    ('unicode_escapes', {'tools': [{'type': 'function', 'function': {
        'name': 'f', 'description': 'tab\there "q" \\ é 😀 \u0001 \u007f', 'parameters': {
            'type': 'object', 'properties': {'n': {'type': 'integer', 'maximum': 1e16, 'minimum': -0.0,
                                                   'multipleOf': 0.1, 'default': 12345678901234}}}}}],
        'messages': [{'role': 'user', 'content': '  spaced\n\n  '}]}, None),
]


def main():
    enc, specials = encoding()
    bad = 0
    lines = []
    for name, req, want in CASES:
        segs = render(req)
        ids = ids_of(enc, specials, segs)
        n = len(ids) - 3
        status = ''
        if want is not None:
            status = 'OK' if n == want else f'MISMATCH (want {want})'
            bad += n != want
        print(f'{name:28s} prompt_tokens={n:5d} {status}')
        lines.append(json.dumps({'name': name, 'request': req, 'prompt_tokens': n, 'ids': ids,
                                 'segments': [[t, s] for t, s in segs]}, ensure_ascii=False))
    if '--check' not in sys.argv:
        with open('tests/data/chat/k3_cases.jsonl', 'w', encoding='utf-8') as f:
            f.write('\n'.join(lines) + '\n')
    sys.exit(1 if bad else 0)


if __name__ == '__main__':
    main()
