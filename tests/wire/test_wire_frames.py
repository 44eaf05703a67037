"""encode_tensors and decode_tensors: round trips, agreement with safetensors, zero copy."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

from diloco.wire import DTYPE_NAMES, decode_tensors, encode_tensors, torch_dtype

ALL_DTYPES = [torch_dtype(name) for name in DTYPE_NAMES]


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(low, high, shape, generator=generator, dtype=dtype)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)], ids=str)
def test_round_trip_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensors = {"x": _sample(dtype, shape), "y": _sample(dtype, (7,), seed=1)}
    decoded = decode_tensors(encode_tensors(tensors))
    _assert_same(decoded, tensors)


def test_round_trip_mixed_dict_and_empty_dict() -> None:
    tensors = {f"t{i}": _sample(dtype, (i + 1, 2), seed=i) for i, dtype in enumerate(ALL_DTYPES)}
    _assert_same(decode_tensors(encode_tensors(tensors)), tensors)
    assert decode_tensors(encode_tensors({})) == {}


def test_float_dtype_casts_floats_only() -> None:
    tensors = {
        "w": torch.randn(4, 3, dtype=torch.float64),
        "h": torch.randn(2, dtype=torch.float16),
        "n": torch.tensor([1, 2, 3]),
        "m": torch.tensor([True, False]),
    }
    decoded = decode_tensors(encode_tensors(tensors, float_dtype=torch.bfloat16))
    assert decoded["w"].dtype == torch.bfloat16
    assert decoded["h"].dtype == torch.bfloat16
    assert torch.equal(decoded["w"], tensors["w"].to(torch.bfloat16))
    assert decoded["n"].dtype == torch.int64
    assert decoded["m"].dtype == torch.bool
    _assert_same({k: decoded[k] for k in "nm"}, {k: tensors[k] for k in "nm"})


def test_encode_detaches_packs_views_and_copies_tied_weights() -> None:
    base = torch.randn(4, 6, requires_grad=True)
    embedding = torch.nn.Embedding(5, 3)
    tensors = {
        "param": base,
        "transposed": base.detach().t(),
        "slice": base.detach()[:, 1:3],
        "tok_emb.weight": embedding.weight,
        "head.weight": embedding.weight,
    }
    decoded = decode_tensors(encode_tensors(tensors))
    assert not decoded["param"].requires_grad
    for name, tensor in tensors.items():
        assert torch.equal(decoded[name], tensor.detach()), name


def test_encode_refuses_non_tensors() -> None:
    with pytest.raises(TypeError, match="'x' is a int"):
        encode_tensors({"x": 3})  # type: ignore[dict-item]


def test_decode_is_a_view_of_a_writable_buffer() -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}
    buffer = bytearray(encode_tensors(tensors))
    decoded = decode_tensors(buffer)
    index = buffer.rfind(torch.tensor([5.0]).numpy().tobytes())
    buffer[index : index + 4] = torch.tensor([42.0]).numpy().tobytes()
    assert decoded["a"][1, 2].item() == 42.0
    decoded["b"][0] = 7.0
    assert torch.tensor([7.0]).numpy().tobytes() in buffer


def test_decode_of_a_memoryview_shares_it_and_bytes_are_copied_without_warning() -> None:
    data = bytes(encode_tensors({"a": torch.zeros(3)}))
    backing = bytearray(data)
    decoded = decode_tensors(memoryview(backing))
    decoded["a"][0] = 1.0
    assert bytes(backing) != data
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_bytes = decode_tensors(data)
        from_readonly_view = decode_tensors(memoryview(data))
    from_bytes["a"][0] = 2.0
    assert from_readonly_view["a"][0].item() == 0.0


def test_decode_reads_metadata_files_written_by_safetensors() -> None:
    tensors = {"w": torch.randn(3, 2), "s": torch.tensor(4, dtype=torch.int32)}
    decoded = decode_tensors(save(tensors, metadata={"format": "pt", "round": "3"}))
    _assert_same(decoded, tensors)


_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
_shapes = st.lists(st.integers(min_value=0, max_value=4), min_size=0, max_size=3).map(tuple)


@st.composite
def _tensor_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    names = draw(
        st.lists(_names, max_size=6, unique=True).filter(lambda n: "__metadata__" not in n)
    )
    return {
        name: _sample(
            draw(st.sampled_from(ALL_DTYPES)), draw(_shapes), seed=draw(st.integers(0, 1000))
        )
        for name in names
    }


@settings(max_examples=60, deadline=None)
@given(_tensor_dicts())
def test_decode_agrees_with_safetensors_load(tensors: dict[str, torch.Tensor]) -> None:
    data = save(tensors)
    _assert_same(decode_tensors(data), load(data))
    _assert_same(decode_tensors(encode_tensors(tensors)), tensors)
