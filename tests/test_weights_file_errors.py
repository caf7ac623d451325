"""qcoll.weights files: a malformed file is a ValueError naming the file and the field; a save
removes the temporary files of writers that died and never follows a planted symlink.

The corrupted files are a small valid file (written by ``qcoll.weights.file.save``) whose
safetensors header (8-byte little-endian length, then JSON) is rewritten one field at a time.
"""
import errno
import json
import os
import struct
import subprocess

import pytest
import torch

import qcoll.files
from qcoll import weights
from qcoll.weights import file as wfile
from qcoll.weights.record import QuantizedWeight


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3, 40))
        self.v = torch.nn.Parameter(torch.zeros(5))
        self.tied = self.w
        self.register_buffer("buf", torch.zeros(3))


def _save(path):
    g = torch.Generator().manual_seed(0)
    qw = {"w": QuantizedWeight.from_tensor(torch.randn(3, 40, generator=g), 4, 32),
          "v": QuantizedWeight.from_tensor(torch.randn(5, generator=g), 4, 32)}
    wfile.save(path, qw, {"buf": torch.arange(3.0)}, aliases={"tied": "w"})
    return qw


@pytest.fixture
def valid(tmp_path):
    path = tmp_path / "valid.safetensors"
    _save(path)
    return path


def _split(raw: bytes):
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def meta(field, value):
    """Set (or with ``value`` None remove) metadata ``field``."""
    def edit(h):
        if value is None:
            h["__metadata__"].pop(field)
        else:
            h["__metadata__"][field] = value
    return edit


def entry(key, field, value):
    """Set (or remove) ``field`` of entry ``key`` of the ``tensors`` metadata (JSON)."""
    def edit(h):
        info = json.loads(h["__metadata__"]["tensors"])
        if value is None:
            info[key].pop(field)
        else:
            info[key][field] = value
        h["__metadata__"]["tensors"] = json.dumps(info)
    return edit


def tensors(edit_info):
    def edit(h):
        info = json.loads(h["__metadata__"]["tensors"])
        h["__metadata__"]["tensors"] = json.dumps(edit_info(info))
    return edit


def stored(name, field, value):
    """Change the stored tensor ``name``'s ``dtype`` or ``shape`` in the header (same byte count)."""
    def edit(h):
        h[name][field] = value
    return edit


def aliases(value):
    return meta("aliases", value)


RAW_CASES = [
    ("not safetensors", lambda b: b"hello, this is no model at all", ["not a valid safetensors file"]),
    ("empty", lambda b: b"", ["not a valid safetensors file"]),
    ("truncated header", lambda b: b[:20], ["not a valid safetensors file"]),
    ("truncated data", lambda b: b[:-3], ["not a valid safetensors file"]),
    ("header length huge", lambda b: struct.pack("<Q", 1 << 40) + b[8:], ["not a valid safetensors file"]),
]

