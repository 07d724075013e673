"""remat.wrap and remat.unwrap against plain PyTorch: a small torch model with side inputs
(Hugging Face GPT-2: tests/surface/test_wrap_gpt2.py)."""

import copy
import io
import math
import os

import pytest
import torch
from torch import nn

import remat
from remat.solver.schedule import simulate
from remat.solver.solve import minimum_budget, solve, store_all
from remat.stage import is_stage

os.environ["HF_HUB_OFFLINE"] = "1"      # before transformers is imported: never reach the hub
try:
    import transformers
except ImportError:
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed")


def budget_for(costs, algorithm, fraction):
    """``fraction`` of the way from the chain's minimum to its store-all peak, raised to
    what a non-optimal ``algorithm`` needs."""
    low = minimum_budget(costs)
    budget = int(low + fraction * (simulate(costs, store_all(costs.length)).peak - low))
    if algorithm != "optimal":
        budget = max(budget, solve(costs, 2**50, algorithm).peak)
    return budget


def assert_same(ref, got):
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"item {i}: {m}")


# A plain torch model ---------------------------------------------------------------------


class Block(nn.Module):
    """Attention with a mask, rotary-like (cos, sin) tables and a flag, all side inputs."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, mask, rope, scale=True):
        cos, sin = rope
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q, k = q * cos + k * sin, k * cos - q * sin
        att = q @ k.transpose(-2, -1) / (math.sqrt(q.shape[-1]) if scale else 1.0) + mask
        return x + self.drop(self.out(att.softmax(-1) @ v))


class Net(nn.Module):
    def __init__(self, d=16, n=5):
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 2)

    def forward(self, x, mask):
        t = torch.arange(x.shape[1], dtype=x.dtype)[:, None]
        rope = (torch.cos(t / 10), torch.sin(t / 10))
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, mask, rope, scale=True)
        return self.head(h)


def net_batch(step, length=6):
    g = torch.Generator().manual_seed(200 + step)
    mask = torch.full((length, length), float("-inf")).triu(1)
    return torch.randn(3, length, 4, generator=g), mask, torch.randn(3, length, 2, generator=g)


def train_net(model, steps=3, seed=1, start=0):
    torch.manual_seed(seed + start)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record = []
    for step in range(steps):
        x, mask, target = net_batch(start + step)
        loss = ((model(x, mask) - target) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        record.append(loss.detach())
        record.extend(p.grad.clone() for p in model.parameters())
        opt.step()
    return record


def net_costs(base):
    probe = copy.deepcopy(base)
    remat.wrap(probe, probe.blocks, budget=2**50, algorithm="store_all")
    train_net(probe, steps=1)
    return remat.explain().costs


@pytest.mark.parametrize("algorithm,fraction", [("optimal", 0.0), ("optimal", 0.5), ("sqrt", 0.0)])
def test_plain_model_matches_pytorch(algorithm, fraction):
    """Losses and parameter gradients of three steps are bitwise plain PyTorch's, side inputs passed through."""
    torch.manual_seed(0)
    base = Net()
    budget = budget_for(net_costs(base), algorithm, fraction)
    model = copy.deepcopy(base)
    remat.wrap(model, model.blocks, budget=budget, algorithm=algorithm)
    assert_same(train_net(copy.deepcopy(base)), train_net(model))
    assert remat.explain().schedule.peak <= budget
    assert remat.explain().names == ["Block"] * 5


def test_two_wrapped_models_keep_their_own_chains():
    """Two wrapped models of one class with other shapes, trained in turn, each match plain PyTorch."""
    torch.manual_seed(0)
    plain = [Net(d=8, n=3), Net(d=16, n=4)]
    models = [copy.deepcopy(m) for m in plain]
    for m in models:
        remat.wrap(m, m.blocks, budget=budget_for(net_costs(m), "optimal", 0.0))
    ref, got = [[], []], [[], []]
    for step in range(3):
        for i in range(2):
            ref[i].extend(train_net(plain[i], steps=1, start=step))
            got[i].extend(train_net(models[i], steps=1, start=step))
    assert_same(ref[0], got[0])
    assert_same(ref[1], got[1])


