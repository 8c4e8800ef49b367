"""A thin, typed ctypes layer over the system libbpf (libbpf.so.1): open, load, attach,
read maps, detach. No mature Python binding exists (see docs/agent.md); this is the part we
use, and nothing more.

Errors from libbpf become `BpfError` with errno and libbpf's own log lines.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["BpfError", "Link", "Object", "libbpf_version"]

log = logging.getLogger("unbroken.agent.libbpf")
T = TypeVar("T", bound=ctypes.Structure)

_lib = ctypes.CDLL(ctypes.util.find_library("bpf") or "libbpf.so.1", use_errno=True)
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
vp, cp, ci, cu32 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint32

_PRINT = ctypes.CFUNCTYPE(ci, ci, cp, vp)
_lines: list[str] = []


@_PRINT
def _print(level: int, fmt: bytes, args: int) -> int:
    buf = ctypes.create_string_buffer(1024)
    _libc.vsnprintf(buf, 1024, fmt, ctypes.c_void_p(args))
    line = buf.value.decode(errors="replace").rstrip()
    _lines.append(line)
    del _lines[:-50]
    if level == 0:  # LIBBPF_WARN
        log.debug("libbpf: %s", line)
    return 0


_libc.vsnprintf.argtypes = [cp, ctypes.c_size_t, cp, vp]
_lib.libbpf_set_print.argtypes = [_PRINT]
_lib.libbpf_set_print.restype = vp
_lib.libbpf_set_print(_print)


class _UprobeOpts(ctypes.Structure):
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("ref_ctr_offset", ctypes.c_size_t),
        ("bpf_cookie", ctypes.c_uint64),
        ("retprobe", ctypes.c_bool),
        ("func_name", cp),
    ]


def _sig(name: str, res: object, *args: object) -> None:
    f = getattr(_lib, name)
    f.restype = res
    f.argtypes = list(args)


_sig("bpf_object__open_file", vp, cp, vp)
_sig("bpf_object__load", ci, vp)
_sig("bpf_object__close", None, vp)
_sig("bpf_object__find_program_by_name", vp, vp, cp)
_sig("bpf_object__find_map_by_name", vp, vp, cp)
_sig("bpf_map__fd", ci, vp)
_sig("bpf_map__initial_value", vp, vp, ctypes.POINTER(ctypes.c_size_t))
_sig("bpf_program__attach", vp, vp)
_sig(
    "bpf_program__attach_uprobe_opts", vp, vp, ci, cp, ctypes.c_size_t, ctypes.POINTER(_UprobeOpts)
)
_sig("bpf_link__destroy", ci, vp)
_sig("bpf_program__set_expected_attach_type", ci, vp, ci)
_sig("bpf_program__set_autoload", ci, vp, ctypes.c_bool)
_sig("bpf_program__fd", ci, vp)
_sig("bpf_prog_test_run_opts", ci, ci, vp)
_sig("bpf_map_get_next_key", ci, ci, vp, vp)
_sig("bpf_map_lookup_elem", ci, ci, vp, vp)
_sig("bpf_map_delete_elem", ci, ci, vp)
# int bpf_map_lookup_batch(fd, in_batch, out_batch, keys, values, __u32 *count, opts)
_sig("bpf_map_lookup_batch", ci, ci, vp, vp, vp, vp, ctypes.POINTER(cu32), vp)
_sig("libbpf_major_version", cu32)
_sig("libbpf_minor_version", cu32)


class _TestRunOpts(ctypes.Structure):
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("data_in", vp),
        ("data_out", vp),
        ("data_size_in", cu32),
        ("data_size_out", cu32),
        ("ctx_in", vp),
        ("ctx_out", vp),
        ("ctx_size_in", cu32),
        ("ctx_size_out", cu32),
        ("retval", cu32),
        ("repeat", ci),
        ("duration", cu32),
        ("flags", cu32),
        ("cpu", cu32),
        ("batch_size", cu32),
    ]


class BpfError(OSError):
    def __init__(self, what: str, err: int) -> None:
        self.what = what
        detail = "; ".join(_lines[-5:])
        super().__init__(err, f"{what}: {os.strerror(err)}" + (f" ({detail})" if detail else ""))


def libbpf_version() -> str:
    return f"{_lib.libbpf_major_version()}.{_lib.libbpf_minor_version()}"


def _errno(rc: int | None = None) -> int:
    if rc is not None and rc < 0:
        return -rc
    return ctypes.get_errno() or 1


# The bpf(2) syscall, for what libbpf 1.1 (Debian 12's) has no call for: multi-uprobe links.
_SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine)
_BPF_LINK_CREATE = 28
BPF_TRACE_UPROBE_MULTI = 48  # enum bpf_attach_type, kernel 6.6+
_BPF_F_UPROBE_MULTI_RETURN = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _UprobeMultiAttr(ctypes.Structure):
    """union bpf_attr's `link_create` with its `uprobe_multi` member (include/uapi/linux/
    bpf.h), padded to the size passed: the kernel requires the bytes it does not read to be 0."""

    _fields_ = [
        ("prog_fd", cu32),
        ("target_fd", cu32),
        ("attach_type", cu32),
        ("flags", cu32),
        ("path", ctypes.c_uint64),
        ("offsets", ctypes.c_uint64),
        ("ref_ctr_offsets", ctypes.c_uint64),
        ("cookies", ctypes.c_uint64),
        ("cnt", cu32),
        ("multi_flags", cu32),
        ("pid", cu32),
        ("_pad", cu32),
    ]


class Link:
    """An attachment; `destroy()` detaches it (idempotent). A libbpf link, or the file
    descriptor of a link made with the bpf syscall (`fd`)."""

    def __init__(self, ptr: int, what: str, *, fd: int | None = None) -> None:
        self._ptr: int | None = ptr or None
        self._fd = fd
        self.what = what

    def destroy(self) -> None:
        if self._ptr:
            _lib.bpf_link__destroy(self._ptr)
            self._ptr = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Object:
    """A BPF object file: open (set read-only data), load, attach, read its maps, close."""

    def __init__(self, path: Path) -> None:
        _lines.clear()
        ptr = _lib.bpf_object__open_file(str(path).encode(), None)
        if not ptr:
            raise BpfError(f"open {path}", _errno())
        self._ptr: int | None = ptr
        self.path = path
        self.links: list[Link] = []

    def set_rodata(self, data: bytes) -> None:
        """Overwrite the start of .rodata (`const volatile` knobs) before load."""
        m = _lib.bpf_object__find_map_by_name(self._ptr, b".rodata")
        if not m:
            raise BpfError("no .rodata map", 2)
        size = ctypes.c_size_t()
        addr = _lib.bpf_map__initial_value(m, ctypes.byref(size))
        if not addr or size.value < len(data):
            raise BpfError(".rodata too small", 22)
        ctypes.memmove(addr, data, len(data))

    def set_expected_attach_type(self, prog: str, attach_type: int) -> None:
        rc = _lib.bpf_program__set_expected_attach_type(self._prog(prog), attach_type)
        if rc != 0:
            raise BpfError(f"set attach type of {prog}", _errno(rc))

    def set_autoload(self, prog: str, on: bool) -> None:
        rc = _lib.bpf_program__set_autoload(self._prog(prog), on)
        if rc != 0:
            raise BpfError(f"set autoload of {prog}", _errno(rc))

    def load(self) -> None:
        _lines.clear()
        rc = _lib.bpf_object__load(self._ptr)
        if rc != 0:
            raise BpfError(f"load {self.path.name}", _errno(rc))

    def _prog(self, name: str) -> int:
        p = _lib.bpf_object__find_program_by_name(self._ptr, name.encode())
        if not p:
            raise BpfError(f"no program {name}", 2)
        return int(p)

    def attach(self, prog: str) -> Link:
        """Attach by the program's section (tracepoints, tp_btf)."""
        link = _lib.bpf_program__attach(self._prog(prog))
        if not link:
            raise BpfError(f"attach {prog}", _errno())
        lk = Link(link, prog)
        self.links.append(lk)
        return lk

    def attach_uprobe(
        self, prog: str, binary: str, offset: int, *, cookie: int, retprobe: bool, pid: int = -1
    ) -> Link:
        opts = _UprobeOpts(sz=ctypes.sizeof(_UprobeOpts), bpf_cookie=cookie, retprobe=retprobe)
        link = _lib.bpf_program__attach_uprobe_opts(
            self._prog(prog), pid, binary.encode(), offset, ctypes.byref(opts)
        )
        if not link:
            raise BpfError(f"attach {prog} to {binary}+{offset:#x}", _errno())
        lk = Link(link, f"{prog} {binary}+{offset:#x}")
        self.links.append(lk)
        return lk

    def attach_uprobe_multi(
        self, prog: str, binary: str, offsets: list[int], cookies: list[int], *, retprobe: bool
    ) -> Link:
        """One link for a probe at each of `offsets` in `binary` (every process that maps
        it), each call carrying its cookie: BPF_LINK_CREATE with BPF_TRACE_UPROBE_MULTI
        (kernel 6.6+; `prog` loaded with that expected attach type). Destroying it costs
        the one grace period that each single-probe link costs (docs/agent.md)."""
        if _SYS_BPF is None:
            raise BpfError("multi-uprobe link: no bpf syscall number for this machine", 38)
        n = len(offsets)
        offs = (ctypes.c_uint64 * n)(*offsets)
        cks = (ctypes.c_uint64 * n)(*cookies)
        path = ctypes.create_string_buffer(binary.encode())
        attr = _UprobeMultiAttr(
            prog_fd=_lib.bpf_program__fd(self._prog(prog)),
            attach_type=BPF_TRACE_UPROBE_MULTI,
            path=ctypes.addressof(path),
            offsets=ctypes.addressof(offs),
            cookies=ctypes.addressof(cks),
            cnt=n,
            multi_flags=_BPF_F_UPROBE_MULTI_RETURN if retprobe else 0,
        )
        fd = _libc.syscall(_SYS_BPF, _BPF_LINK_CREATE, ctypes.byref(attr), ctypes.sizeof(attr))
        if fd < 0:
            raise BpfError(f"multi-uprobe link {prog} to {binary} ({n})", ctypes.get_errno() or 1)
        lk = Link(0, f"{prog} {binary} x{n}", fd=int(fd))
        self.links.append(lk)
        return lk

    def run(self, prog: str) -> int:
        """Run a program once now (BPF_PROG_TEST_RUN; a `raw_tp` program with no context):
        how the agent runs in-kernel work at scrape time. Returns the program's retval."""
        opts = _TestRunOpts(sz=ctypes.sizeof(_TestRunOpts))
        rc = _lib.bpf_prog_test_run_opts(_lib.bpf_program__fd(self._prog(prog)), ctypes.byref(opts))
        if rc != 0:
            raise BpfError(f"run {prog}", _errno(rc))
        return int(opts.retval)

    def map_fd(self, name: str) -> int:
        m = _lib.bpf_object__find_map_by_name(self._ptr, name.encode())
        if not m:
            raise BpfError(f"no map {name}", 2)
        return int(_lib.bpf_map__fd(m))

    def destroy(self, links: list[Link]) -> None:
        """Destroy these links and stop holding them (the rest stay attached)."""
        for lk in links:
            lk.destroy()
        ids = {id(lk) for lk in links}
        self.links = [lk for lk in self.links if id(lk) not in ids]

    def close(self) -> None:
        for lk in self.links:
            lk.destroy()
        self.links.clear()
        if self._ptr:
            _lib.bpf_object__close(self._ptr)
            self._ptr = None


