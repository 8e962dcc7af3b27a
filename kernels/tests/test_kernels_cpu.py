"""The C CPU kernels (int4 and int8 weights x few float rows) against an exact computation of
their own arithmetic and the torch reference, the shapes they refuse, and how they are turned
off."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import radixlm.kernels as rk
from radixlm.kernels import cpu

needs_kernels = pytest.mark.skipif(not cpu.available(), reason="no C compiler here")


def _weights(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    qweight, scales, zeros = rk.quantize_int4(torch.randn(n, k) / k**0.5, group, fit=True)
    return qweight, scales.float().contiguous(), zeros.float().contiguous()


def _kernel_arithmetic(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """What the kernel computes, in float64: the dequantized weights times the activations
    rounded to int8 per block of 32 (the zero points' part included: over the rounded
    activations, as llama.cpp's Q8_1 sums)."""
    weights = rk.dequantize_int4(qweight, scales, zeros, group).double()
    return (_int8_activations(x).double() @ weights.T).float()


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """The kernel's activations: each block of 32 columns rounded to int8 at absmax / 127."""
    blocks = x.reshape(x.shape[0], -1, cpu.BLOCK)
    scale = blocks.abs().amax(dim=2, keepdim=True) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(blocks / safe) * scale).reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize(
    ("n", "k", "group"), [(7, 64, 32), (33, 96, 32), (40, 256, 64), (9, 128, 128)]
)
def test_int4_linear_is_the_reference_on_int8_rounded_activations(
    rows: int, n: int, k: int, group: int
) -> None:
    qweight, scales, zeros = _weights(n, k, group)
    x = torch.randn(rows, k)
    got = cpu.int4_linear(x, qweight, scales, zeros, group)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # Its own arithmetic exactly (the integer dot products are exact; only float sums of a
    # different order differ).
    exact = _kernel_arithmetic(x, qweight, scales, zeros, group)
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
    # And within the int8 rounding of the activations of the unrounded product.
    want = rk.reference.int4_linear(x, qweight, scales, zeros, group)
    assert float((got - want).abs().max() / want.abs().max()) < 0.03


@needs_kernels
def test_zero_rows_and_zero_blocks_stay_finite() -> None:
    qweight, scales, zeros = _weights(16, 64, 32)
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.randn(32)  # row 1: its first block all zeros (scale 0)
    got = cpu.int4_linear(x, qweight, scales, zeros, 32)
    assert torch.isfinite(got).all() and torch.equal(got[0], torch.zeros(16))
    want = _kernel_arithmetic(x, qweight, scales, zeros, 32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_shapes_and_layouts_it_does_not_take_are_refused() -> None:
    qweight, scales, zeros = _weights(8, 64, 32)
    with pytest.raises(RuntimeError, match=r"1\.\.16 rows"):
        cpu.int4_linear(torch.randn(17, 64), qweight, scales, zeros, 32)
    with pytest.raises(RuntimeError, match="groups of a multiple of 32"):
        cpu.int4_linear(torch.randn(1, 64), qweight, scales, zeros, 16)
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu.int4_linear(torch.randn(1, 128), qweight, scales, zeros, 32)
    with pytest.raises(RuntimeError, match=r"contiguous torch\.float32"):
        cpu.int4_linear(torch.randn(1, 64, dtype=torch.float64), qweight, scales, zeros, 32)
    with pytest.raises(RuntimeError, match=r"contiguous torch\.float32"):
        cpu.int4_linear(torch.randn(64, 2).t(), qweight, scales, zeros, 32)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize(("n", "k", "group"), [(7, 64, 0), (33, 96, 32), (20, 256, 64)])
def test_int8_linear_per_row_and_per_group_is_its_arithmetic(
    rows: int, n: int, k: int, group: int
) -> None:
    torch.manual_seed(1)
    w = torch.randn(n, k) / k**0.5
    if group:  # llama.cpp's Q8_0 at 32: a scale per group of columns
        weight, scales = rk.quantize_int8_grouped(w, group)
        dense = rk.dequantize_int8_grouped(weight, scales, group)
    else:  # a scale per row
        weight, scales = rk.quantize_int8(w)
        dense = rk.dequantize_int8(weight, scales)
    x = torch.randn(rows, k)
    got = cpu.int8_linear(x, weight, scales)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    exact = (_int8_activations(x).double() @ dense.double().T).float()
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
    want = x @ dense.T
    assert float((got - want).abs().max() / want.abs().max()) < 0.02


@needs_kernels
def test_int8_linear_refuses_what_it_does_not_take() -> None:
    weight, scales = rk.quantize_int8(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match=r"1\.\.16 rows"):
        cpu.int8_linear(torch.randn(17, 64), weight, scales)
    with pytest.raises(RuntimeError, match="groups of a multiple of 32"):
        cpu.int8_linear(torch.randn(1, 48), *rk.quantize_int8(torch.randn(8, 48)))
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu.int8_linear(torch.randn(1, 64), weight, scales[:4])
    with pytest.raises(RuntimeError, match=r"contiguous torch\.int8"):
        cpu.int8_linear(torch.randn(1, 64), weight.float(), scales)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 12, 16])
