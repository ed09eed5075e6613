#!/usr/bin/env python3
"""Generates tests/data/chat/json_py_cases.jsonl: inputs and Python json.dumps outputs that
src/text/json_py.c must match byte for byte. Run from the repository root; deterministic."""
import json, math, random, struct

cases = [
    'null', 'true', 'false', '0', '-1', '9223372036854775807', '-9223372036854775808',
    '1.0', '-0.0', '0.0', '100.0', '1e5', '1E+5', '0.1', '0.2', '0.30000000000000004', '1e-05',
    '0.0001', '0.00001', '1e-4', '1.5e-05', '123456789.123', '1e15', '1e16', '1e+16', '1.5e16',
    '9999999999999998', '1e22', '1e308', '1.7976931348623157e308', '5e-324', '2.2250738585072014e-308',
    '3.141592653589793', '-2.5', '1e-7', '12345678901234567890.0', '0.5e1',
    '""', '"plain"', '"quote \\" backslash \\\\ slash \\/"', '"\\n\\r\\t\\b\\f"',
    '"\\u0000\\u0001\\u001f\\u007f\\u0080"', '"ünïcödé 中文 😀"', '"\\ud83d\\ude00"', '"<|open|>"',
    '[]', '{}', '[1,2.0,"x",null,true,[{}]]',
    '{"b":1,"a":{"z":[1,{"y":2,"x":1}],"é":0,"A":1,"_":2},"中":3,"aa":4,"":5}',
    '{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string","description":"城市名称"}},"required":["city"]}}}',
]
rng = random.Random(1234)
for _ in range(300):
    bits = rng.getrandbits(64)
    x = struct.unpack('<d', struct.pack('<Q', bits))[0]
    if math.isfinite(x):
        cases.append(repr(x))
for _ in range(100):
    cases.append(repr(rng.uniform(-1000, 1000)))
    cases.append(repr(rng.random() * 10 ** rng.randint(-30, 30)))
    cases.append(repr(float(rng.randint(-10**17, 10**17))))

with open('tests/data/chat/json_py_cases.jsonl', 'w', encoding='utf-8') as f:
    for text in cases:
        v = json.loads(text)
        f.write(json.dumps({
            'input': text,
            'default': json.dumps(v, ensure_ascii=False),
            'compact': json.dumps(v, ensure_ascii=False, separators=(',', ':')),
            'sorted': json.dumps(v, ensure_ascii=False, separators=(',', ':'), sort_keys=True),
        }, ensure_ascii=False) + '\n')
print(len(cases), 'cases')
