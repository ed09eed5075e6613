"""Validates with Python jsonschema (Draft 2020-12) the outputs that the bundled random-weight model
produced under grammar constraints for every schema case (written by the C test
engine_grammar_every_schema_on_the_random_model into build/model_grammar_samples.jsonl)."""
import json
import os
import sys

import jsonschema
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from schema_wrap import wrap  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = os.path.join(ROOT, "build", "model_grammar_samples.jsonl")


def samples():
    if not os.path.exists(SAMPLES):
        return []
    return [json.loads(l) for l in open(SAMPLES, encoding="utf-8") if l.strip()]


def test_samples_exist():
    # every schema case as given and wrapped, plus json_object, less RangeConstraints:3 (refused): 2 * 91 + 1 - 2
    assert len(samples()) == 181, f"{SAMPLES}: run build/lunar_tests engine_grammar first"


@pytest.mark.parametrize("rec", samples(), ids=lambda r: f"{r['case']}{'-wrapped' if r['wrapped'] else ''}")
def test_sample_validates(rec):
    value = json.loads(rec["output"])
    schema = rec["schema"]
    if schema is None:  # json_object mode
        assert isinstance(value, dict)
        return
    jsonschema.Draft202012Validator(wrap(schema) if rec["wrapped"] else schema).validate(value)