@pytest.mark.parametrize(("n", "k"), [(3, 7), (37, 64), (40, 203), (64, 576), (20, 48)])
def test_f32_linear_is_the_float_product(rows: int, n: int, k: int) -> None:
    """Every shape the vector loops leave a remainder of (odd rows, K not a multiple of 8,
    row counts past a tile of 4 or 8 and a block of 16 weight rows; on AVX-512, N a multiple of 4
    and K of 16 with a last block of 4 weight rows) against float64."""
    torch.manual_seed(2)
    x, w = torch.randn(rows, k), torch.randn(n, k) / k**0.5
    got = cpu.f32_linear(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_f32_linear_refuses_what_it_does_not_take() -> None:
    with pytest.raises(RuntimeError, match=r"1\.\.64 rows"):
        cpu.f32_linear(torch.randn(65, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="weight of their width"):
        cpu.f32_linear(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match=r"contiguous torch\.float32"):
        cpu.f32_linear(torch.randn(2, 8), torch.randn(8, 4).T)


def test_the_kernels_can_be_turned_off() -> None:
    code = "from radixlm.kernels import cpu; print(cpu.available())"
    env = {**os.environ, "RADIXLM_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False"


@needs_kernels
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_kernels_build_and_agree_on_older_x86_cpus(march: str, tmp_path: Path) -> None:
    """The library built for CPUs without AVX-512 (`x86-64-v3`: AVX2 and FMA) and without
    AVX2 (`x86-64`: the plain C paths), with `RADIXLM_CPU_MARCH`, loads and passes this file's
    and the decode step's tests in a process of its own. (A name defined only in the AVX-512
    code once kept the library from building anywhere else: every CPU without AVX-512 lost
    all of radixlm's kernels, with a warning in the log and nothing failing here.)"""
    tests = Path(__file__).parent
    env = {**os.environ, "RADIXLM_CPU_MARCH": march, "RADIXLM_CACHE_DIR": str(tmp_path)}
    code = "from radixlm.kernels import cpu; print(cpu.available())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr[-3000:]
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
               str(tests / "test_kernels_cpu.py"), str(tests / "test_kernels_cpu_decode.py"),
               "-k", "not older_x86"]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tests.parent.parent)
    assert out.returncode == 0, out.stdout[-3000:]


@needs_kernels
@pytest.mark.parametrize("group", [32, 128])
def test_a_rows_output_does_not_depend_on_the_other_rows_of_the_call(group: int) -> None:
    """Bit for bit: a row multiplied alone, among others, at any place in a call (a decode
    alone or batched, a speculative verify row) gives the same output."""
    torch.manual_seed(3)
    qweight, scales, zeros = _weights(24, 512, group)
    w8, s8 = rk.quantize_int8_grouped(torch.randn(24, 512) / 512**0.5, 32)
    w32 = torch.randn(24, 512)
    x = torch.randn(16, 512)
    for rows in (2, 3, 5, 8, 13, 16):
        many4 = cpu.int4_linear(x[:rows], qweight, scales, zeros, group)
        many8 = cpu.int8_linear(x[:rows], w8, s8)
        many32 = cpu.f32_linear(x[:rows].contiguous(), w32)
        for row in range(rows):
            one = x[row : row + 1]
            assert torch.equal(many4[row], cpu.int4_linear(one, qweight, scales, zeros, group)[0])
            assert torch.equal(many8[row], cpu.int8_linear(one, w8, s8)[0])
            assert torch.equal(many32[row], cpu.f32_linear(one.contiguous(), w32)[0])


@needs_kernels
@pytest.mark.parametrize("group", [0, 32])
@pytest.mark.parametrize(("n", "k"), [(7, 64), (38, 544), (65, 576), (9, 1536)])
def test_an_int8_row_alone_is_its_row_among_others(group: int, n: int, k: int) -> None:
    """A call of one activation row has a loop of its own (several weight rows in flight):
    per-row and per-group scales, odd and even block counts, N past a multiple of 4; each
    row's output the same bits as in a call of several rows."""
    torch.manual_seed(6)
    w = torch.randn(n, k) / k**0.5
    weight, scales = rk.quantize_int8_grouped(w, group) if group else rk.quantize_int8(w)
    x = torch.randn(11, k)
    many = cpu.int8_linear(x, weight, scales)
    for row in range(11):
        assert torch.equal(many[row], cpu.int8_linear(x[row : row + 1], weight, scales)[0])


@needs_kernels
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize(("n", "k"), [(7, 64), (38, 544), (65, 576), (9, 1536)])
def test_an_int4_row_alone_is_its_row_among_others(group: int, n: int, k: int) -> None:
    """A call of one activation row takes two weight rows at a time (an odd last row alone;
    an odd last block in half a vector); groups of one block and of two; each row's output
    the same bits as in a call of several rows, and its own arithmetic."""
    if k % group:
        pytest.skip("K not a multiple of the group")
    torch.manual_seed(7)
    qweight, scales, zeros = _weights(n, k, group)
    x = torch.randn(11, k)
    many = cpu.int4_linear(x, qweight, scales, zeros, group)
    for row in range(11):
        one = cpu.int4_linear(x[row : row + 1], qweight, scales, zeros, group)
        assert torch.equal(many[row], one[0])
    exact = _kernel_arithmetic(x, qweight, scales, zeros, group)
    torch.testing.assert_close(many, exact, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((5, 3), torch.float32), ((3000, 3, 64), torch.float32), ((700, 8, 128), torch.bfloat16)],
)
def test_zeros_on_huge_pages_are_zeros_of_the_shape(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """A K/V buffer's allocation: zeros of the shape and dtype, contiguous; past a huge page
    of bytes, 2 MB aligned where the system gives huge pages."""
    got = cpu.zeros_on_huge_pages(shape, dtype)
    assert got.shape == shape and got.dtype == dtype and got.is_contiguous()
    assert not got.any()
    got.fill_(1)
    assert bool((got == 1).all())
    if got.storage_offset() or got.untyped_storage().nbytes() != got.numel() * got.element_size():
        assert got.data_ptr() % cpu.HUGE_PAGE == 0  # the aligned view of a longer block


def test_huge_pages_move_the_data_and_keep_the_values() -> None:
    """`move_to_huge_pages` repoints each tensor object at one new allocation (64-byte
    aligned, values and shapes kept, each storage once), leaves a tensor that views part of
    its storage where it is, and moves nothing with RADIXLM_HUGE_PAGES=0."""
    torch.manual_seed(7)
    a, b = torch.randn(300, 77), torch.randint(-128, 128, (1000, 576), dtype=torch.int8)
    part = torch.randn(10, 8)[2:5]
    want = (a.clone(), b.clone(), part.clone())
    before = (a.data_ptr(), b.data_ptr(), part.data_ptr())
    alias = b.view(torch.uint8)  # another object over b's whole storage: it moves with b
    moved = cpu.move_to_huge_pages([a, b, a, part, alias])
    assert torch.equal(a, want[0]) and torch.equal(b, want[1]) and torch.equal(part, want[2])
    assert part.data_ptr() == before[2]
    if moved == 0:  # not Linux, or transparent huge pages off here: nothing moved
        assert (a.data_ptr(), b.data_ptr()) == before[:2]
        return
    assert moved == a.numel() * 4 + b.numel()
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert a.data_ptr() != before[0] and a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0
    assert alias.data_ptr() == b.data_ptr()
    a.add_(1)  # the tensors are still tensors of their own
    assert torch.equal(a, want[0] + 1) and torch.equal(b, want[1])
    code = (
        "import torch; from radixlm.kernels import cpu; "
        "print(cpu.move_to_huge_pages([torch.randn(1000, 1000)]))"
    )
    env = {**os.environ, "RADIXLM_HUGE_PAGES": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "0"


@needs_kernels
@pytest.mark.parametrize(("n", "k"), [(38, 72), (258, 203), (7, 48), (64, 576)])
def test_a_float_rows_output_does_not_depend_on_the_other_rows_at_any_shape(n: int, k: int) -> None:
    """The float32 product's remainders (N not a multiple of 4, K not of 16: AVX2's loops on
    any machine) give a row the same bits alone and among others (deterministic inference
    relies on it)."""
    torch.manual_seed(4)
    w, x = torch.randn(n, k), torch.randn(64, k)
    for rows in (2, 5, 8, 16, 37, 64):
        many = cpu.f32_linear(x[:rows].contiguous(), w)
        for row in range(rows):
            assert torch.equal(many[row], cpu.f32_linear(x[row : row + 1].contiguous(), w)[0])


@needs_kernels
@pytest.mark.parametrize(("n", "k"), [(1, 5), (16, 64), (37, 64), (40, 203), (49, 576), (96, 33)])
def test_panels_hold_the_weight_and_give_it_back(n: int, k: int) -> None:
    """Rows padded with zeros to a multiple of PANEL, each panel column by column; unpacking
    gives the weight back bit for bit."""
    torch.manual_seed(5)
    w = torch.randn(n, k)
    panels = cpu.pack_f32_panels(w)
    count = -(-n // cpu.PANEL)
    assert panels.shape == (count, k, cpu.PANEL) and panels.data_ptr() % 64 == 0
    assert torch.equal(panels[0, :, 0], w[0]) and torch.equal(panels[0, 1, : min(n, 16)], w[:16, 1])
    assert not panels.transpose(1, 2).reshape(count * cpu.PANEL, k)[n:].any()  # the padding
    assert torch.equal(cpu.unpack_f32_panels(panels, n), w)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 70])
@pytest.mark.parametrize(("n", "k"), [(1, 5), (16, 64), (37, 64), (40, 203), (49, 576), (96, 33)])
def test_f32_panel_linear_is_the_float_product(rows: int, n: int, k: int) -> None:
    """Every remainder of the tiles (an odd panel count, a last panel partly padding, row
    counts past a tile of 4 or 8, any K) against float64."""
    torch.manual_seed(6)
    x, w = torch.randn(rows, k), torch.randn(n, k) / k**0.5
    got = cpu.f32_panel_linear(x, cpu.pack_f32_panels(w), n)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize(("n", "k"), [(38, 72), (258, 203), (64, 576)])
def test_a_rows_panel_product_does_not_depend_on_the_other_rows(n: int, k: int) -> None:
    """Bit for bit, alone or among others at any place of a call (every output is its column
    products summed in column order)."""
    torch.manual_seed(7)
    w, x = torch.randn(n, k), torch.randn(70, k)
    panels = cpu.pack_f32_panels(w)
    for rows in (2, 5, 8, 13, 70):
        many = cpu.f32_panel_linear(x[:rows].contiguous(), panels, n)
        for row in range(rows):
            one = cpu.f32_panel_linear(x[row : row + 1].contiguous(), panels, n)
            assert torch.equal(many[row], one[0])


@needs_kernels
def test_f32_panel_linear_refuses_what_it_does_not_take() -> None:
    panels = cpu.pack_f32_panels(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="do not hold 40 rows"):
        cpu.f32_panel_linear(torch.randn(2, 8), panels, 40)
    with pytest.raises(RuntimeError, match="do not hold 20 rows of x's 9 columns"):
        cpu.f32_panel_linear(torch.randn(2, 9), panels, 20)
    with pytest.raises(RuntimeError, match=r"contiguous torch\.float32"):
        cpu.f32_panel_linear(torch.randn(8, 2).T, panels, 20)
    with pytest.raises(RuntimeError, match="does not hold 33 rows"):
        cpu.unpack_f32_panels(panels, 33)
    with pytest.raises(RuntimeError, match="float32"):
        cpu.pack_f32_panels(torch.randn(4, 4, dtype=torch.float64))


@pytest.fixture
def torch_threads():
    """Sets torch's intra-op thread count (which the kernels follow) for a test, and puts the
    count back after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize(("n", "k"), [(517, 512), (1000, 256)])
def test_every_product_gives_the_same_bits_on_one_thread_and_on_several(
    torch_threads, n: int, k: int
) -> None:
    """Weights large enough to split their output columns over threads (N not a multiple of
    the split): each product on three threads equals itself on one, bit for bit, and the
    torch reference."""
    torch.manual_seed(8)
    qweight, scales, zeros = _weights(n, k, 64)
    w8, s8 = rk.quantize_int8_grouped(torch.randn(n, k) / k**0.5, 32)
    w32 = torch.randn(n, k) / k**0.5
    panels = cpu.pack_f32_panels(w32)
    x = torch.randn(70, k)
    products = {
        "int4": (16, lambda rows: cpu.int4_linear(rows, qweight, scales, zeros, 64)),
        "int8": (16, lambda rows: cpu.int8_linear(rows, w8, s8)),
        "float32": (64, lambda rows: cpu.f32_linear(rows, w32)),
        "panels": (70, lambda rows: cpu.f32_panel_linear(rows, panels, n)),
    }
    for name, (most, product) in products.items():
        for rows in {1, 5, most}:
            part = x[:rows].contiguous()
            torch_threads(1)
            one = product(part)
            torch_threads(3)
            several = product(part)
            assert torch.equal(one, several), (name, rows)
    torch.testing.assert_close(several, (x.double() @ w32.double().T).float(), rtol=1e-5, atol=1e-5)
    torch_threads(3)
    torch.testing.assert_close(
        cpu.int4_linear(x[:4].contiguous(), qweight, scales, zeros, 64),
        _kernel_arithmetic(x[:4], qweight, scales, zeros, 64),
        rtol=1e-4,
        atol=1e-4,
    )


@needs_kernels
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 49152])
def test_greedy_tokens_are_torchs_argmax(n: int) -> None:
    """Ties (the first of them), a NaN (the first NaN), -inf and inf, rows of a wider
    tensor (a stride past the row's width), N past a multiple of 16: torch's ids."""
    torch.manual_seed(n)
    wide = torch.randn(9, n + 5)
    x = wide[:, :n]
    x[1] = 0.5  # all tied
    x[2, n // 2 :] = 7.0  # tied largest from the middle on
    x[3] = float("-inf")
    x[4, -1] = float("inf")
    x[5, n // 3] = float("nan")
    x[6, -1] = float("nan")
    x[6, 0] = float("inf")
    x[7] = torch.round(x[7] * 2) / 2  # many ties below the top
    got = rk.greedy_tokens(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(cpu.argmax_rows(x.contiguous()), x.argmax(dim=-1))


def test_greedy_tokens_take_any_float_tensor() -> None:
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    assert torch.equal(rk.greedy_tokens(x), x.argmax(dim=-1))
    t = torch.randn(40, 3).t()  # no unit stride along a row: torch's argmax
    assert torch.equal(rk.greedy_tokens(t), t.argmax(dim=-1))
    assert rk.greedy_tokens(torch.randn(0, 5)).shape == (0,)
    with pytest.raises(ValueError, match="greedy_tokens"):
        rk.greedy_tokens(torch.randn(5))


def _torch_draws(x: torch.Tensor, t: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The torch path's draws (softmax, cumsum, searchsorted) and each row's cumulative mass
    and target."""
    probs = torch.softmax(x / t[:, None], dim=-1).nan_to_num_(0.0)
    cumulative = probs.cumsum(dim=-1)
    target = u * cumulative[:, -1]
    chosen = torch.searchsorted(cumulative, target[:, None], right=True)[:, 0]
    return chosen.clamp_(max=x.shape[1] - 1), cumulative, target


@needs_kernels
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 49152])
def test_sampled_tokens_are_the_torch_paths_draws(n: int) -> None:
    """Rows of a wider tensor (a stride past the row's width), N past a multiple of 16, a
    temperature per row, 64 uniforms each: the torch path's token, unless the uniform's
    target lies within float32 rounding of the boundary between the two tokens."""
    torch.manual_seed(n)
    wide = torch.randn(6, n + 5) * 4
    x = wide[:, :n]
    x[2, n // 2 :] = float("-inf")  # a masked half
    temperatures = torch.tensor([0.3, 0.7, 1.0, 1.5, 2.0, 0.05])
    for _ in range(64):
        uniforms = torch.rand(6)
        got = rk.sample_tokens(x, temperatures, uniforms)
        assert got.dtype == torch.int64 and torch.equal(
            got, cpu.sample_rows(x, temperatures, uniforms)
        )
        want, cumulative, target = _torch_draws(x, temperatures, uniforms)
        for row in torch.nonzero(got != want).flatten().tolist():
            edge = min(int(got[row]), int(want[row]))
            assert abs(float(cumulative[row, edge] - target[row])) < 1e-5, (row, got, want)
        drawn = x.gather(1, got[:, None])[:, 0]
        has_mass = (x > float("-inf")).any(dim=1)
        assert bool((drawn[has_mass] > float("-inf")).all())  # never a masked token


@needs_kernels
def test_sampled_tokens_follow_the_distribution() -> None:
    """The draw is the inverse CDF of softmax(x / t): uniforms on an even grid give each
    token a count within 2 of its probability x the grid's size."""
    x = torch.tensor([[1.0, -2.0, 0.5, float("-inf"), 3.0, 0.0] * 3])
    grid = 20_000
    for t in (0.5, 1.0, 3.0):
        probs = torch.softmax(x[0] / t, dim=-1)
        uniforms = (torch.arange(grid, dtype=torch.float32) + 0.5) / grid
        rows = x.expand(grid, -1).contiguous()
        got = rk.sample_tokens(rows, torch.full((grid,), t), uniforms)
        counts = torch.bincount(got, minlength=x.shape[1]).float()
        assert (counts - probs * grid).abs().max() <= 2, (t, counts, probs * grid)


@needs_kernels
def test_sampled_tokens_of_rows_without_mass_and_on_threads() -> None:
    """All -inf, all NaN, a +inf: no mass, the last token (as the torch path); NaNs beside
    finite values weigh 0; the same draws on one thread and on two."""
    x = torch.randn(5, 40)
    x[0] = float("-inf")
    x[1] = float("nan")
    x[2, 7] = float("inf")
    x[3, ::2] = float("nan")
    t, u = torch.ones(5), torch.rand(5)
    got = rk.sample_tokens(x, t, u)
    assert got[:3].tolist() == [39, 39, 39]
    assert int(got[3]) % 2 == 1
    many = torch.randn(37, 3000)
    temperatures, uniforms = torch.rand(37) + 0.2, torch.rand(37)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.sample_rows(many, temperatures, uniforms)
        torch.set_num_threads(2)
        two = cpu.sample_rows(many, temperatures, uniforms)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_sample_tokens_take_any_float_tensor_and_refuse_what_does_not_fit() -> None:
    x = torch.randn(3, 40, dtype=torch.bfloat16)  # torch's path
    want, _, _ = _torch_draws(x.float(), torch.ones(3), torch.full((3,), 0.5))
    assert torch.equal(rk.sample_tokens(x, torch.ones(3), torch.full((3,), 0.5)), want)
    assert rk.sample_tokens(torch.randn(0, 5), torch.ones(0), torch.ones(0)).shape == (0,)
    with pytest.raises(ValueError, match="sample_tokens"):
        rk.sample_tokens(torch.randn(2, 5), torch.ones(3), torch.rand(2))
    if cpu.available():
        with pytest.raises(RuntimeError, match="temperatures > 0"):
            cpu.sample_rows(torch.randn(2, 5), torch.tensor([1.0, 0.0]), torch.rand(2))
        with pytest.raises(RuntimeError, match="float32"):
            cpu.sample_rows(torch.randn(2, 5), torch.ones(2, dtype=torch.float64), torch.rand(2))
