#!/usr/bin/env python3
"""Validates grammar-constrained outputs with Python jsonschema (Draft 2020-12).

  python3 tools/grammar/validate.py samples FILE   # FILE: JSON lines {"case","wrap","schema","done","text"}
                                                   # written by build/lunar_tests grammar_cases
                                                   # (default /tmp/lunar_grammar_samples.jsonl)
  python3 tools/grammar/validate.py instances      # the hand-written instances of
                                                   # tests/data/grammar/instances.jsonl are (in)valid
Exit status 0 when everything checks out."""
import json
import sys

from jsonschema import Draft202012Validator

CASES = "tests/data/json-schema-cases"
DIRS = ["AdditionalProperties", "AnyOf", "BasicTypes", "Defs", "RangeConstraints", "References", "Required",
        "SingleTypeInArray"]


def wrap(s):
    """SPEC 6: S as a strict tool's parameters ($defs/$id hoisted, default removed)."""
    s = dict(s)
    w = {"type": "object", "required": ["value"], "additionalProperties": False}
    defs, sid = s.pop("$defs", None), s.pop("$id", None)
    s.pop("default", None)
    w["properties"] = {"value": s}
    if defs is not None:
        w["$defs"] = defs
    if sid is not None:
        w["$id"] = sid
    return w


def load_cases():
    out = {}
    for d in DIRS:
        with open(f"{CASES}/{d}/valid.jsonl") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    out[f"{d}:{i}"] = json.loads(line)
    out["json_object"] = {"type": "object"}
    return out


def samples(path):
    n = bad = undone = 0
    for line in open(path):
        rec = json.loads(line)
        n += 1
        if not rec["done"]:
            undone += 1
            print(f"not finished: {rec['case']} wrap={rec['wrap']}")
            continue
        try:
            inst = json.loads(rec["text"])
            errs = list(Draft202012Validator(rec["schema"]).iter_errors(inst))
        except Exception as e:  # noqa: BLE001
            errs = [e]
        if errs:
            bad += 1
            print(f"INVALID {rec['case']} wrap={rec['wrap']}: {rec['text'][:200]!r}: {errs[0]}")
    print(f"{n} samples: {n - bad - undone} valid, {bad} invalid, {undone} not finished")
    return bad == 0


def instances():
    cases = load_cases()
    ok = True
    n = 0
    for line in open("tests/data/grammar/instances.jsonl"):
        rec = json.loads(line)
        s = cases[rec["case"]]
        variants = [(s, lambda t: t)]
        if '"#"' not in json.dumps(s) and rec["case"] != "json_object":
            variants.append((wrap(s), lambda t: '{"value":' + t + '}'))
        for schema, f in variants:
            v = Draft202012Validator(schema)
            for kind in ("valid", "invalid"):
                for t in rec.get(kind, []):
                    n += 1
                    good = v.is_valid(json.loads(f(t)))
                    if good != (kind == "valid"):  # "outside" ones are not checked here
                        ok = False
                        print(f"{rec['case']}: {f(t)} expected {kind}")
    print(f"{n} instance checks, {'all as expected' if ok else 'MISMATCHES'}")
    return ok


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "instances":
        sys.exit(0 if instances() else 1)
    if len(sys.argv) >= 2 and sys.argv[1] == "samples":
        sys.exit(0 if samples(sys.argv[2] if len(sys.argv) > 2 else "/tmp/lunar_grammar_samples.jsonl") else 1)
    print(__doc__)
    sys.exit(2)
