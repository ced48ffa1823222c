"""Building, caching and loading the native CPU kernels' library (``csrc/division_cpu.c``); the
wrappers that call it are :mod:`hf_division.kernels.native`, whose docstring says why it exists and
how the cache is kept private."""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "division_cpu.c"
#: -ffp-contract=off: each product and sum rounded on its own, as in the tensor code (same bytes).
#: -fno-trapping-math: without it GCC keeps a float comparison (the clamps of the SiLU kernel's e^x)
#: as a branch, which leaves the gated loops scalar on AVX2 CPUs; it changes no value, only whether
#: a comparison may be computed for every lane (docs/DESIGN.md, "Gated MLP").
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-fPIC", "-shared", "-std=gnu11"]

def _cache_dir() -> Path:
    root = os.environ.get("HF_DIVISION_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_division")
    return Path(root)


def _cpu_id() -> str:
    """What the build depends on beyond the source: the CPU's features (``-march=native``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


class Refused(OSError):
    """The cache or a library in it is not safe to load from, or a library lacks symbols even rebuilt:
    no other build flags are tried."""


def build(cc: str | None = None, cache: Path | None = None) -> ctypes.CDLL:
    """Compile ``csrc/division_cpu.c`` with ``cc`` (default: ``$CC``, else ``cc``) into ``cache``
    (default: the cache folder above) unless it is there already, and load it. Tries
    ``-march=native`` first, then without it (some compilers or CPUs lack it). A cached library
    that lacks a symbol is stale: it is rebuilt once. Raises ``OSError`` or
    ``subprocess.SubprocessError`` naming each command that failed, :class:`Refused` (an
    ``OSError``) naming the folder or file that is not private to this user, or the missing symbol."""
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    cache = cache or _cache_dir()
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)  # mode: the folder only, not its parents
    _check_private(cache, "folder")
    errors = []
    for arch in (["-march=native"], []):
        flags = FLAGS + arch
        try:
            return _loaded(cc, flags, cache)
        except Refused:
            raise
        except (OSError, subprocess.SubprocessError) as err:
            errors.append(f"{' '.join([cc] + flags)}: {err}")
    raise subprocess.SubprocessError(" | ".join(errors))


def _check_private(path: Path, what: str) -> os.stat_result:
    """``path``'s status, or :class:`Refused` where another user owns it or may write it."""
    st = os.stat(path)
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if st.st_uid != uid:
        reason = f"owned by uid {st.st_uid}, not by this user (uid {uid})"
    elif st.st_mode & 0o022:
        reason = f"writable by {'group' if st.st_mode & 0o020 else 'others'} (mode {st.st_mode & 0o777:o})"
    else:
        return st
    raise Refused(f"the native kernels' cache {what} {path} is {reason}; not loading from it")


def _loaded(cc: str, flags: list[str], cache: Path) -> ctypes.CDLL:
    target = _target(cc, flags, cache)
    seen, missing = None, None
    for attempt in range(2):  # a library missing a symbol is stale: rebuilt once
        if attempt or not target.exists():
            _install(cc, flags, target, seen)
        seen = _check_private(target, "library")
        lib = ctypes.CDLL(str(target))
        try:
            return _declare(lib)
        except AttributeError as err:
            missing = err
            _unload(lib)  # else dlopen of the same path returns this library again
    raise Refused(f"{target} lacks a symbol even rebuilt: {missing}")


def _target(cc: str, flags: list[str], cache: Path) -> Path:
    source = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_id().encode()]))
    return cache / f"division_cpu_{key.hexdigest()[:20]}.so"


def _install(cc: str, flags: list[str], target: Path, stale: os.stat_result | None) -> None:
    """Build ``target`` unless another process did while this one waited for the lock (``stale``:
    the status of the stale library to replace, None where there was none)."""
    with _build_lock(target.parent):
        if target.exists() and (stale is None or not os.path.samestat(stale, os.stat(target))):
            return
        fd, name = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        built = Path(name)
        try:
            done = subprocess.run([cc, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode:
                raise subprocess.SubprocessError(f"exit status {done.returncode}: {done.stderr.strip()[-2000:]}")
            os.chmod(built, 0o755)  # the linker's mode follows the umask, which may let the group write
            os.replace(built, target)  # atomic: a reader sees the old file or the whole new one
        finally:
            built.unlink(missing_ok=True)


@contextlib.contextmanager
def _build_lock(cache: Path):
    """Held while building into ``cache``: ranks starting together build once."""
    fd = os.open(cache / ".build.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass  # no locks here: builds may overlap, and each install is still atomic
        yield
    finally:
        os.close(fd)  # releases the lock


def _unload(lib: ctypes.CDLL) -> None:
    import _ctypes

    close = getattr(_ctypes, "dlclose", None)
    if close is not None:
        close(lib._handle)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    shape = [i64, i64, i64, i64, i64, i32, i32]  # m, t, c, block, group, bits, lfc kind
    lib.hfd_encode_tokens.argtypes = [p, *shape, p, p, p, p, i32, ctypes.c_uint32, p, p, i32]
    lib.hfd_encode_tokens.restype = i32
    lib.hfd_encode_tile.argtypes = []
    lib.hfd_encode_tile.restype = i64
    lib.hfd_decode_tokens.argtypes = [p, *shape, p, p, p, p, p, i32]
    lib.hfd_decode_tokens.restype = i32
    operand = [p, p, p, i32, p, p]  # codes, lo, scale, bits, outlier slots, outlier rows
    lib.hfd_silu_gated.argtypes = [i64, i64, i64, *operand, *operand, p, p, p, p, i32]
    lib.hfd_silu_gated.restype = i32
    lib.hfd_token_absmax.argtypes = [p, i64, i64, p, i32]
    lib.hfd_token_absmax.restype = None
    lib.hfd_pack_nonzero.argtypes = [p, i64, i32, p, i32]
    lib.hfd_pack_nonzero.restype = None
    lib.hfd_masked_scale.argtypes = [p, p, ctypes.c_float, p, i64, i32]
    lib.hfd_masked_scale.restype = None
    lib.hfd_bernoulli_bits.argtypes = [p, p, p, ctypes.c_double, i64, p]
    lib.hfd_bernoulli_bits.restype = None
    lib.hfd_rotary.argtypes = [p, i64, i64, i64, p, p, i64, i64, p, i64, i64, i64, i64, i64, i64, i64, i32, i32]
    lib.hfd_rotary.restype = None
    lib.hfd_fail_next_allocs.argtypes = [i32]
    lib.hfd_fail_next_allocs.restype = None
    return lib
