#!/usr/bin/env python3
"""Regenerates the broken-input corpora in tests/corpus/{safetensors,config}/ (run from the repo root).

Every file must be rejected cleanly by the parser, except files named ok_*, which must load.
The same directories seed the libFuzzer targets (tests/fuzz/)."""
import json
import os
import struct

ST = "tests/corpus/safetensors"
CF = "tests/corpus/config"


def st_image(header, data_len, hlen=None):
    h = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(h) if hlen is None else hlen) + h + bytes(data_len)


def entry(dtype="BF16", shape=(4, 8), off=(0, 64)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(off)}


def hdr(**tensors):
    return json.dumps(tensors)


def safetensors():
    w = lambda **kw: hdr(w=entry(**kw))  # noqa: E731
    files = {
        "ok_minimal.safetensors": st_image(w(), 64),
        "ok_no_tensors.safetensors": st_image('{"__metadata__":{"format":"pt"}}', 0),
        "empty.safetensors": b"",
        "short7.safetensors": b"\x08\0\0\0\0\0\0",
        "huge_header_len.safetensors": st_image("{}", 0, hlen=0xFFFFFFFFFFFFFFFF),
        "header_len_200mb.safetensors": st_image("{}", 0, hlen=200 << 20),
        "header_past_end.safetensors": st_image(w(), 0, hlen=1000),
        "truncated_data.safetensors": st_image(w(), 32),
        "negative_shape.safetensors": st_image(w(shape=(-4, -8)), 64),
        "float_shape.safetensors": st_image(w(shape=(4.0, 8)), 64),
        "string_shape.safetensors": st_image(w(shape=("4", 8)), 64),
        "five_dims.safetensors": st_image(w(shape=(1, 1, 1, 4, 8)), 64),
        "shape_overflow.safetensors": st_image(w(shape=(1 << 32, 1 << 32, 1 << 32), off=(0, 0)), 0),
        "offsets_past_end.safetensors": st_image(w(off=(64, 128)), 64),
        "offsets_reversed.safetensors": st_image(w(off=(64, 0)), 64),
        "offsets_mismatch.safetensors": st_image(w(off=(0, 100)), 100),
        "offsets_negative.safetensors": st_image(w(off=(-64, 0)), 64),
        "offsets_huge.safetensors": st_image(w(off=(2**63 - 1, 2**63 - 1)), 64),
        "offsets_three.safetensors": st_image(w(off=(0, 32, 64)), 64),
        "bad_dtype.safetensors": st_image(w(dtype="BF17"), 64),
        "lowercase_dtype.safetensors": st_image(w(dtype="bf16"), 64),
        "missing_dtype.safetensors": st_image(hdr(w={"shape": [4, 8], "data_offsets": [0, 64]}), 64),
        "bad_utf8.safetensors": st_image(b'{"w\xff\xfe":' + w()[5:].encode(), 64),
        "deep_nesting.safetensors": st_image('{"w":' + "[" * 5000 + "]" * 5000 + "}", 0),
        "not_object.safetensors": st_image("[1,2,3]", 0),
        "invalid_json.safetensors": st_image('{"w": {"dtype": "BF16",', 64),
        "nul_in_header.safetensors": st_image(b'{"w\0": 1}', 0),
        "metadata_nonstring.safetensors": st_image('{"__metadata__":{"format":1}}', 0),
        "overlap.safetensors": st_image(hdr(a=entry("U8", (4,), (0, 4)), b=entry("U8", (4,), (2, 6))), 8),
        "duplicate_name.safetensors": st_image(
            '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', 2),
        "entry_not_object.safetensors": st_image('{"w": [0, 64]}', 64),
        "huge_int.safetensors": st_image(w(off=(0, 99999999999999999999999)), 64),
    }
    return files


def config():
    base = json.load(open("configs/kimi-linear-48b-a3b.json"))

    def mod(**changes):
        c = json.loads(json.dumps(base))
        for k, v in changes.items():
            path = k.split("__")
            d = c
            for p in path[:-1]:
                d = d[p]
            if v is DELETE:
                del d[path[-1]]
            else:
                d[path[-1]] = v
        return json.dumps(c, indent=1).encode()

    lac = base["linear_attn_config"]
    files = {
        "ok_48b.json": mod(),
        "ok_minimal_defaults.json": b'{"model_type":"kimi_linear","vocab_size":8,"hidden_size":8,'
                                    b'"num_hidden_layers":2,"intermediate_size":8,"num_attention_heads":1}',
        "empty.json": b"",
        "not_object.json": b"[1, 2]",
        "invalid.json": mod()[:-40],
        "bad_utf8.json": mod().replace(b'"silu"', b'"\xc3\x28"'),
        "deep_nesting.json": b'{"model_type":"kimi_linear","x":' + b"[" * 5000 + b"]" * 5000 + b"}",
        "missing_model_type.json": mod(model_type=DELETE),
        "unknown_model_type.json": mod(model_type="llama"),
        "string_heads.json": mod(linear_attn_config__num_heads="32"),
        "negative_hidden.json": mod(hidden_size=-2304),
        "zero_layers.json": mod(num_hidden_layers=0),
        "too_many_layers.json": mod(num_hidden_layers=300),
        "float_layers.json": mod(num_hidden_layers=27.5),
        "kda_layer_out_of_range.json": mod(linear_attn_config__kda_layers=lac["kda_layers"] + [28]),
        "kda_layer_zero.json": mod(linear_attn_config__kda_layers=[0] + lac["kda_layers"]),
        "layer_twice.json": mod(linear_attn_config__kda_layers=lac["kda_layers"] + [4]),
        "layer_gap.json": mod(linear_attn_config__kda_layers=lac["kda_layers"][1:]),
        "topk_gt_experts.json": mod(num_experts_per_token=300),
        "kv_heads_mismatch.json": mod(num_key_value_heads=8),
        "bool_as_int.json": mod(tie_word_embeddings=0),
        "text_config_not_object.json": b'{"model_type":"kimi_k3","text_config":[]}',
        "k3_missing_hidden.json": b'{"model_type":"kimi_k3","text_config":{"vocab_size":8}}',
        "huge_int.json": mod().replace(b'"hidden_size": 2304', b'"hidden_size": 99999999999999999999999'),
        "int_overflow.json": mod(hidden_size=2**40),
        "nan.json": mod().replace(b'"rms_norm_eps": 1e-05', b'"rms_norm_eps": NaN'),
        "duplicate_key.json": mod().replace(b'"vocab_size": 163840', b'"vocab_size": 163840, "vocab_size": 1'),
    }
    return files


DELETE = object()


def write(d, files):
    os.makedirs(d, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    write(ST, safetensors())
    write(CF, config())
    print(len(os.listdir(ST)), "safetensors files,", len(os.listdir(CF)), "config files")