HEADER_CASES = [
    ("no metadata", lambda h: h.pop("__metadata__"), ["'format'", "not a qcoll quantized-weights file"]),
    ("other format", meta("format", "gguf"), ["'format'", "'gguf'"]),
    ("no format_version", meta("format_version", None), ["'format_version'", "missing"]),
    ("format_version not int", meta("format_version", "abc"), ["'format_version'", "'abc'"]),
    ("format_version 2", meta("format_version", "2"), ["'format_version'", "is 2"]),
    ("no bits", meta("bits", None), ["'bits'", "missing"]),
    ("bits a number", meta("bits", 4), ["not a valid safetensors file", "expected a string"]),
    ("bits not int", meta("bits", "abc"), ["'bits'", "'abc'"]),
    ("bits with space", meta("bits", " 4"), ["'bits'", "' 4'"]),
    ("bits 3", meta("bits", "3"), ["'bits'", "'3'"]),
    ("bits 8 for 4-bit codes", meta("bits", "8"), ["'w.qcodes'", "'bits' 8"]),
    ("no block_size", meta("block_size", None), ["'block_size'", "missing"]),
    ("block_size 48", meta("block_size", "48"), ["'block_size'", "'48'"]),
    ("block_size 64 for blocks of 32", meta("block_size", "64"), ["'w.qcodes'", "'block_size' 64"]),
    ("no tensors", meta("tensors", None), ["'tensors'", "missing"]),
    ("tensors bad JSON", meta("tensors", "{not json"), ["'tensors'", "not valid JSON"]),
    ("tensors a list", meta("tensors", "[]"), ["'tensors'", "JSON object", "list"]),
    ("entry not an object", tensors(lambda i: {**i, "w": 3}), ["'tensors'", "'w'", "JSON object"]),
    ("entry lacks shape", entry("w", "shape", None), ["'tensors'", "'w'", "'shape'"]),
    ("entry lacks dtype", entry("w", "dtype", None), ["'tensors'", "'w'", "'dtype'"]),
    ("entry lacks orig_dtype", entry("w", "orig_dtype", None), ["'tensors'", "'w'", "'orig_dtype'"]),
    ("shape a string", entry("w", "shape", "abc"), ["'w'", "'shape'", "abc"]),
    ("shape negative", entry("w", "shape", [3, -40]), ["'w'", "'shape'", "-40"]),
    ("shape of floats", entry("w", "shape", [3.0, 40]), ["'w'", "'shape'", "3.0"]),
    ("shape of bools", entry("w", "shape", [True, 40]), ["'w'", "'shape'", "true"]),
    ("shape too large for the codes", entry("w", "shape", [3, 80]), ["'w.qcodes'", "[3, 80]"]),
    ("dtype not float", entry("w", "dtype", "int8"), ["'w'", "'dtype'", "int8"]),
    ("dtype not a string", entry("w", "dtype", 5), ["'w'", "'dtype'", "5"]),
    ("dtype unknown", entry("w", "dtype", "float128"), ["'w'", "'dtype'", "float128"]),
    ("orig_dtype unknown", entry("w", "orig_dtype", "__class__"), ["'w'", "'orig_dtype'", "__class__"]),
    ("entry without tensors", tensors(lambda i: {**i, "x": i["w"]}), ["'x.qcodes'", "missing", "'tensors'"]),
    ("codes not uint8", stored("w.qcodes", "dtype", "I8"), ["'w.qcodes'", "uint8", "int8"]),
    ("codes transposed", stored("w.qcodes", "shape", [16, 4]), ["'w.qcodes'", "(4, 16)", "(16, 4)"]),
    ("scales not float32", stored("w.qscales", "dtype", "I32"), ["'w.qscales'", "float32", "int32"]),
    ("no aliases", aliases(None), ["'aliases'", "missing"]),
    ("aliases bad JSON", aliases("{"), ["'aliases'", "not valid JSON"]),
    ("aliases a list", aliases('["w"]'), ["'aliases'", "JSON object"]),
    ("alias target not a string", aliases('{"tied": 1}'), ["'aliases'", "'tied'", "1"]),
    ("alias to no tensor", aliases('{"tied": "nope"}'), ["'aliases'", "'tied'", "'nope'"]),
]


def _check(path, fields):
    """Both entry points raise a plain ValueError naming the file and every string of ``fields``."""
    for load in (weights.read, lambda p: weights.load_quantized(p, Tiny(), strict=False)):
        with pytest.raises(ValueError) as e:
            load(str(path))
        assert type(e.value) is ValueError, repr(e.value)   # not a bare JSONDecodeError or similar
        msg = str(e.value)
        assert str(path) in msg and all(f in msg for f in fields), msg
    return e.value


def test_the_valid_file_loads(valid):
    qw, plain, al, _ = weights.read(str(valid))
    assert set(qw) == {"w", "v"} and set(plain) == {"buf"} and al == {"tied": "w"}
    m = weights.load_quantized(str(valid), Tiny())
    assert torch.equal(m.w, qw["w"].dequantize()) and torch.equal(m.buf, torch.arange(3.0))
    assert torch.equal(m.tied, m.w) and torch.equal(m.v, qw["v"].dequantize())
    # the header round trip of the tests changes nothing by itself
    again = valid.with_name("again.safetensors")
    again.write_bytes(_join(*_split(valid.read_bytes())))
    assert torch.equal(weights.read(str(again))[0]["w"].codes, qw["w"].codes)


