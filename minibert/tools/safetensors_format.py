"""The safetensors file format, read and written in 70 lines (HuggingFace's weights files).

A .safetensors file is three parts, back to back:

    [8 bytes]   N, the header's length, an unsigned little-endian integer
    [N bytes]   a JSON header: {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
                                ..., "__metadata__": {"format": "pt"}}
    [the rest]  the tensors' raw bytes, row-major, little-endian; [begin, end) counts from the first
                byte after the header

Nothing in it is code, so reading one can never run anything (unlike a pickle). The `safetensors`
package reads it too; it is not a minibert dependency because the format is this small. The module is
not named `safetensors.py` on purpose: a script run from minibert/ would then shadow the real package
for every library that imports it."""
import json
import math

import torch

from minibert.atomic import atomic_write_bytes
from minibert.errors import UsageError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path: str) -> dict:
    """A .safetensors file -> {name: CPU tensor}. A malformed file raises UsageError naming it."""
    def corrupt(why):
        return UsageError(f"{path} is not a valid safetensors file ({why}); re-save or re-download it")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e}")
    if len(data) < 8:
        raise corrupt("shorter than its 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        raise corrupt(f"header length {n} runs past the end of the file")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise corrupt(f"header is not JSON: {e}")
    body = memoryview(data)[8 + n:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise corrupt(f"{name}: unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        shape = info["shape"]
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != nbytes or not 0 <= begin <= end <= len(body):
            raise corrupt(f"{name}: data_offsets {info['data_offsets']} do not fit shape {shape}")
        raw = bytearray(body[begin:end])  # a copy: writable and aligned for frombuffer
        tensors[name] = torch.frombuffer(raw, dtype=dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
    return tensors


def write_safetensors(path: str, tensors: dict) -> None:
    """{name: tensor} -> a .safetensors file, written to a temporary name and renamed (never half-written)."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0  # transformers wants format "pt"
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()  # row-major bytes of any dtype
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # pad so the tensor data starts 8-byte aligned
    atomic_write_bytes(path, [len(text).to_bytes(8, "little"), text, *blobs])
