"""``ZeroModule.generation_mode()``: hpZ secondary shards kept across the forwards of
Hugging Face ``generate`` on a ZeRO-3-sharded tiny GPT-2 (4 gloo ranks as 2 nodes x 2).

Oracles, none produced by the code under test: the unsharded model's greedy tokens
(ZeRO-3 config); the same sharded model generating without the mode, and an unsharded
copy loaded with the qwZ-dequantized weights (ZeRO++ config); the bytes per forward of
the mode-less run, counted by hooks of the test's own around each forward; training
losses of a twin model that never entered the mode.
"""
import copy

import pytest
import torch

import qcoll
from qcoll import weights, zero
from qcoll.comm.stats import stats

pytest.importorskip("transformers", reason="transformers is a test extra (pip install -e '.[test]')")

PROMPT = [[5, 17, 3, 42, 8]]
NEW = 6
TIMEOUT = 60


def _tiny_gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=48, bos_token_id=0, eos_token_id=1,
                     pad_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: runs compare
    return GPT2LMHeadModel(cfg).eval()


def _generate(model, new=NEW):
    return model.generate(torch.tensor(PROMPT), max_new_tokens=new, min_new_tokens=new, do_sample=False).tolist()


class ForwardBytes:
    """The test's own meter: (inter, intra) bytes of each call of ``model``, from the
    never-reset totals of qcoll.comm.stats, read by hooks outside every qcoll hook."""

    def __init__(self, model):
        self.per_forward = []
        self._hooks = [model.register_forward_pre_hook(self._pre, prepend=True),
                       model.register_forward_hook(self._post, always_call=True)]

    def _pre(self, module, args):
        self._start = (stats.total_inter_bytes, stats.total_intra_bytes)

    def _post(self, module, args, output):
        self.per_forward.append((stats.total_inter_bytes - self._start[0], stats.total_intra_bytes - self._start[1]))

    def remove(self):
        for h in self._hooks:
            h.remove()


def _held(model) -> list:
    return [g.index for g in zero.state_of(model).groups if g.secondary is not None]


def _exported_copy(plain, sharded, path):
    """The exported quantized model: ``export_quantized`` of the sharded model, loaded into an
    unsharded copy of ``plain`` with ``load_quantized`` (every rank reads the file)."""
    zero.export_quantized(sharded, path)
    return weights.load_quantized(path, copy.deepcopy(plain))


# ---------------------------------------------------------------------------- (a) ZeRO-3 config
def _zero3_tokens(rank, world):
    plain = _tiny_gpt2()
    want = _generate(plain)
    model = zero.shard(copy.deepcopy(plain), qcoll.Topology(2), zero.ZeroConfig.zero3())
    meter = ForwardBytes(model)
    plain_run = _generate(model)
    without = list(meter.per_forward)
    meter.per_forward.clear()
    with model.generation_mode() as gen:
        got = _generate(model)
    meter.remove()
    return want, got, plain_run, without, meter.per_forward, gen.inter_node_bytes_per_forward, gen.forwards


def test_zero3_config_in_generation_mode_gives_the_unsharded_tokens(ranks4):
    """Without hpZ there is nothing to keep: the mode gathers over the world as usual (and counts it)."""
    for want, got, plain_run, without, within, gen_inter, forwards in ranks4.run(_zero3_tokens, timeout=TIMEOUT):
        assert got == want and plain_run == want
        assert forwards == NEW == len(within)
        assert within == without                       # the same bytes as without the mode, every forward
        assert gen_inter == [b[0] for b in within] and all(b > 0 for b in gen_inter)


# ---------------------------------------------------------------------------- (b) ZeRO++ config
def _zeropp_tokens(rank, world, bits, path):
    plain = _tiny_gpt2()
    cfg = zero.ZeroConfig(weight_bits=bits, hpz=True, grad_bits=4)
    model = zero.shard(copy.deepcopy(plain), qcoll.Topology(2), cfg)
    exported = _generate(_exported_copy(plain, model, path))
    unquantized = _generate(plain)
    meter = ForwardBytes(model)
    without = _generate(model)
    bytes_without = list(meter.per_forward)
    meter.per_forward.clear()
    with model.generation_mode() as gen:
        within = _generate(model)
        secondary_inside = zero.memory_report(model)["secondary"]
    meter.remove()
    return (within, without, exported, unquantized, bytes_without, meter.per_forward,
            gen.inter_node_bytes_per_forward, gen.intra_node_bytes_per_forward, secondary_inside, gen.summary())


