"""Validate objects of custom kinds against the CRD schemas kept in `crds/`, as strictly as
an API server with strict field validation (`kubectl apply`'s default since 1.27) would.

The CRD's `openAPIV3Schema` is a structural schema: an API server rejects (strict) or prunes
fields it does not declare, except under `x-kubernetes-preserve-unknown-fields` or an
`additionalProperties` schema. JSON Schema allows any extra field unless told otherwise, so
`strict_schema` adds `additionalProperties: false` wherever the server would refuse one.
Integers are JSON integers only (an API server refuses 1.5, and 2.0 as an int32 field would
not round-trip through YAML as one), and `format: int32/int64` ranges are checked.
`x-kubernetes-validations` (CEL) rules cannot be run here: those this module knows are
checked by an equivalent Python predicate, and an unknown rule fails validation, so a newer
CRD with new rules is noticed instead of silently passing. `metadata` is ObjectMeta, which a
CRD does not describe: check it with the built-in schema (the tests wrap it in a ConfigMap).

jsonschema is imported when a validation runs: it comes with the development extras
(kubernetes-validate), not with the package.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "CRD_DIR",
    "KEDA_SCALEDOBJECTS",
    "crd_body_sha256",
    "load_crd",
    "strict_schema",
    "validate",
]

Obj = dict[str, Any]

CRD_DIR = Path(__file__).parent / "crds"
KEDA_SCALEDOBJECTS = CRD_DIR / "keda-2.20.2-scaledobjects.yaml"

_INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def _min_le_max(spec: Obj) -> bool:
    """ScaledObject: `minReplicaCount <= maxReplicaCount`, max defaulting to 100."""
    if "minReplicaCount" not in spec:
        return True
    return spec["minReplicaCount"] <= spec.get("maxReplicaCount", 100)


# CEL rule text (whitespace collapsed) -> the same check in Python.
KNOWN_RULES: dict[str, Callable[[Any], bool]] = {
    "!has(self.minReplicaCount) || self.minReplicaCount <= (has(self.maxReplicaCount) "
    "? self.maxReplicaCount : 100)": _min_le_max,
}


def _squash(rule: str) -> str:
    return re.sub(r"\s+", " ", rule).strip()


@functools.cache
def load_crd(path: Path) -> Obj:
    """The CRD document of a file (its header comment is YAML comment)."""
    crd = yaml.safe_load(path.read_text())
    if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"{path}: not a CustomResourceDefinition")
    return crd


def crd_body_sha256(path: Path) -> tuple[str, str]:
    """(the sha256 the header records, the sha256 of the text after the header): a CRD edited
    by hand after it was copied from its source no longer matches its header."""
    import hashlib

    text = path.read_text()
    header = [ln for ln in text.splitlines() if ln.startswith("#")]
    recorded = next((ln.rsplit(":", 1)[1].strip() for ln in header if "sha256" in ln), "")
    body = text[text.index("\n---") + 1 :]
    return recorded, hashlib.sha256(body.encode()).hexdigest()


def strict_schema(schema: Obj) -> Obj:
    """A copy of a structural schema in which every object that an API server would not let
    carry unknown fields has `additionalProperties: false`."""
    out: Obj = {}
    for k, v in schema.items():
        if k in ("properties", "patternProperties", "definitions"):
            out[k] = {name: strict_schema(s) for name, s in v.items()}
        elif k in ("items", "additionalProperties", "not") and isinstance(v, dict):
            out[k] = strict_schema(v)
        elif k in ("anyOf", "allOf", "oneOf"):
            out[k] = [strict_schema(s) for s in v]
        else:
            out[k] = v
    open_ = schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema
    if schema.get("type") == "object" and "properties" in schema and not open_:
        out["additionalProperties"] = False
    return out


def _rules(schema: Obj, value: Any, path: str) -> Iterator[str]:
    """Every `x-kubernetes-validations` rule along the value, checked (see KNOWN_RULES)."""
    for rule in schema.get("x-kubernetes-validations", []):
        check = KNOWN_RULES.get(_squash(rule["rule"]))
        if check is None:
            yield f"{path or '.'}: CEL rule this validator cannot check: {rule['rule']!r}"
        elif not check(value):
            yield f"{path or '.'}: {rule.get('message', rule['rule'])}"
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                yield from _rules(sub, value[name], f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _rules(schema["items"], item, f"{path}[{i}]")


def _validator(schema: Obj) -> Any:
    import jsonschema

    def is_int(_: Any, x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    types = jsonschema.Draft7Validator.TYPE_CHECKER.redefine("integer", is_int)
    formats = jsonschema.FormatChecker()
    for fmt, (lo, hi) in _INT_RANGE.items():
        formats.checks(fmt)(lambda x, lo=lo, hi=hi: not is_int(None, x) or lo <= x <= hi)
    cls = jsonschema.validators.extend(jsonschema.Draft7Validator, type_checker=types)
    return cls(schema, format_checker=formats)


def validate(obj: Obj, crd_path: Path) -> list[str]:
    """Every way `obj` breaks the CRD, as `path: message`; empty when it is valid."""
    crd = load_crd(crd_path)
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    errors: list[str] = []
    api = obj.get("apiVersion", "")
    versions = {f"{group}/{v['name']}": v for v in crd["spec"]["versions"] if v.get("served")}
    if obj.get("kind") != kind:
        errors.append(f"kind {obj.get('kind')!r} is not {kind!r}")
    if api not in versions:
        return [*errors, f"apiVersion {api!r} is not one of {sorted(versions)}"]
    schema = versions[api]["schema"]["openAPIV3Schema"]
    for e in sorted(_validator(strict_schema(schema)).iter_errors(obj), key=str):
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        errors.append(f"{where or '.'}: {e.message}")
    if not errors:  # CEL rules see typed values: only once the schema holds
        errors += _rules(schema, obj, "")
    return errors
