"""Validates with Python jsonschema (Draft 2020-12) the outputs that the bundled random-weight model
produced under grammar constraints for every schema case (written by the C test
engine_grammar_every_schema_on_the_random_model into build/model_grammar_samples.jsonl)."""
import copy
import json
import os

import jsonschema
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = os.path.join(ROOT, "build", "model_grammar_samples.jsonl")


def wrap(schema):
    """SPEC 6: the case as a strict tool's parameters ($defs/$id hoisted, default removed)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "default"}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    s = copy.deepcopy(schema)
    w = {"type": "object", "required": ["value"], "additionalProperties": False, "properties": {"value": s}}
    if isinstance(s, dict):
        for k in ("$defs", "$id"):
            if k in s:
                w[k] = s.pop(k)
        if s.get("$ref") == "#":
            w.setdefault("$defs", {})["__case_schema"] = {k: v for k, v in s.items() if k != "$ref"}
            w["properties"]["value"] = {"$ref": "#/$defs/__case_schema"}
    return strip(w)


def samples():
    if not os.path.exists(SAMPLES):
        return []
    return [json.loads(l) for l in open(SAMPLES, encoding="utf-8") if l.strip()]


def test_samples_exist():
    assert len(samples()) >= 100, f"{SAMPLES}: run build/lunar_tests engine_grammar first"


@pytest.mark.parametrize("rec", samples(), ids=lambda r: f"{r['case']}{'-wrapped' if r['wrapped'] else ''}")
def test_sample_validates(rec):
    value = json.loads(rec["output"])
    schema = rec["schema"]
    if schema is None:  # json_object mode
        assert isinstance(value, dict)
        return
    jsonschema.Draft202012Validator(wrap(schema) if rec["wrapped"] else schema).validate(value)
