"""remat on a model that skips layers while training (LayerDrop: a Hugging Face
Wav2Vec2 whose encoder skips each layer with probability ``layerdrop``), against
plain PyTorch and Hugging Face's ``gradient_checkpointing_enable()``, side by side
in one process (Note [Skipped stages] in remat/runtime/skips.py).

    python benchmarks/layerdrop.py [--rounds 40] [--layers 12] [--layerdrop 0.1]

Every method runs the same steps: round r seeds the RNG with r, so each skips the
same layers. For each step: the peak from the chain's opening (the budget's
scope: from the first layer's call, its input counted, to the end of the
backward; an exact meter of live tensor storages, CPU) and the step time; for
remat, whether the call measured. remat runs at HF checkpointing's peak, 0.95x
it, and 35% and 60% of plain's, each from a fresh copy (its first call
measures). Reported: the calls that measured, the calls over the budget and the
most over, the median step time over the rounds after the tenth (each method's
median over the same rounds).

Writes benchmarks/results/layerdrop-cpu.json and .md (the table it prints).
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import remat  # noqa: E402
from remat.measure import measuring  # noqa: E402
from remat.measure.meter import Instrument  # noqa: E402


def build(layers, layerdrop, seed=0):
    import transformers

    config = transformers.Wav2Vec2Config(
        hidden_size=256, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=1024,
        conv_dim=(64, 64, 64), conv_stride=(5, 4, 4), conv_kernel=(10, 4, 4), num_feat_extract_layers=3,
        vocab_size=32, layerdrop=layerdrop, do_stable_layer_norm=True, num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, mask_time_prob=0.0)   # (SpecAugment draws from numpy)
    torch.manual_seed(seed)
    return transformers.Wav2Vec2ForCTC(config).train()


class Step:
    """One method: a model and its steps' figures."""

    def __init__(self, name, model, budget=None):
        self.name, self.model, self.budget = name, model, budget
        self.times, self.peaks, self.measured, self.skipped = [], [], [], []
        for p in model.parameters():   # resident gradients: every step adds into them
            p.grad = torch.zeros_like(p)

    def run(self, audio, labels, seed, counted):
        layers = self.model.wav2vec2.encoder.layers
        for p in self.model.parameters():
            p.grad.zero_()
        ran = []

        def open_scope(_module, args, i):
            if not ran:   # (the first layer called opens the chain; recomputations come later)
                scope.count(args[0])
                scope.set_gate(True)
            ran.append(i)

        hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: open_scope(m, a, i))
                 for i, layer in enumerate(layers)]
        scope = Instrument(writes=False)
        scope.set_gate(False)
        before = len(counted)
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        try:
            with scope:
                self.model(audio, labels=labels).loss.backward()
        finally:
            for h in hooks:
                h.remove()
        self.times.append(time.perf_counter() - t0)
        self.peaks.append(scope.peak)
        self.measured.append(len(counted) > before)
        self.skipped.append(sorted(set(range(len(layers))) - set(ran)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--layerdrop", type=float, default=0.1)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "layerdrop-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    counted, init = [], measuring.Measurer.__init__
    measuring.Measurer.__init__ = lambda self, *a, **k: (counted.append(1), init(self, *a, **k))[1]
    g = torch.Generator().manual_seed(1)
    audio, labels = torch.randn(4, 16000, generator=g), torch.randint(1, 32, (4, 40), generator=g)
    base = build(args.layers, args.layerdrop)
    plain, hf = Step("plain", copy.deepcopy(base)), Step("HF checkpointing", copy.deepcopy(base))
    hf.model.gradient_checkpointing_enable()
    for step in (plain, hf):   # (their peaks set remat's budgets)
        for seed in range(3):
            step.run(audio, labels, -1 - seed, counted)
    full = [p for p, s in zip(plain.peaks, plain.skipped) if not s] or plain.peaks
    hf_full = [p for p, s in zip(hf.peaks, hf.skipped) if not s] or hf.peaks
    budgets = [("HF's peak", max(hf_full)), ("0.95x HF's peak", int(0.95 * max(hf_full))),
               ("35% of plain's", int(0.35 * max(full))), ("60% of plain's", int(0.6 * max(full)))]
    methods = [plain, hf]
    for label, budget in budgets:
        model = copy.deepcopy(base)
        remat.wrap(model, model.wav2vec2.encoder.layers, budget=budget)
        methods.append(Step(f"remat at {label}", model, budget))
    for step in methods:
        step.times, step.peaks, step.measured, step.skipped = [], [], [], []
    for r in range(args.rounds):
        for step in methods:
            step.run(audio, labels, r, counted)
    assert all(m.skipped == plain.skipped for m in methods), "the methods skipped other layers"
    result = {"machine": f"{os.cpu_count()} CPUs", "torch": torch.__version__, "layers": args.layers,
              "layerdrop": args.layerdrop, "rounds": args.rounds, "skipped": plain.skipped, "methods": []}
    for m in methods:
        over = [p / m.budget for p in m.peaks if m.budget is not None and p > m.budget]
        result["methods"].append({
            "name": m.name, "budget": m.budget, "peaks": m.peaks, "times": m.times, "measured": m.measured,
            "calls_measured": sum(m.measured), "calls_over_budget": len(over), "most_over": max(over, default=None),
            "max_peak": max(m.peaks), "median_seconds": statistics.median(m.times[10:] or m.times)})
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(table(result) + "\n")
    print(table(result))


def table(result):
    """The markdown table of a result dict."""
    mib = 2 ** 20
    plain = next(m for m in result["methods"] if m["name"] == "plain")
    skips = sum(bool(s) for s in result["skipped"])
    lines = [f"Wav2Vec2, {result['layers']} layers x 256, LayerDrop {result['layerdrop']}, batch 4 x 16,000 "
             f"samples, CPU ({result['machine']}, torch {result['torch']}); {result['rounds']} steps, "
             f"{skips} of them skipping layers", "",
             "| method | budget MiB | most peak MiB | calls measured | calls over budget (most) | step ms "
             "(median, steps 11 on) | x plain |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for m in result["methods"]:
        budget = f"{m['budget'] / mib:.2f}" if m["budget"] else ""
        over = f"{m['calls_over_budget']}" + (f" ({m['most_over']:.3f}x)" if m["most_over"] else "")
        lines.append(f"| {m['name']} | {budget} | {m['max_peak'] / mib:.2f} | {m['calls_measured']} | "
                     f"{over if m['budget'] else ''} | {1e3 * m['median_seconds']:.1f} | "
                     f"{m['median_seconds'] / plain['median_seconds']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