@pytest.mark.parametrize("name,cut,fields", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_not_a_safetensors_file_names_the_file_and_keeps_the_cause(valid, name, cut, fields):
    from safetensors import SafetensorError

    bad = valid.with_name("bad.safetensors")
    bad.write_bytes(cut(valid.read_bytes()))
    err = _check(bad, fields)
    assert isinstance(err.__cause__, SafetensorError)


@pytest.mark.parametrize("name,edit,fields", HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_a_malformed_header_names_the_file_and_the_field(valid, name, edit, fields):
    header, data = _split(valid.read_bytes())
    edit(header)
    bad = valid.with_name("bad.safetensors")
    bad.write_bytes(_join(header, data))
    err = _check(bad, fields)
    if "JSON" in name:
        assert isinstance(err.__cause__, json.JSONDecodeError)


# ---------------------------------------------------------------------------- crashed writers
@pytest.fixture
def pids():
    """(pid of a process that has exited and been reaped, pid of a live process)."""
    dead = subprocess.Popen(["sleep", "0"])
    dead.wait()
    live = subprocess.Popen(["sleep", "30"])
    yield dead.pid, live.pid
    live.kill()
    live.wait()


def test_save_removes_only_the_temporary_files_of_dead_writers(tmp_path, pids):
    dead, live = pids
    base = "model.safetensors"
    stale = [f"{base}.tmp.{dead}", f"{base}.tmp.{dead}.0123abcd"]
    kept = [f"{base}.tmp.{live}", f"{base}.tmp.{live}.0123abcd",           # a live writer's
            f"{base}.tmp.{os.getpid()}",                                    # this process's
            f"{base}.tmp.{dead}x", f"{base}.tmp.{dead}.notes", f"{base}.tmp.{dead}.0123ABCD",
            f"{base}.tmp.", f"{base}.tmp.abc", f"other.safetensors.tmp.{dead}", f"x{base}.tmp.{dead}",
            f"{base}.bak"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"partial")
    (tmp_path / f"{base}.tmp.{dead}.aaaaaaaa").mkdir()                        # not a regular file
    kept.append(f"{base}.tmp.{dead}.aaaaaaaa")
    (tmp_path / f"{base}.tmp.{dead}.bbbbbbbb").symlink_to(tmp_path / f"{base}.bak")
    kept.append(f"{base}.tmp.{dead}.bbbbbbbb")
    qw = _save(tmp_path / base)
    assert sorted(os.listdir(tmp_path)) == sorted(kept + [base])
    assert all((tmp_path / n).is_dir() or (tmp_path / n).read_bytes() == b"partial" for n in kept)
    assert torch.equal(weights.read(str(tmp_path / base))[0]["w"].codes, qw["w"].codes)


@pytest.mark.parametrize("error,removed", [(ProcessLookupError(errno.ESRCH, "stub"), True),
                                           (PermissionError(errno.EPERM, "stub"), False),
                                           (OSError(errno.EINVAL, "stub"), False)], ids=["ESRCH", "EPERM", "EINVAL"])
def test_a_writer_is_alive_unless_its_pid_is_unknown(tmp_path, monkeypatch, error, removed):
    """PermissionError from ``os.kill(pid, 0)``: the process exists under another user: alive;
    any other error but ProcessLookupError: cannot tell, kept."""
    other = 999_999_999 if os.getpid() != 999_999_999 else 999_999_998
    (tmp_path / f"m.safetensors.tmp.{other}").write_bytes(b"partial")
    calls = []

    def kill(pid, sig):
        calls.append((pid, sig))
        raise error

    monkeypatch.setattr(wfile.os, "kill", kill)
    _save(tmp_path / "m.safetensors")
    assert calls == [(other, 0)]
    assert (tmp_path / f"m.safetensors.tmp.{other}").exists() is not removed


def test_save_never_follows_a_symlink_at_the_temporary_or_the_final_path(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    base = tmp_path / "model.safetensors"
    planted = tmp_path / f"model.safetensors.tmp.{os.getpid()}.aaaaaaaa"
    planted.symlink_to(victim)
    base.symlink_to(victim)
    draws = iter(["aaaaaaaa", "bbbbbbbb"])          # the first name drawn is the planted one
    monkeypatch.setattr(qcoll.files.secrets, "token_hex", lambda n: next(draws))
    qw = _save(base)
    assert victim.read_bytes() == b"precious"
    assert planted.is_symlink() and not base.is_symlink()
    assert torch.equal(weights.read(str(base))[0]["w"].codes, qw["w"].codes)
    assert sorted(os.listdir(tmp_path)) == sorted(["victim", base.name, planted.name])


def test_a_failed_save_leaves_no_temporary_file_and_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"old")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(wfile.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        _save(path)
    assert os.listdir(tmp_path) == ["m.safetensors"] and path.read_bytes() == b"old"


def test_saved_file_has_the_permissions_of_a_plain_open(tmp_path):
    old = os.umask(0o022)
    try:
        _save(tmp_path / "m.safetensors")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "m.safetensors").st_mode & 0o777 == 0o644


# ---------------------------------------------------------------------------- sizes taken on trust
DEEP = 100_000


@pytest.mark.parametrize("field,text", [("tensors", "[" * DEEP + "]" * DEEP),
                                        ("aliases", '{"a":' * DEEP + '"w"' + "}" * DEEP),
                                        ("tensors", "[" * DEEP)], ids=["tensors", "aliases", "unclosed"])
def test_metadata_json_nested_deeply_is_a_value_error(valid, field, text):
    """json.loads recurses once per level (a RecursionError at ~1000); the field is refused unparsed."""
    header, data = _split(valid.read_bytes())
    meta(field, text)(header)
    bad = valid.with_name("bad.safetensors")
    bad.write_bytes(_join(header, data))
    err = _check(bad, [f"'{field}'", f"{DEEP} deep"])
    assert err.__cause__ is None


def test_brackets_inside_metadata_strings_are_not_nesting(valid):
    header, data = _split(valid.read_bytes())
    aliases('{"t[[[[{{{{\\"\\\\": "w", "u": "w"}')(header)
    odd = valid.with_name("odd.safetensors")
    odd.write_bytes(_join(header, data))
    assert weights.read(str(odd))[2] == {'t[[[[{{{{"\\': "w", "u": "w"}


def test_safetensors_header_nested_deeply_is_a_value_error(valid):
    text = b'{"x":' * DEEP + b"1" + b"}" * DEEP
    bad = valid.with_name("bad.safetensors")
    bad.write_bytes(struct.pack("<Q", len(text)) + text)
    _check(bad, ["not a valid safetensors file"])


def _empty_weight_file(path, shape):
    """A file whose weight ``w`` has no blocks and claims ``shape`` (torch.Size.numel() wraps past int64)."""
    w = QuantizedWeight(torch.zeros(0, 16, dtype=torch.uint8), torch.zeros(0), torch.Size([0]), torch.float32, 4, 32)
    wfile.save(path, {"w": w})
    header, data = _split(path.read_bytes())
    entry("w", "shape", shape)(header)
    path.write_bytes(_join(header, data))


@pytest.mark.parametrize("shape", [[1 << 62, 4], [1 << 40, 1 << 40], [0, 1 << 70], [1 << 64]],
                         ids=["wraps to 0", "wraps to 0 twice", "dim beyond int64 times 0", "dim beyond int64"])
def test_a_shape_beyond_the_file_or_int64_is_a_value_error(tmp_path, shape):
    bad = tmp_path / "bad.safetensors"
    _empty_weight_file(bad, shape)
    with pytest.raises(ValueError) as e:
        weights.read(str(bad))
    assert type(e.value) is ValueError and str(bad) in str(e.value), repr(e.value)
    assert "'tensors'" in str(e.value) and "'w'" in str(e.value) and "'shape'" in str(e.value), str(e.value)


def test_a_shape_the_codes_hold_but_the_file_could_not_is_refused_before_its_codes(valid):
    """240,000 4-bit codes need 120,000 bytes: more than the whole file holds (the codes' shape is not
    looked at: "shape too large for the codes" above is the case where the file could hold them)."""
    header, data = _split(valid.read_bytes())
    entry("w", "shape", [3, 80000])(header)
    bad = valid.with_name("bad.safetensors")
    bad.write_bytes(_join(header, data))
    _check(bad, ["'tensors'", "'w'", "'shape'", "[3, 80000]", "4-bit codes"])


SIZE_CASES = [
    ("header length beyond the file", lambda b: struct.pack("<Q", len(b)) + b[8:]),
    ("data offsets beyond the file", lambda b: _join(*_edited(b, stored("buf", "data_offsets", [0, 1 << 40])))),
    ("a plain shape overflowing", lambda b: _join(*_edited(b, stored("buf", "shape", [1 << 62, 1 << 62])))),
]


@pytest.mark.parametrize("name,edit", SIZE_CASES, ids=[c[0] for c in SIZE_CASES])
def test_safetensors_sizes_are_bounded_by_the_file(valid, name, edit):
    """safetensors itself checks these (the 8-byte header length, each tensor's range and byte count)."""
    bad = valid.with_name("bad.safetensors")
    bad.write_bytes(edit(valid.read_bytes()))
    _check(bad, ["not a valid safetensors file"])


def _edited(raw, edit):
    header, data = _split(raw)
    edit(header)
    return header, data
