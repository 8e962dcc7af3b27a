"""C kernels for x86 and other CPUs, compiled on first use with the machine's C compiler.

torch has no fast product of 4-bit weights with few rows of float activations on CPUs
without AVX-512 (`_weight_int4pack_mm_for_cpu` reaches about 2 GB/s of weights on one AVX2
core, a quarter of what the memory gives). `int4_linear` multiplies radixlm's int4 layout
with activations quantized per block of 32 columns to int8 (llama.cpp's arithmetic for its
4-bit blocks), one AVX2 multiply-add per 32 weights, or one AVX-512 VNNI `vpdpbusd` per 64
where the CPU has it; `int8_linear` int8 weights with a scale per row or per group of columns
(llama.cpp's Q8_0 at 32) the same way; `f32_linear` float32 weights with fused multiply-adds
(for the decode step of `decode`); see `gemv.c`.

The products split their output columns, and the decode step its attention, over as many
threads as torch has intra-op threads (`torch.set_num_threads`): the caller's and workers of
the library's own (`pool.c`: pthreads that spin briefly between tasks, then sleep; no OpenMP
runtime beside torch's). Each output is computed the same way whatever the thread count, so
results are the same bits on one thread or many.

The library is built once per source, compiler and CPU (`-O3 -march=native`) into
radixlm's cache (`$RADIXLM_CACHE_DIR`, default `~/.cache/radixlm`, under `kernels/`), which
takes about a second. `RADIXLM_CPU_MARCH` names another target for `-march` (`x86-64-v3`:
AVX2 and FMA without AVX-512; `x86-64`: the plain C paths), for a library that must run on
CPUs older than the one that builds it, or to test those paths on a newer one. Without a compiler (`$CC`, else `cc`), or when the build fails,
`available()` is False and callers keep their torch path; `RADIXLM_CPU_KERNELS=0` turns the
kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

logger = logging.getLogger("radixlm.kernels.cpu")

#: The sources of the one library: the products (gemv.c: row-major weights; panels.c:
#: float32 weights in panels) and the decode step (decode.c).
_SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("gemv.c", "panels.c", "decode.c", "pool.c")
)
#: pool.c's interface, which the other sources include (part of the library's key).
_POOL_HEADER = Path(__file__).with_name("pool.h")


def _flags() -> tuple[str, ...]:
    """The compiler's flags: `-march` from `$RADIXLM_CPU_MARCH` (default `native`)."""
    march = os.environ.get("RADIXLM_CPU_MARCH") or "native"
    return ("-O3", f"-march={march}", "-shared", "-fPIC")


#: The most activation rows one call takes (decode batches); more run elsewhere.
MAX_ROWS = 16
#: The most rows one float32 product (`f32_linear`, float32 `DecodeLayers`) takes: its tiles
#: take any count, so a call of many rows reads the weights once for all of them.
F32_MAX_ROWS = 64
#: The most rows one `DecodeLayers` call takes when every projection is in panels (a whole
#: prefill chunk: the panel products take any count and read each weight once per call).
PANELS_MAX_ROWS = 8192
#: Columns per activation block (and the smallest weight group the kernel takes).
BLOCK = 32
#: Weight rows per panel of `pack_f32_panels` (one 64-byte line per column).
PANEL = 16

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache" / "radixlm"
    return Path(root) / "kernels"


def _cpu_model() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((ln for ln in info.splitlines() if ln.startswith("flags")), "")