def items(
    fd: int, key_t: type[T], val_t: type[ctypes.Structure] | type[ctypes.c_uint64]
) -> Iterator[tuple[T, object]]:
    """Every (key, value) of a hash map, copied out."""
    key, nxt = key_t(), key_t()
    val = val_t()
    prev: object = None
    while _lib.bpf_map_get_next_key(fd, prev, ctypes.byref(nxt)) == 0:
        if _lib.bpf_map_lookup_elem(fd, ctypes.byref(nxt), ctypes.byref(val)) == 0:
            k = key_t.from_buffer_copy(nxt)
            yield k, val_t.from_buffer_copy(val)
        ctypes.memmove(ctypes.byref(key), ctypes.byref(nxt), ctypes.sizeof(key_t))
        prev = ctypes.byref(key)


_ENOTSUPP = 524  # the kernel's own "not supported", which bpf(2) can return as it is
_batch_ok = True  # cleared once the kernel refuses BPF_MAP_LOOKUP_BATCH (before Linux 5.6)


def dump(fd: int, key_t: type[Any], val_t: type[Any], hint: int = 1024) -> tuple[bytes, bytes]:
    """Every key and value of a hash map, packed (n keys, then n values, as the C structs
    lay them out), in a few BPF_MAP_LOOKUP_BATCH calls (Linux 5.6+) where `items` makes two
    bpf(2) calls and two ctypes copies an entry: 6 us a socket in the TCP map, 50 ms a read
    at 8,000 sockets. Entry by entry where the kernel has no batch lookup. A concurrent
    update may be missed or seen twice, as with `items`. `hint`: entries expected."""
    global _batch_ok
    if _batch_ok:
        got = _lookup_batch(fd, ctypes.sizeof(key_t), ctypes.sizeof(val_t), max(64, hint))
        if got is not None:
            return got
        _batch_ok = False
    pairs = list(items(fd, key_t, val_t))
    return b"".join(bytes(k) for k, _ in pairs), b"".join(bytes(v) for _, v in pairs)