def test_unwrap_restores_the_model():
    """unwrap removes every instance attribute wrap added and the model trains as before."""
    torch.manual_seed(0)
    base = Net()
    model = copy.deepcopy(base)
    remat.wrap(model, model.blocks, budget="1MiB")
    train_net(model, steps=1)
    remat.unwrap(model)
    assert "forward" not in vars(model)
    assert not any("forward" in vars(b) for b in model.modules())
    assert list(model.state_dict()) == list(base.state_dict())
    model.load_state_dict(base.state_dict())
    before = remat.explain()
    assert_same(train_net(copy.deepcopy(base)), train_net(model))
    assert remat.explain() is before


def test_unwrap_keeps_blocks_the_user_marked():
    """A block marked with remat.stage before wrap is still marked after unwrap; the others are not."""
    model = Net()
    remat.stage(model.blocks[0])
    remat.unwrap(remat.wrap(model, model.blocks, budget="1MiB"))
    assert ["forward" in vars(b) for b in model.blocks] == [True] + [False] * 4


def test_wrap_keeps_an_instance_forward_the_model_had():
    """A model's own instance forward is what the chain runs, and unwrap puts it back."""
    model = Net().eval()
    own = model.forward
    model.forward = lambda x, mask: own(x, mask) * 2
    patched = model.forward
    remat.wrap(model, model.blocks, budget="1MiB")
    x, mask, _ = net_batch(0)
    assert torch.equal(model(x, mask), 2 * own(x, mask))
    assert remat.explain().names == ["Block"] * 5
    remat.unwrap(model)
    assert model.forward is patched


def test_wrap_twice_raises():
    """Wrapping a wrapped model says to unwrap it first."""
    model = Net()
    remat.wrap(model, model.blocks, budget="1MiB")
    with pytest.raises(remat.RematError, match="unwrap"):
        remat.wrap(model, model.blocks, budget="2MiB")


@pytest.mark.parametrize("blocks,error,match", [
    (lambda m: [], ValueError, "empty"),
    (lambda m: [nn.Linear(2, 2)], ValueError, "not a submodule"),
    (lambda m: m.blocks[0], TypeError, "iterable"),
    (lambda m: ["block"], TypeError, "not an nn.Module"),
])
def test_bad_blocks_raise(blocks, error, match):
    """Empty blocks, blocks outside the model and non-modules are refused with a clear message."""
    model = Net()
    with pytest.raises(error, match=match):
        remat.wrap(model, blocks(model), budget="1MiB")
    assert "forward" not in vars(model)


def test_unwrap_of_a_plain_model_raises():
    """unwrap of a model wrap never saw is an error, not a silent no-op."""
    with pytest.raises(ValueError, match="not wrapped"):
        remat.unwrap(Net())


def test_deepcopy_of_a_wrapped_model_runs_its_own_blocks():
    """A deep copy of a wrapped model is wrapped around the copy's forward and blocks and matches plain PyTorch."""
    torch.manual_seed(0)
    base = Net()
    wrapped = copy.deepcopy(base)
    remat.wrap(wrapped, wrapped.blocks, budget=budget_for(net_costs(base), "optimal", 0.0))
    twin = copy.deepcopy(wrapped)
    assert twin.forward.original.__self__ is twin
    assert_same(train_net(copy.deepcopy(base)), train_net(twin))
    assert all(p.grad is None for p in wrapped.parameters())


class StageBlock(Block):
    """A Block whose class forward is a stage already (wrap then marks nothing)."""

    forward = remat.stage(Block.forward)


