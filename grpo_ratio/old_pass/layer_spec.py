"""`guided_fp32_layers`: the layer specs the config accepts (indices, a list, one index, a calibration file written by
`grpo-ratio probe calibrate`) parsed into sorted decoder-layer indices, and the calibration file's metadata."""

from __future__ import annotations

import json
import os


_LAYER_FORMS = "comma-separated indices ('0,29'), a list ('[0, 29]'), one index (29) or a calibration .json path"


def read_calibration(path: str) -> dict:
    """The calibration JSON at `path` (written by `grpo-ratio probe layers`/`calibrate`), checked to hold a
    `guided_fp32_layers` list.

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: not JSON, or no `guided_fp32_layers` list in it.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"guided_fp32_layers: calibration file {path!r} does not exist")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"guided_fp32_layers: calibration file {path!r} is not JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("guided_fp32_layers"), list):
        raise ValueError(f"guided_fp32_layers: {path!r} has no 'guided_fp32_layers' list of layer indices")
    return data


def calibration_metadata(path: str, data: dict) -> dict:
    """What a calibration file says about the model it was measured on: `path`, `model` (the `--model` of the
    probe, or None) and `num_layers` (its decoder-layer count: recorded, else the length of its per-layer `ranking`
    or `increments`, else None). `grpo_ratio.checks.check_calibration` compares them with the trained model."""
    num_layers = data.get("num_layers")
    for key in ("ranking", "increments"):  # files written before num_layers was recorded: one entry per layer
        if num_layers is None and isinstance(data.get(key), list):
            num_layers = len(data[key])
    return {"path": path, "model": data.get("model"), "num_layers": num_layers, "source": data.get("source")}


def _is_calibration_path(text: str) -> bool:
    return text.endswith(".json") or os.path.sep in text or "/" in text


def _string_items(text: str) -> list:
    """Entries of a string `guided_fp32_layers`: a JSON-style list ('[0, 29]') or comma-separated ('0,29')."""
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"guided_fp32_layers={text!r} is not a valid list; expected {_LAYER_FORMS}") from None
        if not isinstance(items, list):
            raise ValueError(f"guided_fp32_layers={text!r}: expected {_LAYER_FORMS}")
        return items
    entries = [x.strip() for x in text.split(",")] if text else []
    if "" in entries:  # '0,,29' or '0,29,': a typo, not "no layer" (a silently dropped entry hides it)
        raise ValueError(f"guided_fp32_layers={text!r} has an empty entry; expected {_LAYER_FORMS}")
    return entries


def _layer_index(x) -> int:
    """One entry as a non-negative int: an int (not a bool) or the string of one (`"7"`, `"+7"`)."""
    if isinstance(x, bool) or not isinstance(x, (int, str)):
        raise ValueError(f"guided_fp32_layers: {x!r} is not an integer layer index")
    try:
        i = int(x)
    except ValueError:
        raise ValueError(f"guided_fp32_layers: {x!r} is not an integer layer index (a list is written \"0,29\", "
                         f"[0, 29] or a calibration JSON path)") from None
    if i < 0:
        raise ValueError(f"guided_fp32_layers: {x!r} is not a non-negative integer layer index")
    return i


def resolve_layer_spec(spec) -> tuple[list[int] | None, dict | None]:
    """`guided_fp32_layers` as (sorted distinct decoder-layer indices, calibration metadata or None).

    Accepts `None`; an int (a YAML `29`); a list/tuple of ints; a string of comma-separated ints (`"0,1,27"`) or a
    JSON-style list (`"[0, 29]"`); or the path of a calibration JSON written by `grpo-ratio probe layers`/`calibrate`
    (key `"guided_fp32_layers"`), whose metadata (`calibration_metadata`) comes back as the second item.

    Raises:
        ValueError: an entry is empty or not a non-negative integer, an index is listed twice, or the JSON file has
            no `guided_fp32_layers` list.
        FileNotFoundError: the value looks like a path (ends in `.json` or holds a `/`) but the file does not exist.
    """
    if spec is None:
        return None, None
    calibration = None
    if isinstance(spec, bool):
        raise ValueError(f"guided_fp32_layers must be {_LAYER_FORMS}, got {spec!r}")
    if isinstance(spec, int):
        items = [spec]
    elif isinstance(spec, (list, tuple)):
        items = list(spec)
    elif isinstance(spec, str) and _is_calibration_path(spec.strip()):
        path = spec.strip()
        data = read_calibration(path)
        items, calibration = data["guided_fp32_layers"], calibration_metadata(path, data)
    elif isinstance(spec, str):
        items = _string_items(spec.strip())
    else:
        raise ValueError(f"guided_fp32_layers must be {_LAYER_FORMS}, got {type(spec).__name__}")
    layers = []
    for x in items:
        i = _layer_index(x)
        if i in layers:
            raise ValueError(f"guided_fp32_layers: layer {i} is listed twice")
        layers.append(i)
    return sorted(layers), calibration


def parse_layer_spec(spec) -> list[int] | None:
    """Turn a `guided_fp32_layers` value into a sorted list of distinct decoder-layer indices (the forms and errors
    of `resolve_layer_spec`)."""
    return resolve_layer_spec(spec)[0]
