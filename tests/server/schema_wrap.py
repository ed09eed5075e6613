"""SPEC 6 / KVV (reference/kvv.md §4): a schema case used as a strict tool's parameters — wrapped as
{"value": S} with $defs/$id hoisted, a root self-reference redirected, and `default` removed."""
import copy


def strip_defaults(x):
    if isinstance(x, dict):
        return {k: strip_defaults(v) for k, v in x.items() if k != "default"}
    if isinstance(x, list):
        return [strip_defaults(v) for v in x]
    return x


def wrap(schema):
    s = copy.deepcopy(schema)
    w = {"type": "object", "required": ["value"], "additionalProperties": False, "properties": {"value": s}}
    if isinstance(s, dict):
        for k in ("$defs", "$id"):
            if k in s:
                w[k] = s.pop(k)
        if s.get("$ref") == "#":
            w.setdefault("$defs", {})["__case_schema"] = {k: v for k, v in s.items() if k != "$ref"}
            w["properties"]["value"] = {"$ref": "#/$defs/__case_schema"}
    return strip_defaults(w)