def saved_and_loaded(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_wrapped_model_survives_torch_save_and_load():
    """A wrapped model saved whole with torch.save loads wrapped around its own forward, matches
    plain PyTorch, and unwraps."""
    torch.manual_seed(0)
    base = Net()
    base.blocks = nn.ModuleList(StageBlock() for _ in range(5))
    model = copy.deepcopy(base)
    remat.wrap(model, model.blocks, budget=budget_for(net_costs(base), "optimal", 0.0))
    loaded = saved_and_loaded(model)
    assert loaded.forward.original.__self__ is loaded
    assert_same(train_net(copy.deepcopy(base)), train_net(loaded))
    remat.unwrap(loaded)
    assert "forward" not in vars(loaded)


def test_model_with_marked_blocks_survives_torch_save_and_load():
    """A model whose blocks wrap marked in place loads after torch.save with its own
    blocks marked as stages: it recomputes them and matches plain PyTorch, and unwrap
    of the loaded model unmarks its blocks, not the saved model's."""
    torch.manual_seed(0)
    base = Net()
    model = copy.deepcopy(base)
    remat.wrap(model, model.blocks, budget=budget_for(net_costs(base), "optimal", 0.0))
    loaded = saved_and_loaded(model)
    assert loaded.forward.original.__self__ is loaded
    assert all(is_stage(b) for b in loaded.blocks)
    assert_same(train_net(copy.deepcopy(base)), train_net(loaded))
    assert remat.explain().names == ["Block"] * 5
    assert remat.explain().schedule.recomputations() > 0
    assert all(p.grad is None for p in model.parameters())
    remat.unwrap(loaded)
    assert "forward" not in vars(loaded)
    assert not any("forward" in vars(b) for b in loaded.blocks)
    assert all(is_stage(b) for b in model.blocks)


@needs_transformers
def test_encoder_and_decoder_layers_in_one_wrap_say_to_wrap_each_part():
    """An encoder-decoder's layers given to one wrap are two chains (the decoder's
    first layer does not take the encoder's last output): the error says to wrap
    the encoder and the decoder apart, not to move code between two stages."""
    config = transformers.BartConfig(vocab_size=50, d_model=16, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=2, decoder_attention_heads=2,
                                     encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).train()
    layers = list(model.model.encoder.layers) + list(model.model.decoder.layers)
    remat.wrap(model, layers, budget="1MiB")
    ids = torch.randint(3, 50, (2, 8))
    with pytest.raises(remat.StageError, match="are two chains; wrap each part apart"):
        model(input_ids=ids, labels=ids)


@needs_transformers
def test_parts_of_each_layer_say_to_pass_the_layers():
    """The attention module of each layer given as the blocks: the error said to wrap an
    encoder and a decoder apart; it names the layers to pass, and the model then wraps
    and trains as plain PyTorch does."""
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config).eval()
    model = copy.deepcopy(plain)
    remat.wrap(model, [layer.attn for layer in model.transformer.h], budget="10MB")
    ids = torch.randint(0, 100, (2, 16))
    with pytest.raises(remat.StageError, match=r"parts of the layers of model\.transformer\.h \(GPT2Attention "
                                               r"inside GPT2Block\).*remat\.wrap\(model, model\.transformer\.h\)"):
        model(ids, labels=ids)
    remat.wrap(remat.unwrap(model), model.transformer.h, budget="10MB")
    for m in (plain, model):
        for _ in range(2):
            m(ids, labels=ids).loss.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters()))


def test_unwrapping_one_of_two_models_sharing_blocks_leaves_the_other_wrapped():
    """Two heads on one backbone, both wrapped: ``unwrap(a)`` unmarked the blocks ``b``
    runs too, and ``b``'s chain ran no stage, 2.4x over its budget. The blocks stay
    stages until the last model sharing them is unwrapped; blocks the user marked stay."""
    torch.manual_seed(0)
    backbone = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4))
    remat.stage(backbone[0])
    heads = [nn.Sequential(*backbone, nn.Linear(16, 4)) for _ in range(2)]
    for head in heads:
        remat.wrap(head, backbone, budget="1MiB")
    remat.unwrap(heads[0])
    assert all(is_stage(b) for b in backbone)
    x = torch.randn(8, 16)
    heads[1](x).sum().backward()
    assert [s.name for s in remat.explain()._record.stages] == ["Sequential"] * 4
    remat.unwrap(heads[1])
    assert [is_stage(b) for b in backbone] == [True, False, False, False]


@needs_transformers
def test_a_llama_at_its_minimum_runs_every_call_under_the_least_budget_explain_names():
    """A small Llama wrapped at the minimum its BudgetErrors name runs every call under
    it, and ``explain().least_budget`` names that budget, not one more output: its final
    norm reads a^L, which is let go before B(L), and the measuring call's plan, which
    counts a^L held where that fits, ran without it where it did not."""
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    budget, peaks = 1024, None
    for _ in range(6):
        remat.clear_cache()
        model = copy.deepcopy(base)
        for p in model.parameters():   # (resident, as the budget counts them: not the first step's to make)
            p.grad = torch.zeros_like(p)
        remat.wrap(model, model.model.layers, budget=budget)
        try:
            peaks = []
            for _ in range(3):
                with remat.measure_peak():   # (each chain's peak from its opening: explain().measured_peak)
                    model(input_ids=ids, labels=ids).loss.backward()
                peaks.append(remat.explain().measured_peak)
            break
        except remat.BudgetError as exc:
            budget, peaks = exc.minimum, None
    assert peaks is not None and max(peaks) <= budget, (peaks, budget)
    assert remat.explain().least_budget <= budget
