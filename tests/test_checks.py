"""qcoll.checks: the one int/bool argument checker behind every public entry point."""
import pytest

from qcoll.checks import ArgumentTypeError, check_bool, check_int


@pytest.mark.parametrize("bad", [True, False, 1.0, "3", None])
def test_check_int_rejects_non_ints_as_type_and_value_errors(bad):
    with pytest.raises(TypeError, match=r"num_chunks must be a positive int, got .*\(") as e:
        check_int(bad, "num_chunks", minimum=1)
    assert isinstance(e.value, ValueError) and isinstance(e.value, ArgumentTypeError)


@pytest.mark.parametrize("kwargs,value,words", [
    ({"minimum": 1}, 0, "a positive int, got 0"), ({"minimum": 0}, -1, "a non-negative int, got -1"),
    ({"minimum": 1, "maximum": 8}, 9, r"an int in \[1, 8\], got 9"), ({"maximum": 3}, 4, "an int <= 3, got 4"),
    ({"minimum": 2}, 1, "an int >= 2, got 1"),
])
def test_check_int_range(kwargs, value, words):
    with pytest.raises(ValueError, match=f"x must be {words}") as e:
        check_int(value, "x", **kwargs)
    assert not isinstance(e.value, TypeError)
    assert check_int(value + (1 if value < kwargs.get("minimum", value) else -1), "x", **kwargs) is not None


def test_check_int_passes_the_value_through():
    assert check_int(7, "x") == 7 and check_int(0, "x", minimum=0, maximum=0) == 0


@pytest.mark.parametrize("bad", [1, 0, None, "True"])
def test_check_bool(bad):
    with pytest.raises(TypeError, match="async_op must be a bool"):
        check_bool(bad, "async_op")
    assert check_bool(False, "async_op") is False


@pytest.mark.parametrize("value,bounds,ok", [
    (0.5, dict(above=-1, below=1), True), (1, dict(above=-1, below=1), False), (-1.0, dict(above=-1, below=1), False),
    (0, dict(minimum=0), True), (-1e-300, dict(minimum=0), False), (60, dict(minimum=0, maximum=60), True),
    (60.0001, dict(minimum=0, maximum=60), False), (1.0, dict(above=1.0), False), (1.01, dict(above=1.0), True),
    (float("nan"), {}, False), (float("inf"), {}, False), (-float("inf"), dict(below=0), False), (10**400, {}, False),
    (3, {}, True),
])
def test_check_number_against_the_plain_comparisons(value, bounds, ok):
    """The oracle: the comparisons written out, with NaN and infinities never in range."""
    from qcoll.checks import check_number
    if ok:
        assert check_number(value, "x", **bounds) == float(value)
    else:
        with pytest.raises(ValueError, match=r"^x must be .*got "):
            check_number(value, "x", **bounds)


@pytest.mark.parametrize("value", [True, False, "1.0", None, [1.0], 1j])
def test_check_number_refuses_what_is_not_a_number_as_both_type_and_value_error(value):
    from qcoll.checks import ArgumentTypeError, check_number
    with pytest.raises(ArgumentTypeError, match=r"^rate must be a number in \(0, 1\], got ") as info:
        check_number(value, "rate", above=0, maximum=1)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