def _build() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        logger.info("no C compiler (%s): radixlm's CPU kernels are not built", compiler)
        return None
    source = b"".join(path.read_bytes() for path in (*_SOURCES, _POOL_HEADER))
    flags = _flags()
    key = hashlib.sha256(
        source + compiler.encode() + " ".join(flags).encode() + _cpu_model().encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"gemv-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            built = Path(work) / target.name
            command = [
                compiler, *flags, *map(str, _SOURCES), "-o", str(built), "-lm", "-pthread"
            ]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning(
                    "radixlm's CPU kernels did not build (%s): %s",
                    " ".join(command),
                    result.stderr[-2000:],
                )
                return None
            os.replace(built, target)  # atomic: a concurrent build loses nothing
    library = ctypes.CDLL(str(target))
    function = library.radixlm_int4_gemv
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    int8 = library.radixlm_int8_gemv
    int8.restype = ctypes.c_int
    int8.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    f32 = library.radixlm_f32_gemv
    f32.restype = ctypes.c_int
    pointer = ctypes.c_void_p
    f32.argtypes = [pointer, ctypes.c_int, ctypes.c_int, pointer, ctypes.c_int, pointer]
    panels = library.radixlm_f32_panels
    panels.restype = ctypes.c_int
    panels.argtypes = [pointer, ctypes.c_int, ctypes.c_int, pointer, ctypes.c_int, pointer]
    argmax = library.radixlm_argmax_rows
    argmax.restype = None
    argmax.argtypes = [pointer, ctypes.c_int, ctypes.c_int, ctypes.c_int64, pointer]
    draws = library.radixlm_sample_rows
    draws.restype = ctypes.c_int
    draws.argtypes = [
        pointer,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int64,
        pointer,
        pointer,
        pointer,
    ]
    library.radixlm_set_threads.restype = None
    library.radixlm_set_threads.argtypes = [ctypes.c_int]
    library.radixlm_threads.restype = ctypes.c_int
    library.radixlm_threads.argtypes = []
    return library


def _load() -> ctypes.CDLL | None:
    global _library, _tried
    if _tried:
        return _library
    with _lock:
        if not _tried:
            if os.environ.get("RADIXLM_CPU_KERNELS", "1").strip() not in ("0", "false", "no"):
                try:
                    _library = _build()
                except OSError as error:
                    logger.warning("radixlm's CPU kernels could not be loaded: %s", error)
                    _library = None
            _tried = True
    return _library


_threads = 1  # what the library was last told (its own default)


def _loaded() -> ctypes.CDLL:
    """The library, its thread count brought in line with torch's intra-op threads."""
    global _threads
    library = _load()
    if library is None:
        raise RuntimeError("radixlm's CPU kernels are not available (see available())")
    threads = torch.get_num_threads()
    if threads != _threads:
        library.radixlm_set_threads(threads)
        _threads = threads
    return library


def available() -> bool:
    """Whether the CPU kernels are built (building them now if they were not tried yet)."""
    return _load() is not None


def _check(op: str, tensors: tuple[tuple[str, torch.Tensor, torch.dtype], ...]) -> None:
    for name, tensor, dtype in tensors:
        if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise RuntimeError(f"{op}: {name} must be a contiguous {dtype} CPU tensor")


def _rows_and_groups(op: str, rows: int, k: int, group_size: int) -> None:
    if not 1 <= rows <= MAX_ROWS or group_size % BLOCK or k % group_size:
        raise RuntimeError(
            f"{op} takes 1..{MAX_ROWS} rows and groups of a multiple of {BLOCK} "
            f"dividing K; got {rows} rows, K={k}, group {group_size}"
        )


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scales).T`` for float32 ``x`` ``[M, K]`` (M <= MAX_ROWS) and int8
    ``weight`` ``[N, K]`` with float32 ``scales`` ``[N]`` (per row) or ``[N, K // g]`` (per
    group of g columns, g a multiple of 32), activations rounded to int8 per 32 columns; one
    thread; float32 ``[M, N]``. Raises RuntimeError when the kernels are not available or
    the shapes are not taken."""
    library = _loaded()
    rows, k = x.shape
    n = weight.shape[0]
    groups = 1 if scales.dim() == 1 else scales.shape[1]
    group_size = k // groups if groups and k % groups == 0 else 0
    _rows_and_groups("int8_linear", rows, k, group_size or 1)
    if weight.shape[1] != k or scales.shape[0] != n:
        raise RuntimeError(
            f"int8_linear: weight {tuple(weight.shape)} and scales {tuple(scales.shape)} do "
            f"not fit x {tuple(x.shape)}"
        )
    _check(
        "int8_linear",
        (
            ("x", x, torch.float32),
            ("weight", weight, torch.int8),
            ("scales", scales, torch.float32),
        ),
    )
    out = torch.empty(rows, n, dtype=torch.float32)
    code = library.radixlm_int8_gemv(
        x.data_ptr(), rows, k, weight.data_ptr(), scales.data_ptr(), n, group_size, out.data_ptr()
    )
    if code != 0:
        raise RuntimeError("int8_linear: the kernel refused these shapes")
    return out


def f32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for float32 ``x`` ``[M, K]`` (M <= F32_MAX_ROWS) and ``weight`` ``[N, K]``
    (any K) on CPU tensors, in float32 with fused multiply-adds (`gemv.c`); one thread;
    float32 ``[M, N]``. Raises RuntimeError when the kernels are not available or the shapes
    do not fit."""
    library = _loaded()
    rows, k = x.shape
    n = weight.shape[0]
    if not 1 <= rows <= F32_MAX_ROWS or weight.shape[1] != k:
        raise RuntimeError(
            f"f32_linear takes 1..{F32_MAX_ROWS} rows and a weight of their width; got x "
            f"{tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    _check("f32_linear", (("x", x, torch.float32), ("weight", weight, torch.float32)))
    out = torch.empty(rows, n, dtype=torch.float32)
    code = library.radixlm_f32_gemv(x.data_ptr(), rows, k, weight.data_ptr(), n, out.data_ptr())
    if code != 0:
        raise RuntimeError("f32_linear: the kernel refused these shapes")
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a float32 CPU tensor ``[M, N]`` (N >= 1, unit stride along a
    row): the first of equal largest values, a row's first NaN where it has one, as torch
    gives; int64 ``[M]``. Sixteen floats at a time (torch's CPU argmax compares one at a time).
    Raises RuntimeError when the kernels are not available or the tensor does not fit."""
    library = _loaded()
    if x.dim() != 2 or x.shape[1] < 1 or x.stride(1) != 1:
        raise RuntimeError(
            f"argmax_rows takes [M, N] rows with N >= 1 and a unit stride along each; got "
            f"shape {tuple(x.shape)}, strides {x.stride()}"
        )
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise RuntimeError(f"argmax_rows takes float32 CPU tensors; got {x.dtype} on {x.device}")
    rows = x.shape[0]
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        library.radixlm_argmax_rows(x.data_ptr(), rows, x.shape[1], x.stride(0), out.data_ptr())
    return out


def sample_rows(
    x: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """A token per row of a float32 CPU tensor ``[M, N]`` (N >= 1, unit stride along a row)
    drawn from ``softmax(x[r] / temperatures[r])`` with ``uniforms[r]`` in [0, 1): the first
    token, in id order, whose running mass exceeds ``uniforms[r]`` x the row's total (the
    inverse CDF that softmax, cumsum and searchsorted compute in torch, in two passes over a
    row); a token whose weight is 0 (a -inf logit) is never drawn, and a row without mass
    (all -inf or NaN, or a +inf) gives N - 1, as that torch path does. ``temperatures`` and
    ``uniforms`` float32 ``[M]``, every temperature > 0. int64 ``[M]``. Raises RuntimeError
    when the kernels are not available or the tensors do not fit."""
    library = _loaded()
    if x.dim() != 2 or x.shape[1] < 1 or x.stride(1) != 1:
        raise RuntimeError(
            f"sample_rows takes [M, N] rows with N >= 1 and a unit stride along each; got "
            f"shape {tuple(x.shape)}, strides {x.stride()}"
        )
    rows = x.shape[0]
    for name, t in (("x", x), ("temperatures", temperatures), ("uniforms", uniforms)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise RuntimeError(
                f"sample_rows takes float32 CPU tensors; {name} is {t.dtype} on {t.device}"
            )
    if temperatures.shape != (rows,) or uniforms.shape != (rows,):
        raise RuntimeError(
            f"sample_rows takes a temperature and a uniform per row ({rows}); got shapes "
            f"{tuple(temperatures.shape)} and {tuple(uniforms.shape)}"
        )
    temperatures, uniforms = temperatures.contiguous(), uniforms.contiguous()
    if rows and not bool((temperatures > 0).all()):
        raise RuntimeError("sample_rows takes temperatures > 0 (a greedy row is an argmax)")
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        code = library.radixlm_sample_rows(
            x.data_ptr(), rows, x.shape[1], x.stride(0), temperatures.data_ptr(),
            uniforms.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if code:
            raise MemoryError(f"sample_rows: no memory for {x.shape[1]} floats of scratch")
    return out


#: Bytes of a transparent huge page (x86-64 and arm64 with 4 KB pages).
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise where transparent huge pages are given on request (Linux, THP
    `madvise` or `always`), else None; looked up once."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    if "[never]" in mode:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def _advise_huge_pages(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) on a range not touched yet (its first writes then fault in
    2 MB pages); False where the system does not give them or RADIXLM_HUGE_PAGES=0."""
    madvise = _madvise()
    if os.environ.get("RADIXLM_HUGE_PAGES", "1") == "0" or madvise is None:
        return False
    return madvise(address, length, _MADV_HUGEPAGE) == 0


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose memory lies on transparent huge pages where the system
    gives them (see `move_to_huge_pages`), else a plain ``torch.zeros``: a view, 2 MB aligned,
    into an allocation 2 MB longer (never touched past the view, so not resident)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    block = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = block.data_ptr()
    offset = -start % HUGE_PAGE
    if not _advise_huge_pages(start + offset, nbytes // HUGE_PAGE * HUGE_PAGE):
        return torch.zeros(shape, dtype=dtype)
    return block[offset : offset + nbytes].view(dtype).view(shape).zero_()


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Move the data of these CPU tensors, in place, into one new allocation backed by
    transparent huge pages; returns the bytes moved (0 where the system gives none, or with
    ``RADIXLM_HUGE_PAGES=0``).

    A decode step at a few rows streams every weight from memory once, and with 4 KB pages
    the CPU's prefetchers stop at every page boundary: on 2 MB pages the same products read
    markedly faster (``tools/bench/cpu_decode_bench.py``). Small weights are separate
    allocations of torch's that no huge page can cover, so they move into one.

    Each tensor object keeps its shape, dtype and strides and is repointed (``set_``) at its
    place in the new allocation, so every holder of the object sees the move; the old memory
    is freed once nothing else holds it. Only tensors that cover their whole storage move
    (another tensor object viewing part of a storage would keep reading the old copy), each
    storage once. Call it before anything records the tensors' addresses."""
    moving: dict[int, list[torch.Tensor]] = {}  # by storage: every object covering it
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if (
            tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and tensor.storage_offset() == 0
            and tensor.numel() * tensor.element_size() == storage.nbytes() > 0
        ):
            objects = moving.setdefault(storage.data_ptr(), [])
            if all(t is not tensor for t in objects):
                objects.append(tensor)
    if not moving:
        return 0
    sizes = [-(-group[0].untyped_storage().nbytes() // 64) * 64 for group in moving.values()]
    arena = torch.empty(sum(sizes) + HUGE_PAGE, dtype=torch.uint8)
    start = arena.data_ptr()
    aligned = -(-start // HUGE_PAGE) * HUGE_PAGE
    if not _advise_huge_pages(aligned, (start + arena.numel() - aligned) // HUGE_PAGE * HUGE_PAGE):
        return 0
    new, offset, moved = arena.untyped_storage(), aligned - start, 0
    with torch.no_grad():
        for group, size in zip(moving.values(), sizes, strict=True):
            first = group[0]
            nbytes = first.numel() * first.element_size()
            arena[offset : offset + nbytes].view(first.dtype).view(first.shape).copy_(first)
            for tensor in group:  # (objects that shared a storage share the new one)
                elements = offset // tensor.element_size()
                tensor.set_(new, elements, tensor.shape, tensor.stride())
            offset += size
            moved += nbytes
    return moved


def pack_f32_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] laid out for `f32_panel_linear`: rows padded with zeros to a
    multiple of PANEL, each PANEL rows stored column by column, ``[ceil(N / PANEL), K, PANEL]``
    (a new tensor, 64-byte aligned as torch allocates on the CPU; `unpack_f32_panels` gives
    the weight back)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise RuntimeError("pack_f32_panels takes a float32 [N, K] CPU tensor")
    n, k = weight.shape
    count = -(-n // PANEL)
    padded = torch.zeros(count * PANEL, k, dtype=torch.float32)
    padded[:n] = weight
    panels = padded.view(count, PANEL, k).transpose(1, 2).contiguous()
    if panels.data_ptr() % 64:  # (torch's CPU allocator aligns to 64 bytes)
        raise RuntimeError("pack_f32_panels: the panels are not 64-byte aligned")
    return panels


def unpack_f32_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The weight [n, K] that `pack_f32_panels` laid out as ``panels``."""
    count, k, width = panels.shape
    if width != PANEL or not (count - 1) * PANEL < n <= count * PANEL:
        raise RuntimeError(f"unpack_f32_panels: {tuple(panels.shape)} does not hold {n} rows")
    return panels.transpose(1, 2).reshape(count * PANEL, k)[:n].contiguous()


def f32_panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """``x @ weight.T`` for float32 ``x`` ``[M, K]`` (any M) and ``weight`` ``[n, K]`` as
    `pack_f32_panels` laid it out; one thread; float32 ``[M, n]``. Each output sums its column
    products in chunks of 32 columns (fused multiply-adds in column order, then the chunks in
    order): a row's result does not depend on the other rows of the call. Raises RuntimeError when the kernels are not available or
    the shapes do not fit."""
    library = _loaded()
    rows, k = x.shape
    if panels.dim() != 3 or panels.shape[1:] != (k, PANEL) or panels.shape[0] != -(-n // PANEL):
        raise RuntimeError(
            f"f32_panel_linear: panels {tuple(panels.shape)} do not hold {n} rows of x's "
            f"{k} columns"
        )
    _check("f32_panel_linear", (("x", x, torch.float32), ("panels", panels, torch.float32)))
    out = torch.empty(rows, n, dtype=torch.float32)
    if rows == 0:
        return out
    code = library.radixlm_f32_panels(x.data_ptr(), rows, k, panels.data_ptr(), n, out.data_ptr())
    if code != 0:
        raise RuntimeError(
            "f32_panel_linear: the kernel refused these panels (not 64-byte aligned?)"
        )
    return out


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """``x @ dequantize_int4(qweight, scales, zeros, group_size).T`` for float32 ``x``
    ``[M, K]`` with M <= MAX_ROWS on CPU tensors, activations quantized per 32 columns to
    int8; float32 ``[M, N]``. ``scales`` and ``zeros`` ``[N, K // group_size]`` float32,
    ``group_size`` a multiple of 32; one thread. Raises RuntimeError when the kernels are
    not available or the shapes are not taken."""
    library = _loaded()
    rows, k = x.shape
    n = qweight.shape[0]
    _rows_and_groups("int4_linear", rows, k, group_size)
    if qweight.shape[1] * 2 != k or scales.shape != (n, k // group_size):
        raise RuntimeError(
            f"int4_linear: qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} do "
            f"not fit x {tuple(x.shape)} with groups of {group_size}"
        )
    _check(
        "int4_linear",
        (
            ("x", x, torch.float32),
            ("qweight", qweight, torch.uint8),
            ("scales", scales, torch.float32),
            ("zeros", zeros, torch.float32),
        ),
    )
    out = torch.empty(rows, n, dtype=torch.float32)
    code = library.radixlm_int4_gemv(
        x.data_ptr(),
        rows,
        k,
        qweight.data_ptr(),
        scales.data_ptr(),
        zeros.data_ptr(),
        n,
        group_size,
        out.data_ptr(),
    )
    if code != 0:
        raise RuntimeError("int4_linear: the kernel refused these shapes")
    return out
