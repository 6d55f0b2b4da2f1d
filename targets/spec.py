"""Accelerator target specs: what capacity planning needs to know about a device, loaded from JSON.

A spec file is one JSON object (``targets/<name>.json`` ships h200, b200, example_accel_64gb)::

    {"name": "h200", "memory_bytes": 141000000000, "mem_bandwidth_gbps": 4800,
     "native_dtypes": ["bf16", "fp8_e4m3", ...], "fp4_compute": false,
     "reserved_bytes": 2000000000,          # optional: runtime/driver memory not available to the model
     "compute_dtype": "bf16",               # optional: what low-precision experts are converted to and computed
                                            # in when the target has no FP4 compute: fp32 | bf16 | fp8_e4m3
                                            # (default bf16 if native, else fp32; the host CPU computes in fp32)
     "description": "..."}                  # optional

``mem_bandwidth_gbps`` is in GB/s (10^9 bytes per second). A malformed file is a UserError naming the file and
the field.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dayzero import UserError
from dayzero.targets.json_file import read_json_file

SPEC_DIR = Path(__file__).resolve().parent

# expert workspace dtypes (passes/expert_workspace.py): the name a target spec uses -> the IR dtype
COMPUTE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn"}
HOST_COMPUTE_DTYPE = "fp32"

KNOWN_DTYPES = {"fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "mxfp4", "nvfp4", "int8", "int4"}


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    name: str
    memory_bytes: int
    native_dtypes: tuple
    fp4_compute: bool
    mem_bandwidth_gbps: float
    reserved_bytes: int = 0
    description: str = ""
    compute_dtype: str = "fp32"

    @property
    def usable_bytes(self) -> int:
        """Memory the model may use: total minus the runtime's reserve."""
        return self.memory_bytes - self.reserved_bytes

    @property
    def fp8_compute(self) -> bool:
        return any(d.startswith("fp8") for d in self.native_dtypes)

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> "TargetSpec":
        """Validate ``data`` field by field; every problem is a UserError naming ``source`` and the field."""

        def bad(field, why):
            return UserError(f"target spec {source}: field '{field}' {why}")

        if not isinstance(data, dict):
            raise UserError(f"target spec {source}: expected a JSON object, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise bad(unknown[0], f"is not a spec field (fields: {', '.join(fields)})")
        for f in ("name", "memory_bytes", "native_dtypes", "fp4_compute", "mem_bandwidth_gbps"):
            if f not in data:
                raise bad(f, "is missing")

        def positive_int(field, allow_zero=False):
            v = data.get(field, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (v == 0 and not allow_zero):
                raise bad(field, f"must be a {'non-negative' if allow_zero else 'positive'} integer, got {v!r}")
            return v

        name = data["name"]
        if not isinstance(name, str) or not name:
            raise bad("name", f"must be a non-empty string, got {name!r}")
        memory = positive_int("memory_bytes")
        reserved = positive_int("reserved_bytes", allow_zero=True)
        if reserved >= memory:
            raise bad("reserved_bytes", f"({reserved}) must be below memory_bytes ({memory})")
        bw = data["mem_bandwidth_gbps"]
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or bw <= 0:
            raise bad("mem_bandwidth_gbps", f"must be a positive number (GB/s), got {bw!r}")
        dtypes = data["native_dtypes"]
        if not isinstance(dtypes, list) or not dtypes or not all(isinstance(d, str) for d in dtypes):
            raise bad("native_dtypes", f"must be a non-empty list of strings, got {dtypes!r}")
        odd = [d for d in dtypes if d not in KNOWN_DTYPES]
        if odd:
            raise bad("native_dtypes", f"has unknown dtype(s) {odd} (known: {', '.join(sorted(KNOWN_DTYPES))})")
        fp4 = data["fp4_compute"]
        if not isinstance(fp4, bool):
            raise bad("fp4_compute", f"must be true or false, got {fp4!r}")
        desc = data.get("description", "")
        if not isinstance(desc, str):
            raise bad("description", "must be a string")
        cd = data.get("compute_dtype", "bf16" if "bf16" in dtypes else "fp32")
        if cd not in COMPUTE_DTYPES:
            raise bad("compute_dtype", f"must be one of {', '.join(COMPUTE_DTYPES)}, got {cd!r}")
        if cd not in dtypes:
            raise bad("compute_dtype", f"({cd}) is not among the target's native_dtypes")
        return cls(name, memory, tuple(dtypes), fp4, float(bw), reserved, desc, cd)


def available_targets() -> list[str]:
    return sorted(p.stem for p in SPEC_DIR.glob("*.json"))


def load_target_spec(name_or_path: str | Path) -> TargetSpec:
    """Load ``targets/<name>.json`` for a bare name, or the JSON file at a path; ``host``: this machine's CPU."""
    from dayzero.targets.host import HOST_TARGET, host_spec

    text = str(name_or_path)
    if text == HOST_TARGET:
        return host_spec()
    path = Path(text)
    if not (text.endswith(".json") or path.exists()):
        path = SPEC_DIR / f"{text}.json"
        if not path.is_file():
            raise UserError(f"unknown target '{text}': known targets are {', '.join(available_targets())}, host, or give a "
                            "path")
    return TargetSpec.from_dict(read_json_file(path, "target spec"), source=str(path))