def _lookup_batch(fd: int, key_size: int, value_size: int, cap: int) -> tuple[bytes, bytes] | None:
    """`dump` by BPF_MAP_LOOKUP_BATCH; None when the kernel refuses it for this map."""
    kbuf = ctypes.create_string_buffer(cap * key_size)
    vbuf = ctypes.create_string_buffer(cap * value_size)
    # A hash map's batch token is its next bucket (a u32); 8 bytes leave room either way.
    tok_in, tok_out = ctypes.c_uint64(0), ctypes.c_uint64(0)
    in_ptr: object = None
    keys: list[bytes] = []
    vals: list[bytes] = []
    while True:
        count = cu32(cap)
        rc = _lib.bpf_map_lookup_batch(
            fd, in_ptr, ctypes.byref(tok_out), kbuf, vbuf, ctypes.byref(count), None
        )
        err = _errno(rc) if rc < 0 else 0
        n = count.value if err in (0, 2) else 0  # ENOENT: the last, possibly partial, batch
        if n:
            keys.append(ctypes.string_at(kbuf, n * key_size))
            vals.append(ctypes.string_at(vbuf, n * value_size))
        if err == 2:
            return b"".join(keys), b"".join(vals)
        if err == 28:  # ENOSPC: one bucket holds more than the buffer; retry it larger
            cap *= 2
            kbuf = ctypes.create_string_buffer(cap * key_size)
            vbuf = ctypes.create_string_buffer(cap * value_size)
            continue
        if err in (22, 95, _ENOTSUPP) and in_ptr is None and not keys:
            # EINVAL / EOPNOTSUPP: no batch ops for this kernel or map
            log.debug(
                "BPF_MAP_LOOKUP_BATCH unavailable (%s): reading maps entry by entry",
                os.strerror(err) if err != _ENOTSUPP else "ENOTSUPP",
            )
            return None
        if err:
            raise BpfError("bpf_map_lookup_batch", err)
        tok_in.value = tok_out.value
        in_ptr = ctypes.byref(tok_in)


def delete(fd: int, key: ctypes.Structure | ctypes.c_uint32 | ctypes.c_uint64) -> None:
    _lib.bpf_map_delete_elem(fd, ctypes.byref(key))


def keys(fd: int, key_t: type[T]) -> list[T]:
    """Every key of a hash map (no values: cheaper when only pruning)."""
    out: list[T] = []
    nxt = key_t()
    prev: object = None
    while _lib.bpf_map_get_next_key(fd, prev, ctypes.byref(nxt)) == 0:
        k = key_t.from_buffer_copy(nxt)
        out.append(k)
        prev = ctypes.byref(k)
    return out
