"""The golden generators' safetensors writer (make_golden.py, tools/reference/make_k3_golden.py).

Why not the safetensors package: it orders __metadata__ keys by a randomised hash map, and golden files
must be byte-identical across reruns, so this writer sorts the header's keys."""
import json

import torch

_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int32: "I32", torch.uint8: "U8"}


def save_st(tensors, path, metadata):
    header, blobs, off = {"__metadata__": dict(sorted(metadata.items()))}, [], 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        b = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)
