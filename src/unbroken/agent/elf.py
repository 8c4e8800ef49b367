"""Just enough ELF64 to attach uprobes well: a function's file offset and its first bytes.

The first instruction decides the cost of a uprobe (docs/agent.md): `push` and `nop` are
emulated (well under a microsecond), most others are single-stepped out of line (15+ µs in a
VM). An `endbr64` prologue followed by a push is probed just after the `endbr64`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Probe", "function_offsets", "plan_probe"]

ENDBR64 = b"\xf3\x0f\x1e\xfa"


def _is_cheap(code: bytes) -> str | None:
    """Name of a cheaply-probed first instruction, or None."""
    if not code:
        return None
    b0 = code[0]
    if 0x50 <= b0 <= 0x57:
        return "push"
    if b0 == 0x41 and len(code) > 1 and 0x50 <= code[1] <= 0x57:
        return "push"
    if b0 == 0x90 or code[:2] == b"\x0f\x1f" or code[:3] == b"\x66\x0f\x1f":
        return "nop"
    return None


@dataclass(frozen=True)
class Probe:
    function: str
    offset: int  # file offset to attach at
    prologue: str  # e.g. "push", "endbr64+push", "lea"
    cheap: bool


def plan_probe(function: str, offset: int, code: bytes) -> Probe:
    if code.startswith(ENDBR64):
        kind = _is_cheap(code[4:])
        if kind:
            return Probe(function, offset + 4, f"endbr64+{kind}", True)
        return Probe(function, offset, f"endbr64+{code[4:5].hex()}", False)
    kind = _is_cheap(code)
    if kind:
        return Probe(function, offset, kind, True)
    return Probe(function, offset, code[:3].hex(), False)


def function_offsets(path: Path, names: set[str]) -> dict[str, tuple[int, bytes]]:
    """{name: (file offset, first 16 bytes)} for the defined functions among `names`."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path} is not a 64-bit ELF file")
    (e_phoff, e_shoff) = struct.unpack_from("<QQ", data, 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", data, 0x36)
    segs = []
    for i in range(e_phnum):
        p_type, _flags, p_offset, p_vaddr, _pa, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, e_phoff + i * e_phentsize
        )
        if p_type == 1:  # PT_LOAD
            segs.append((p_vaddr, p_offset, p_filesz))
    sections = []
    for i in range(e_shnum):
        (_name, sh_type, _f, _a, sh_offset, sh_size, sh_link, _info, _al, sh_entsize) = (
            struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize)
        )
        sections.append((sh_type, sh_offset, sh_size, sh_link, sh_entsize))
    out: dict[str, tuple[int, bytes]] = {}
    for sh_type, off, size, link, entsize in sections:
        if sh_type not in (2, 11) or not entsize:  # SHT_SYMTAB, SHT_DYNSYM
            continue
        str_off = sections[link][1]
        for j in range(size // entsize):
            st_name, st_info, _other, st_shndx, st_value, _size = struct.unpack_from(
                "<IBBHQQ", data, off + j * entsize
            )
            if (st_info & 0xF) != 2 or st_shndx == 0 or st_value == 0:  # STT_FUNC, defined
                continue
            end = data.index(b"\0", str_off + st_name)
            name = data[str_off + st_name : end].decode(errors="replace")
            if name not in names or name in out:
                continue
            for vaddr, foff, fsz in segs:
                if vaddr <= st_value < vaddr + fsz:
                    fo = st_value - vaddr + foff
                    out[name] = (fo, data[fo : fo + 16])
                    break
    return out
