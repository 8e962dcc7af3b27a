"""Backend selection, availability and argument checks of the public functions."""

from __future__ import annotations

import pytest
import torch

import radixlm.kernels as rk
from radixlm.kernels import _backend, reference


def test_package_exports_a_version_and_every_public_name() -> None:
    assert rk.__version__.count(".") == 2
    for name in rk.__all__:
        assert hasattr(rk, name), name


def test_available_when_the_interpreter_is_on_or_cuda_is_present() -> None:
    pytest.importorskip("triton")
    assert rk.available() == (rk.interpreter_enabled() or torch.cuda.is_available())


def test_not_available_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, "triton_installed", lambda: False)
    assert rk.available() is False


def test_use_backend_as_a_context_manager_restores_the_previous_setting() -> None:
    before = rk.get_backend()
    with rk.use_backend("reference") as switch:
        assert switch.backend == "reference"
        assert rk.get_backend() == "reference"
        with rk.use_backend("triton"):
            assert rk.get_backend() == "triton"
        assert rk.get_backend() == "reference"
    assert rk.get_backend() == before


def test_use_backend_called_plainly_sets_the_backend_for_the_process() -> None:
    before = rk.get_backend()
    try:
        rk.use_backend("reference")
        assert rk.get_backend() == "reference"
    finally:
        rk.use_backend(before)
    assert rk.get_backend() == before


def test_use_backend_rejects_an_unknown_name() -> None:
    with pytest.raises(ValueError, match="auto, triton, reference"):
        rk.use_backend("cuda")  # type: ignore[arg-type]


def test_unknown_backend_in_the_environment_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_backend.ENV_BACKEND, "fast")
    with pytest.raises(ValueError, match="RADIXLM_KERNELS_BACKEND"):
        _backend._initial_backend()


def test_auto_runs_the_reference_on_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(reference, "silu_and_mul", lambda x: calls.append(x) or x[..., :2])
    with rk.use_backend("auto"):
        rk.silu_and_mul(torch.randn(3, 4))
    assert len(calls) == 1


def test_reference_backend_never_touches_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, "triton_installed", lambda: False)
    with rk.use_backend("reference"):
        out = rk.silu_and_mul(torch.randn(2, 8))
    assert out.shape == (2, 4)


def test_forcing_triton_on_cpu_without_the_interpreter_says_how_to_fix_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    monkeypatch.setattr(_backend, "interpreter_enabled", lambda: False)
    with rk.use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        rk.silu_and_mul(torch.randn(2, 8))


def test_forcing_triton_without_triton_installed_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_backend, "triton_installed", lambda: False)
    with rk.use_backend("triton"), pytest.raises(RuntimeError, match="not installed"):
        rk.silu_and_mul(torch.randn(2, 8))


def _pool(slots: int = 8, kv_heads: int = 2, head_dim: int = 16) -> torch.Tensor:
    return torch.zeros(slots, kv_heads, head_dim)


def test_decode_rejects_heads_that_are_not_a_multiple_of_kv_heads() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        rk.decode_attention(
            torch.zeros(1, 3, 16),
            _pool(),
            _pool(),
            torch.zeros(1, 4, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
        )


def test_decode_rejects_a_pool_of_another_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        rk.decode_attention(
            torch.zeros(1, 2, 16).half(),
            _pool(),
            _pool(),
            torch.zeros(1, 4, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
        )


def test_decode_rejects_seq_lens_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match=r"seq_lens must have shape \[batch\] = \[2\]"):
        rk.decode_attention(
            torch.zeros(2, 2, 16),
            _pool(),
            _pool(),
            torch.zeros(2, 4, dtype=torch.int32),
            torch.ones(3, dtype=torch.int32),
        )


def test_extend_rejects_a_float_table() -> None:
    with pytest.raises(ValueError, match="req_to_token must be int32 or int64"):
        rk.extend_attention(
            torch.zeros(2, 2, 16),
            _pool(),
            _pool(),
            torch.zeros(1, 4),
            torch.zeros(1, dtype=torch.int32),
            torch.full((1,), 2),
        )


def test_store_kv_rejects_rows_that_do_not_fit_the_pool() -> None:
    with pytest.raises(ValueError, match="pool rows"):
        rk.store_kv(
            torch.zeros(2, 1, 16), torch.zeros(2, 1, 16), _pool(), _pool(), torch.tensor([0, 1])
        )


def test_rotary_rejects_a_table_wider_than_the_head() -> None:
    with pytest.raises(ValueError, match="rotary_dim"):
        rk.rotary_embedding(
            torch.zeros(1, 1, 8),
            torch.zeros(1, 1, 8),
            torch.zeros(4, 8),
            torch.zeros(4, 8),
            torch.tensor([0]),
        )


def test_bitmask_must_be_int32() -> None:
    with pytest.raises(ValueError, match="bitmask must be int32"):
        rk.apply_token_bitmask_inplace(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64))


def test_sampling_rejects_per_row_parameters_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="top_p must have shape"):
        rk.sample_from_probs(
            torch.ones(2, 4),
            torch.zeros(2, dtype=torch.int64),
            torch.ones(3),
            torch.zeros(2),
            torch.zeros(2),
        )


def test_silu_and_mul_rejects_an_odd_width() -> None:
    with pytest.raises(ValueError, match="even"):
        rk.silu_and_mul(torch.zeros(2, 5))
