"""Read back a W&B offline run (`run-*.wandb`) so tests can check what was logged, with no server.

The file is W&B's LevelDB-style record log (the format of the former `wandb.sdk.internal.datastore`, whose Python
reader wandb 0.2x+ no longer ships): a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of
records, each with a 7-byte header (crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) and a protobuf
`wandb_internal_pb2.Record` as payload.
"""

import glob
import json
import struct

from wandb.proto import wandb_internal_pb2 as pb


_BLOCK = 32768
_HEADER = 7


def _payloads(path):
    with open(path, "rb") as f:
        data = f.read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1 and version == 0, f"not a W&B run file: {path}"
    pos, parts = 7, []
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:  # block trailer: zero padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:
            break
        payload = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        parts.append(payload)
        if kind in (1, 4):  # FULL or LAST completes a record
            yield b"".join(parts)
            parts = []


def _key(item):
    return "/".join(item.nested_key) if item.nested_key else item.key


def read_offline_run(wandb_dir):
    """(config, history) of the single offline run under `wandb_dir`: config as a dict, history as a list of dicts."""
    (path,) = glob.glob(f"{wandb_dir}/**/offline-run-*/run-*.wandb", recursive=True)
    config, history = {}, []
    for payload in _payloads(path):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(it): json.loads(it.value_json) for it in record.history.item})
        elif kind == "config":
            for it in record.config.update:
                config[_key(it)] = json.loads(it.value_json)
    return config, history
