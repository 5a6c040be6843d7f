"""Which weight format a checkpoint's quantization config names, what is wrong with it here, and which
modules it leaves unquantized. Reads the three published shapes:

    block FP8            config.json quantization_config {"quant_method": "fp8", ...}  (fp8_block.py)
    ModelOpt NVFP4       {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                         "exclude_modules": [fnmatch wildcards]}, in config.json or as hf_quant_config.json's
                         {"producer": ..., "quantization": {...}} beside it (from_hf_quant_config)
    compressed-tensors   {"quant_method": "compressed-tensors", "format": ..., "config_groups": {name:
                         {"targets": [...], "weights": {num_bits, type, strategy, group_size, symmetric},
                         "input_activations": ... | null, "format": ...}}, "ignore": [names, "re:" regexes]}
                         with format "nvfp4-pack-quantized" (type float, strategy tensor_group, group 16)
                         or "pack-quantized" (type int, 4 bits, strategy group, group 128 or 32, symmetric
                         or not: `symmetric: false` stores a zero point per group)

    format_of(qc) -> the quant/registry name ("fp8", "nvfp4", "int4", "int4-g32", "int4-asym",
                     "int4-g32-asym") or None (not one of ours)
    layout(qc)    -> "fp8", "modelopt" or "compressed-tensors" (which tensor names to read)
    problems(qc, name) -> one line per problem
    excluded(qc, module) -> the module is stored unquantized
    activation_scales(qc) -> the config quantizes activations too (read as weight-only: said once at load)
"""

from __future__ import annotations

import fnmatch
import re

CT_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "pack-quantized": "int4"}


def from_hf_quant_config(hq: object) -> dict | None:
    """hf_quant_config.json (ModelOpt's file beside config.json) -> a quantization_config dict."""
    if not isinstance(hq, dict) or not isinstance(hq.get("quantization"), dict):
        return None
    return {"quant_method": "modelopt", **hq["quantization"]}


def _modelopt(qc: dict) -> dict:
    inner = qc.get("quantization")  # some exports nest hf_quant_config's block inside config.json
    return {**qc, **inner} if isinstance(inner, dict) else qc


def _ct_weights(qc: dict) -> tuple[list[dict], list[dict], list[str]]:
    """compressed-tensors: (weights schemes, group configs, problems) of its config groups."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return [], [], ["quantization_config.config_groups is missing or empty (compressed-tensors needs one "
                        "group with its weights scheme)"]
    cfgs = [g for g in groups.values() if isinstance(g, dict)]
    schemes = [g.get("weights") for g in cfgs if isinstance(g.get("weights"), dict)]
    return schemes, cfgs, ([] if schemes else ["quantization_config.config_groups has no weights scheme"])


def format_of(qc: object) -> str | None:
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return "fp8"
    if method == "modelopt":
        return "nvfp4" if str(_modelopt(qc).get("quant_algo", "")).upper() == "NVFP4" else None
    if method == "compressed-tensors":
        schemes, cfgs, _ = _ct_weights(qc)
        fmt = qc.get("format") or next((g.get("format") for g in cfgs if g.get("format")), None)
        name = CT_FORMATS.get(fmt)
        if name == "int4" and schemes:
            name += "-g32" if schemes[0].get("group_size") == 32 else ""
            name += "-asym" if schemes[0].get("symmetric", True) is False else ""
        return name
    return None


def example(name: str) -> dict:
    """A quantization_config of format `name` as the published tools write it (random-weight beds and
    the plan of a preset in that format; make-checkpoint writes its own exclusion lists)."""
    if name == "fp8":
        from moetier.quant.fp8_block import QUANT_CONFIG

        return dict(QUANT_CONFIG)
    if name == "nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32 if "g32" in name else 128,
               "symmetric": not name.endswith("-asym")}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


def unsupported(qc: object) -> list[str]:
    """The one line for a quantization_config that names none of the formats here (format_of: None)."""
    if not isinstance(qc, dict):
        return [f"quantization_config must be an object, got {qc!r}"]
    method = qc.get("quant_method")
    known = ("block FP8 (quant_method \"fp8\"), NVFP4 (\"modelopt\" with quant_algo NVFP4, or compressed-tensors "
             "\"nvfp4-pack-quantized\") and INT4 (compressed-tensors \"pack-quantized\")")
    if method == "modelopt":
        return [f"quantization_config.quant_algo {_modelopt(qc).get('quant_algo')!r} is not supported; this engine "
                f"reads {known}"]
    if method == "compressed-tensors":
        fmt = qc.get("format") or next((g.get("format") for g in _ct_weights(qc)[1] if g.get("format")), None)
        return [f"quantization_config.format {fmt!r} (compressed-tensors) is not supported; this engine reads {known}"]
    return [f"quantization_config.quant_method {method!r} is not supported; this engine reads {known}"]


def layout(qc: object) -> str:
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return {"fp8": "fp8", "modelopt": "modelopt"}.get(method, "compressed-tensors")


def problems(qc: object, name: str) -> list[str]:
    """What is wrong with qc as a config of format `name` ("nvfp4" or one of the INT4 names)."""
    if not isinstance(qc, dict):
        return [f"quantization_config must be an object, got {qc!r}"]
    if format_of(qc) != name:
        return [f"quantization_config does not describe {name} weights"]
    if qc.get("quant_method") == "modelopt":
        m = _modelopt(qc)
        out = [] if m.get("group_size", 16) == 16 else [
            f"quantization_config.group_size {m.get('group_size')!r} is not supported (NVFP4 groups are 16)"]
        if not isinstance(m.get("exclude_modules", []), list):
            out.append("quantization_config.exclude_modules must be a list of module names or wildcards")
        return out
    schemes, _, out = _ct_weights(qc)
    want = ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16} if name == "nvfp4"
            else {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32 if "g32" in name else 128,
                  "symmetric": not name.endswith("-asym")})
    for s in schemes:
        for key, value in want.items():
            if s.get(key, True if key == "symmetric" else None) != value:
                out.append(f"quantization_config weights.{key} {s.get(key)!r} is not supported for {name} "
                           f"(want {value!r})")
    if not isinstance(qc.get("ignore", []), list):
        out.append("quantization_config.ignore must be a list of module names or \"re:\" patterns")
    return sorted(set(out), key=out.index)


def excluded(qc: dict, module: str) -> bool:
    """The module (a checkpoint name without `.weight`) is left unquantized by this config."""
    if qc.get("quant_method") == "modelopt":
        return any(fnmatch.fnmatchcase(module, p) for p in _modelopt(qc).get("exclude_modules") or [])
    for p in qc.get("ignore") or []:
        if p.startswith("re:") and re.match(p[3:], module) or p == module:
            return True
    return False


def activation_scales(qc: dict) -> bool:
    if qc.get("quant_method") == "modelopt":
        return False  # ModelOpt states none: its W4A4 checkpoints carry input_scale tensors (the loader looks)
    _, cfgs, _ = _ct_weights(qc)
    return any(g.get("input_activations") for g in cfgs)