@pytest.mark.parametrize("bits", [8, 2])
def test_zeropp_generation_mode_keeps_the_secondaries_and_stays_in_the_node(ranks4, bits, tmp_path):
    for (within, without, exported, unquantized, bytes_without, bytes_within, gen_inter, gen_intra, secondary,
         summary) in ranks4.run(_zeropp_tokens, bits, str(tmp_path / "w.safetensors"), timeout=TIMEOUT):
        assert within == without == exported           # the same quantized weights in every forward
        if bits == 2:
            assert within != unquantized, "2-bit weights should change some token of this tiny model"
        assert len(bytes_without) == len(bytes_within) == NEW
        assert all(inter > 0 for inter, _ in bytes_without)  # without the mode: every forward crosses nodes
        assert bytes_within[0] == bytes_without[0]           # the first forward: the same qwZ all-gather
        assert [inter for inter, _ in bytes_within[1:]] == [0] * (NEW - 1)
        assert all(intra > 0 for _, intra in bytes_within[1:])  # replica_gather inside the node
        assert gen_inter == [b[0] for b in bytes_within] and gen_intra == [b[1] for b in bytes_within]
        assert secondary > 0
        assert summary["inter_node_bytes_per_forward_after_first"] == 0 and summary["forwards"] == NEW


def _cached_tokens(rank, world, path):
    plain = _tiny_gpt2()
    model = zero.shard(copy.deepcopy(plain), qcoll.Topology(2), zero.ZeroConfig(weight_bits=4, hpz=True))
    exported = _generate(_exported_copy(plain, model, path))
    groups = [g for g in zero.state_of(model).groups if not g.replicated]
    full = [g.full.numel() * g.full.element_size() for g in groups]
    runs = {}
    for name, budget in (("none", 0), ("half", sum(full) // 2), ("all", None)):
        with model.generation_mode(max_cached_bytes=budget) as gen:
            tokens = _generate(model)
            held = zero.memory_report(model)["gathered"]
        runs[name] = dict(tokens=tokens, inter=gen.inter_node_bytes_per_forward, intra=gen.intra_node_bytes_per_forward,
                          cached=(gen.cached_bytes, gen.cached_groups, gen.groups), held=held,
                          after=zero.memory_report(model)["gathered"],
                          pinned=[g.index for g in groups if g.pinned])
    for bad in (-1, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="max_cached_bytes"):
            with model.generation_mode(max_cached_bytes=bad):
                pass
    return exported, full, runs


def test_generation_cache_keeps_the_gathered_weights_within_the_budget(ranks4, tmp_path):
    """max_cached_bytes: the groups that fit stay gathered, the later forwards move no byte at all
    (the rest gather inside the node from their secondaries), the tokens are the exported model's."""
    for exported, full, runs in ranks4.run(_cached_tokens, str(tmp_path / "w.safetensors"), timeout=TIMEOUT):
        for name, run in runs.items():
            assert run["tokens"] == exported, name
            assert run["inter"][0] > 0 and run["inter"][1:] == [0] * (NEW - 1), name
            assert run["after"] == 0 and run["pinned"] == [], name      # released on exit
        assert runs["none"]["cached"] == (0, 0, len(full))
        assert all(b > 0 for b in runs["none"]["intra"][1:])
        assert runs["all"]["cached"] == (sum(full), len(full), len(full))
        assert runs["all"]["held"] == sum(full)
        assert runs["all"]["intra"][1:] == [0] * (NEW - 1)            # nothing gathered after the first forward
        half_bytes, half_groups, _ = runs["half"]["cached"]
        assert 0 < half_groups < len(full) and half_bytes <= sum(full) // 2
        # the groups kept are those that fit, in order; the others still gather inside the node
        fit, n = 0, 0
        while n < len(full) and fit + full[n] <= sum(full) // 2:
            fit, n = fit + full[n], n + 1
        assert (half_bytes, half_groups) == (fit, n)
        assert all(0 < h < a for h, a in zip(runs["half"]["intra"][1:], runs["none"]["intra"][1:]))


# ---------------------------------------------------------------------------- (c) released on exit
class Boom(Exception):
    pass


def _released(rank, world):
    model = zero.shard(_tiny_gpt2(), qcoll.Topology(2), zero.ZeroConfig())
    groups = zero.state_of(model).groups
    out = {}
    with model.generation_mode():
        _generate(model, 2)
        out["inside"] = _held(model)
    out["after"] = _held(model)
    out["after_bytes"] = zero.memory_report(model)["secondary"]
    with pytest.raises(Boom):
        with model.generation_mode():
            _generate(model, 2)
            raise Boom()
    out["after_raise"] = _held(model)
    # a forward that raises inside a unit, in the mode
    block = model.transformer.h[1]
    calls = []

    def fail_third(module, args):
        calls.append(1)
        if len(calls) == 3:
            raise Boom()

    h = block.register_forward_pre_hook(fail_third)
    with pytest.raises(Boom):
        with model.generation_mode():
            _generate(model, 4)
    h.remove()
    out["after_forward_raise"] = _held(model)
    out["flags"] = [g.hold_secondary for g in groups]
    out["gathered"] = sum(g.gathered_nbytes() for g in groups)
    meter = ForwardBytes(model)  # afterwards: the usual mode-less gathers, over the world
    out["tokens_after"] = _generate(model, 3)
    meter.remove()
    out["bytes_after"] = meter.per_forward
    out["groups"] = len(groups)
    return out


def test_secondaries_are_released_on_exit_and_when_the_block_raises(ranks4):
    for out in ranks4.run(_released, timeout=TIMEOUT):
        assert sorted(out["inside"]) == list(range(out["groups"]))  # every group, frozen or not, kept one
        assert out["after"] == [] and out["after_bytes"] == 0
        assert out["after_raise"] == [] and out["after_forward_raise"] == []
        assert not any(out["flags"]) and out["gathered"] == 0
        assert all(inter > 0 for inter, _ in out["bytes_after"])


# ---------------------------------------------------------------------------- (d) training after the mode
def _train(rank, world, use_mode):
    torch.manual_seed(1)
    x = torch.randint(2, 96, (2, 12))
    model = zero.shard(_tiny_gpt2().train(), qcoll.Topology(2), zero.ZeroConfig())
    opt = zero.Optimizer(model, torch.optim.SGD, lr=0.5)
    losses, inter = [], []

    def step(generate_before_backward):
        loss = model(x, labels=x).loss
        if generate_before_backward:  # a backward is pending: its secondaries are set aside meanwhile
            with model.generation_mode():
                _generate(model, 3)
        before = stats.total_inter_bytes
        loss.backward()
        inter.append(stats.total_inter_bytes - before)  # the backward's node-local weight gathers + qgZ
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))

    step(False)
    if use_mode:
        with model.generation_mode():
            _generate(model, 3)
    step(use_mode)
    step(False)
    return losses, inter, _held(model)


