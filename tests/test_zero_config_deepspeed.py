"""``ZeroConfig.from_deepspeed`` reads a DeepSpeed config as DeepSpeed does (issue 27, item 5).

The expected values are DeepSpeed's documented meaning of each key (its pydantic config models:
booleans are bools, 0/1 or "true"/"false"; ``bf16``/``fp16`` ``enabled`` pick the compute
dtype and exclude each other; ``zero_hpz_partition_size > 1`` turns hpZ on), not whatever the
code happens to return. No processes: plain dicts in, ``ZeroConfig`` fields out.
"""
import re
import types
import warnings

import pytest
import torch
import torch.distributed as dist

import qcoll
from qcoll import zero
from qcoll.comm import topology as topology_module


def _ds(zero_keys=None, **top):
    return {"zero_optimization": {"stage": 3, **(zero_keys or {})}, **top}


def _quiet(config, **kwargs):
    """from_deepspeed with every warning an error: the config names nothing ignored or 'auto'."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return zero.ZeroConfig.from_deepspeed(config, **kwargs)


# DeepSpeed booleans: True/False, ints 0/1 (pydantic), "true"/"false" in any case.
_TRUE = [True, 1, "true", "True", "TRUE", "tRuE"]
_FALSE = [False, 0, "false", "False", "FALSE", "fAlSe"]
_NOT_BOOLS = ["yes", "no", "", "on", "1", 1.5, 1.0, 2, -1, None, [], {}]


@pytest.mark.parametrize("value", _TRUE)
def test_quantized_keys_true_spellings_turn_quantization_on(value):
    c = _quiet(_ds({"zero_quantized_weights": value, "zero_quantized_gradients": value}))
    assert (c.weight_bits, c.grad_bits) == (8, 4)


@pytest.mark.parametrize("value", _FALSE)
def test_quantized_keys_false_spellings_leave_quantization_off(value):
    """"false" used to turn quantization on (a non-empty string is truthy)."""
    c = _quiet(_ds({"zero_quantized_weights": value, "zero_quantized_gradients": value}))
    assert (c.weight_bits, c.grad_bits) == (None, None)


def test_quantized_keys_are_independent():
    c = _quiet(_ds({"zero_quantized_weights": "false", "zero_quantized_gradients": "true"}))
    assert (c.weight_bits, c.grad_bits) == (None, 4)
    c = _quiet(_ds({"zero_quantized_weights": "TRUE", "zero_quantized_gradients": "False"}))
    assert (c.weight_bits, c.grad_bits) == (8, None)


@pytest.mark.parametrize("value", _NOT_BOOLS, ids=repr)
@pytest.mark.parametrize("path", ["zero_optimization.zero_quantized_weights",
                                  "zero_optimization.zero_quantized_gradients", "bf16.enabled", "fp16.enabled"])
def test_a_non_boolean_is_a_value_error_naming_the_key_and_the_value(path, value):
    section, key = path.split(".")
    config = _ds()
    config.setdefault(section, {})[key] = value
    with pytest.raises(ValueError, match=rf"^{re.escape(path)} must be true or false .*got {re.escape(repr(value))}$"):
        zero.ZeroConfig.from_deepspeed(config)


@pytest.mark.parametrize("section,dtype", [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                           ("fp16", torch.float16)])
@pytest.mark.parametrize("value", [True, "true", "True", 1])
def test_precision_enabled_sets_the_compute_dtype(section, dtype, value):
    """bf16 / fp16 training computes in that dtype (``bfloat16`` is DeepSpeed's older name of ``bf16``)."""
    c = _quiet(_ds(**{section: {"enabled": value}}))
    assert c.compute_dtype == dtype and c.dtype == dtype


@pytest.mark.parametrize("value", [False, "false", "FALSE", 0])
def test_precision_disabled_keeps_fp32(value):
    c = _quiet(_ds(bf16={"enabled": value}, fp16={"enabled": value}))
    assert c.compute_dtype is None and c.dtype == torch.float32
    assert _quiet(_ds(bf16={})).compute_dtype is None


def test_bf16_is_read_before_the_old_bfloat16_spelling():
    """DeepSpeed reads ``bfloat16`` only when ``bf16`` is absent; the unread one is ignored (and named)."""
    with pytest.warns(UserWarning, match=r"ignores these DeepSpeed keys: bfloat16$"):
        c = zero.ZeroConfig.from_deepspeed(_ds(bf16={"enabled": False}, bfloat16={"enabled": True}))
    assert c.compute_dtype is None


@pytest.mark.parametrize("bf16,fp16", [(True, True), ("true", "TRUE"), (1, True)])
def test_bf16_and_fp16_both_enabled_is_a_value_error_naming_both(bf16, fp16):
    with pytest.raises(ValueError, match=r"bf16\.enabled and fp16\.enabled are both true"):
        zero.ZeroConfig.from_deepspeed(_ds(bf16={"enabled": bf16}, fp16={"enabled": fp16}))


def test_a_compute_dtype_override_wins():
    c = _quiet(_ds(bf16={"enabled": True}), compute_dtype=torch.float16)
    assert c.compute_dtype == torch.float16
    c = _quiet(_ds(fp16={"enabled": "true"}), compute_dtype=None)
    assert c.compute_dtype is None


def test_precision_sections_are_read_and_their_other_keys_named_as_ignored():
    ds = _ds({"overlap_comm": True}, train_batch_size=8,
             fp16={"enabled": "true", "loss_scale": 0, "initial_scale_power": 16}, bf16={"enabled": False})
    with pytest.warns(UserWarning) as caught:
        c = zero.ZeroConfig.from_deepspeed(ds)
    said = [str(w.message) for w in caught]
    assert said == ["qcoll ZeroConfig.from_deepspeed ignores these DeepSpeed keys: zero_optimization.overlap_comm, "
                    "fp16.initial_scale_power, fp16.loss_scale, train_batch_size"]
    assert c.compute_dtype == torch.float16


@pytest.mark.parametrize("section", ["bf16", "fp16"])
def test_precision_enabled_auto_keeps_fp32_with_one_warning(section):
    """Hugging Face writes "auto" (its Trainer fills it in); qcoll keeps its default, fp32 compute."""
    with pytest.warns(UserWarning) as caught:
        c = zero.ZeroConfig.from_deepspeed(_ds(**{section: {"enabled": "auto"}}))
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and f"{section}.enabled is 'auto'" in said[0], said
    assert c.compute_dtype is None


# -- hpZ partition size ---------------------------------------------------------------------------------


@pytest.mark.parametrize("size,hpz,partition", [(None, False, None), (1, False, None), (2, True, 2),
                                                (8, True, 8), (16, True, 16)])
def test_hpz_partition_size_maps_to_hpz_and_the_new_field(size, hpz, partition):
    """DeepSpeed: 1 (the default) is no hpZ; a size > 1 is hpZ with secondary groups of that many ranks."""
    c = _quiet(_ds({} if size is None else {"zero_hpz_partition_size": size}))
    assert (c.hpz, c.hpz_partition_size) == (hpz, partition)


def test_hpz_partition_size_field_is_validated():
    assert zero.ZeroConfig().hpz_partition_size is None
    assert zero.ZeroConfig(hpz_partition_size=4).hpz_partition_size == 4
    with pytest.raises(ValueError, match=r"hpz_partition_size must be a positive int, got 0"):
        zero.ZeroConfig(hpz_partition_size=0)
    with pytest.raises(ValueError, match=r"hpz_partition_size must be a positive int, got '8'"):
        zero.ZeroConfig(hpz_partition_size="8")
    with pytest.raises(ValueError, match=r"hpz_partition_size=8 needs hpz=True"):
        zero.ZeroConfig(hpz=False, hpz_partition_size=8)
    with pytest.raises(ValueError, match=r"hpz_partition_size=8 needs hpz=True"):
        zero.ZeroConfig.zero3(hpz_partition_size=8)


def _node(ranks_per_node):
    return types.SimpleNamespace(ranks_per_node=ranks_per_node)


def test_check_topology_refuses_a_partition_size_other_than_the_node():
    """zero_hpz_partition_size=16 on nodes of 2 ranks: qcoll's secondary group is the node."""
    c = _quiet(_ds({"zero_hpz_partition_size": 16}))
    with pytest.raises(ValueError, match=r"zero_hpz_partition_size\) is 16, .*ranks_per_node=2 .*"
                                         r"secondary group is the node: set it to 2 \(ranks_per_node\) or drop it"):
        c.check_topology(_node(2))
    assert c.check_topology(_node(16)) is None
    for node in (1, 2, 8):
        assert zero.ZeroConfig().check_topology(_node(node)) is None
        assert zero.ZeroConfig.zero3().check_topology(_node(node)) is None
    with pytest.raises(ValueError, match=r"is 4, .*ranks_per_node=8"):
        zero.ZeroConfig(hpz_partition_size=4).check_topology(_node(8))


def test_check_topology_with_a_real_topology(tmp_path, monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    monkeypatch.setattr(topology_module, "_current", topology_module._current)
    monkeypatch.setattr(topology_module, "_groups", {})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        topology = qcoll.Topology(1)
        zero.ZeroConfig().check_topology(topology)
        zero.ZeroConfig(hpz_partition_size=1).check_topology(topology)
        with pytest.raises(ValueError, match=r"is 2, .*ranks_per_node=1"):
            zero.ZeroConfig(hpz_partition_size=2).check_topology(topology)
    finally:
        dist.destroy_process_group()


def test_ranks_per_node_mismatch_is_a_value_error_in_from_deepspeed():
    """It used to be a warning, and the config then ran with the node as the group regardless."""
    with pytest.raises(ValueError, match=r"zero_hpz_partition_size\) is 16, .*ranks_per_node=2"):
        zero.ZeroConfig.from_deepspeed(_ds({"zero_hpz_partition_size": 16}), ranks_per_node=2)
    c = _quiet(_ds({"zero_hpz_partition_size": 2}), ranks_per_node=2)
    assert (c.hpz, c.hpz_partition_size) == (True, 2)
    c = _quiet(_ds({"zero_hpz_partition_size": 1}), ranks_per_node=2)
    assert (c.hpz, c.hpz_partition_size) == (False, None)


def test_overrides_win_over_the_hpz_partition_size():
    c = _quiet(_ds({"zero_hpz_partition_size": 16}), ranks_per_node=2, hpz_partition_size=None)
    assert (c.hpz, c.hpz_partition_size) == (True, None)
    c = _quiet(_ds({"zero_hpz_partition_size": 16}), ranks_per_node=2, hpz=False)
    assert (c.hpz, c.hpz_partition_size) == (False, None)


# -- sizes: "auto" and numeric strings -------------------------------------------------------------------


_SIZE_KEYS = ["zero_hpz_partition_size", "stage3_param_persistence_threshold", "reduce_bucket_size"]


@pytest.mark.parametrize("key", _SIZE_KEYS)
def test_auto_keeps_qcolls_default_for_every_size_key_with_one_warning(key):
    with pytest.warns(UserWarning) as caught:
        c = zero.ZeroConfig.from_deepspeed(_ds({key: "auto"}))
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and f"zero_optimization.{key} is 'auto'" in said[0], said
    default = zero.ZeroConfig()
    assert (c.persist_threshold, c.reduce_bucket_numel) == (default.persist_threshold, default.reduce_bucket_numel)
    # "auto" hpZ size: hpZ on, the node as its group (qcoll's default); otherwise DeepSpeed's default, off.
    assert (c.hpz, c.hpz_partition_size) == ((True, None) if key == "zero_hpz_partition_size" else (False, None))


def test_auto_hpz_size_says_the_node():
    with pytest.warns(UserWarning, match=r"zero_hpz_partition_size is 'auto'; .*hpZ with the node as the group"):
        zero.ZeroConfig.from_deepspeed(_ds({"zero_hpz_partition_size": "auto"}), ranks_per_node=4)


@pytest.mark.parametrize("text,number", [("8", 8), (" 8 ", 8), ("8.0", 8), ("8e0", 8), ("1e5", 100_000),
                                         ("5e8", 500_000_000), ("500000000", 500_000_000), (8.0, 8)])
@pytest.mark.parametrize("key,field", [("stage3_param_persistence_threshold", "persist_threshold"),
                                       ("reduce_bucket_size", "reduce_bucket_numel"),
                                       ("zero_hpz_partition_size", "hpz_partition_size")])
def test_numeric_strings_are_read_as_numbers_for_every_size_key(key, field, text, number):
    c = _quiet(_ds({key: text}))
    assert getattr(c, field) == number
    if key == "zero_hpz_partition_size":
        assert c.hpz


@pytest.mark.parametrize("value", ["lots", "1.5", "", "nan", "inf", float("inf"), float("nan"), 1.5, -1, "-1",
                                   True, None, [8]], ids=repr)
@pytest.mark.parametrize("key", _SIZE_KEYS)
def test_a_bad_size_is_a_value_error_naming_the_key_and_the_value(key, value):
    with pytest.raises(ValueError, match=rf"^zero_optimization\.{key} must be a whole number >= \d or 'auto', got "):
        zero.ZeroConfig.from_deepspeed(_ds({key: value}))


def test_hpz_size_zero_is_refused_and_thresholds_zero_are_allowed():
    with pytest.raises(ValueError, match=r"zero_hpz_partition_size must be a whole number >= 1 .*got 0"):
        zero.ZeroConfig.from_deepspeed(_ds({"zero_hpz_partition_size": 0}))
    c = _quiet(_ds({"stage3_param_persistence_threshold": "0", "reduce_bucket_size": 0}))
    assert (c.persist_threshold, c.reduce_bucket_numel) == (0, 0)


# -- unchanged behaviour --------------------------------------------------------------------------------


def test_plain_constructors_and_the_zeropp_mapping_still_hold():
    assert zero.ZeroConfig().weight_bits == 8 and zero.ZeroConfig().hpz_partition_size is None
    assert zero.ZeroConfig.zero3() == zero.ZeroConfig(weight_bits=None, hpz=False, grad_bits=None)
    assert _quiet({"stage": 3}) == zero.ZeroConfig.zero3()
    c = _quiet(_ds({"zero_quantized_weights": True, "zero_hpz_partition_size": 8, "zero_quantized_gradients": True,
                    "stage3_param_persistence_threshold": 1e4, "reduce_bucket_size": 5e8}),
               ranks_per_node=8, prefetch=2)
    assert (c.weight_bits, c.grad_bits, c.hpz, c.hpz_partition_size) == (8, 4, True, 8)
    assert (c.persist_threshold, c.reduce_bucket_numel, c.prefetch, c.compute_dtype) == (10_000, 500_000_000, 2, None)
    with pytest.raises(ValueError, match="stage 3 only"):
        zero.ZeroConfig.from_deepspeed(_ds({"stage": 2}))


@pytest.mark.parametrize("keys,named", [
    ({"offload_optimizer": {"device": "cpu", "pin_memory": True}}, "zero_optimization.offload_optimizer.device='cpu'"),
    ({"offload_param": {"device": "nvme", "nvme_path": "/local"}}, "zero_optimization.offload_param.device='nvme'"),
    ({"cpu_offload": True}, "zero_optimization.cpu_offload=true"),
    ({"cpu_offload_params": "true"}, "zero_optimization.cpu_offload_params=true"),
])
def test_offload_asked_for_is_an_error_naming_the_key(keys, named):
    """DeepSpeed would keep that state in host memory; qcoll keeps it on the device, so a run that
    asked for offload must not silently get none (issue 39, item 3)."""
    with pytest.raises(ValueError, match="does not offload") as info:
        zero.ZeroConfig.from_deepspeed(_ds(keys))
    assert named in str(info.value) and "ignore_unsupported=True" in str(info.value)
    with pytest.warns(UserWarning, match="ignores these DeepSpeed keys: " + re.escape(f"zero_optimization.{next(iter(keys))}")):
        c = zero.ZeroConfig.from_deepspeed(_ds(keys), ignore_unsupported=True)
    assert c == zero.ZeroConfig.from_deepspeed(_ds(), ignore_unsupported=True)


def test_offload_to_none_is_no_offload():
    keys = {"offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}, "cpu_offload": False}
    with pytest.warns(UserWarning, match="ignores these DeepSpeed keys"):
        c = zero.ZeroConfig.from_deepspeed(_ds(keys))
    assert c == _quiet(_ds())
    with pytest.raises(TypeError, match="offload_optimizer must be a dict"):
        zero.ZeroConfig.from_deepspeed(_ds({"offload_optimizer": "cpu"}))
    with pytest.raises(TypeError, match="ignore_unsupported"):
        zero.ZeroConfig.from_deepspeed(_ds(), ignore_unsupported="yes")
