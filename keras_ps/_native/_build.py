"""Building keras_ps' C++ kernels (the .cc files beside this module) into
one library with the machine's C++ compiler (`$CXX`, else `c++`) against the
headers that ship in the tensorflow wheel, into a cache directory
(`$KERAS_PS_CACHE_DIR`, else `~/.cache/keras_ps`), the first time a process
needs it: about 15 s of one core, once per machine and TF install. Later
processes load the cached file in milliseconds (keras_ps._native.library).
"""

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess

from keras_ps import _constants

logger = logging.getLogger("keras_ps._native")

SOURCES = [os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
           for name in ("row_updates.cc", "row_files.cc", "row_restore.cc",
                        "notices.cc")]
# Optimized, and free to vectorize sqrt (errno is never read); no
# -march=native, so a cache on a shared home directory serves every machine
# (row_updates.cc compiles its row functions once per vector width and picks
# one at load). No fused multiply-adds: a row's arithmetic stays the
# operations of the update made of TF's ops, one rounding each. On x86-64 the
# AVX-512 version uses all 16 lanes (GCC's default tuning stops at 8).
_FLAGS = ("-O3", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC",
          "-w") + (("-mprefer-vector-width=512",)
                   if platform.machine() in ("x86_64", "AMD64") else ())
_BUILD_TIMEOUT_S = 900


class NativeBuildError(RuntimeError):
    """keras_ps' C++ kernels cannot be built or loaded on this machine."""


def _tf_dir():
    # Found without importing TensorFlow: `python -m keras_ps.server` loads
    # only TF's server (see keras_ps._tf_adapter.server_modules).
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        raise NativeBuildError("tensorflow is not installed")
    return list(spec.submodule_search_locations)[0]


def cache_dir():
    """Where built libraries are kept."""
    if os.environ.get(_constants.CACHE_DIR_ENV_VAR):
        return os.environ[_constants.CACHE_DIR_ENV_VAR]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache")
    return os.path.join(base, "keras_ps")


def library_path():
    """The built library's path for this source, compiler flags and TF install
    (a new TF or a changed source is built again, not loaded stale)."""
    framework = os.path.join(_tf_dir(), "libtensorflow_framework.so.2")
    try:
        stat = os.stat(framework)
        tf_id = f"{framework}:{stat.st_size}:{int(stat.st_mtime)}"
    except OSError:
        tf_id = framework
    digest = hashlib.sha256()
    for source in SOURCES:
        with open(source, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(_FLAGS).encode())
    digest.update(tf_id.encode())
    return os.path.join(cache_dir(), f"kernels-{digest.hexdigest()[:16]}.so")


def _compile(path, extra_flags=(), sources=None):
    """Builds the library into `path` from `sources` (default: SOURCES);
    `extra_flags` go to the compiler after keras_ps' own (a test builds a
    variant of the row kernels alone with a -D)."""
    include = os.path.join(_tf_dir(), "include")
    if not os.path.exists(os.path.join(include, "tensorflow", "core",
                                       "framework", "op_kernel.h")):
        raise NativeBuildError(
            f"TensorFlow's C++ headers are missing from {include}. Reinstall "
            "tensorflow with them (pip install --force-reinstall tensorflow)")
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise NativeBuildError(
            f"no C++ compiler {compiler!r} on PATH. Install one (Debian: apt "
            "install g++) or point $CXX at it")
    import tensorflow as tf  # the flags TF was built with (C++ ABI, Eigen)

    tmp = f"{path}.{os.getpid()}.tmp"
    command = [compiler, *_FLAGS, *extra_flags,
               *tf.sysconfig.get_compile_flags(), *(sources or SOURCES),
               "-o", tmp, *tf.sysconfig.get_link_flags(),
               f"-Wl,-rpath,{_tf_dir()}"]
    logger.warning("[native] building keras_ps' C++ kernels once for this "
                   "machine (about 15 s) into %s", path)
    try:
        result = subprocess.run(command, capture_output=True, text=True,
                                timeout=_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise NativeBuildError(
            f"{compiler} took over {_BUILD_TIMEOUT_S} s") from None
    if result.returncode != 0:
        if os.path.exists(tmp):
            os.remove(tmp)
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise NativeBuildError(
            f"{compiler} failed (exit code {result.returncode}): "
            + " | ".join(lines[-5:]))
    os.replace(tmp, path)


def build():
    """The built library's path, building it first if this machine has none.

    Processes that start at once build it once: the others wait on a lock. A
    build that failed is not tried again for the same source and TF install:
    its reason is kept beside the library's path (`.failed`); remove that file
    to try again.

    Raises:
        NativeBuildError: it cannot be built here; the message says why.
    """
    path = library_path()
    if os.path.exists(path):
        return path
    failed = f"{path}.failed"
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        lock = open(f"{path}.lock", "w")
    except OSError as error:
        raise NativeBuildError(
            f"cannot write to the cache directory {cache_dir()!r} "
            f"({error.strerror}). Set KERAS_PS_CACHE_DIR to a writable "
            "directory") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            return path
        if os.path.exists(failed):
            with open(failed) as f:
                raise NativeBuildError(
                    f"{f.read().strip()} (an earlier build's failure, kept "
                    f"in {failed}: remove that file to build again, e.g. "
                    "once a compiler is installed; KERAS_PS_NATIVE=0 turns "
                    "the kernels off)")
        try:
            _compile(path)
        except NativeBuildError as error:
            with open(failed, "w") as f:
                f.write(str(error))
            raise
    return path