def test_training_after_generation_mode_is_unchanged(ranks4):
    """A twin that never entered the mode trains to the same losses, bit for bit; a backward that
    was pending while the mode ran still gathers inside the node (the same inter-node bytes)."""
    plain = ranks4.run(_train, False, timeout=TIMEOUT)
    moded = ranks4.run(_train, True, timeout=TIMEOUT)
    for (lp, ip, hp), (lm, im, hm) in zip(plain, moded):
        assert lm == lp
        assert im == ip
        assert hp == hm == []


# ---------------------------------------------------------------------------- (e) misuse and an optimizer step
def _misuse(rank, world, max_cached_bytes):
    torch.manual_seed(1)
    x = torch.randint(2, 96, (2, 12))
    model = zero.shard(_tiny_gpt2(), qcoll.Topology(2), zero.ZeroConfig())
    opt = zero.Optimizer(model, torch.optim.SGD, lr=0.5)
    out = {}
    with model.generation_mode() as gen:
        with pytest.raises(RuntimeError, match="does not nest"):
            with model.generation_mode():
                pass
        _generate(model, 2)
        out["still_held"] = bool(_held(model))
        with torch.enable_grad():
            loss = model(x, labels=x).loss
        with pytest.raises(RuntimeError, match="backward inside generation_mode"):
            loss.backward()
    out["nested_ok"] = gen.forwards == 3
    out["held_after"] = _held(model)

    def enter_inside(module, args):
        with model.generation_mode():
            pass

    h = model.transformer.h[0].register_forward_pre_hook(enter_inside)
    with pytest.raises(RuntimeError, match="inside a forward"):
        _generate(model, 1)
    h.remove()

    # an optimizer step inside the mode: the kept shards are stale and gathered again
    model(x, labels=x).loss.backward()
    with model.generation_mode(max_cached_bytes) as gen:
        before_step = _generate(model, 2)
        opt.step()
        opt.zero_grad()
        after_step = _generate(model, 3)
    out["refreshed"] = gen.refreshed
    out["inter"] = gen.inter_node_bytes_per_forward
    out["before_step"] = before_step
    out["after_step"] = after_step
    out["after_step_without_mode"] = _generate(model, 3)
    return out


@pytest.mark.parametrize("max_cached_bytes", [0, None])
def test_misuse_is_a_clear_error_and_an_optimizer_step_refreshes_the_secondaries(ranks4, max_cached_bytes):
    """An optimizer step inside the mode: the kept secondaries (0) or kept weights (None: all) are stale."""
    for out in ranks4.run(_misuse, max_cached_bytes, timeout=TIMEOUT):
        assert out["still_held"] and out["nested_ok"] and out["held_after"] == []
        # 2 forwards before the step, 3 after: the first after the step crosses nodes again
        inter = out["inter"]
        assert inter[0] > 0 and inter[1] == 0 and inter[2] == inter[0] and inter[3:] == [0, 0], inter
        assert out["refreshed"] > 0
        assert out["after_step"] == out["after_step_without_mode"]
