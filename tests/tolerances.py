"""The tolerances of the equivalence tests, each derived from what it compares.

An equivalence test computes the same math two ways (a batch whole or streamed in parts,
in micro-batches, a group's prompt run once, a cached decode against a full forward, one
rank or two, LoRA merged or not) and compares the results. The two ways add the same
terms in another order, and how a sum rounds also depends on the CPU's kernels (AVX-512,
AVX2 or neither: ``ATEN_CPU_CAPABILITY`` picks them), so a bound measured on one machine
fails on another (issue 47: 9.9e-5 on one CPU, 3.3e-4 on another, bound 1e-4). Every bound
here is a formula in what is compared, so it holds on any x86 CPU, and it is tight enough
that a real bug still fails it (``tests/test_tolerances.py`` shows a skipped part and a
wrong share weighting failing it).

1. **A float32 sum in another order.** A sum of n terms, in any order and any blocking, is
   within γ_n·Σ|terms| of the exact sum, γ_n = n·ε/(1 − n·ε), ε = 2⁻²³ (Higham, *Accuracy
   and Stability of Numerical Algorithms*, §3.1): two orders are within 2·γ_n·Σ|terms|. It
   is a worst case, so no kernel can exceed it. n is the longest chain of accumulations
   behind one compared number (:func:`chain_terms`): the tokens summed into a weight's
   gradient, plus every reduction on the way through the model (each at most the widest
   of hidden size, MLP width, vocabulary and sequence). Σ|terms| is taken as the
   compared tensor's own largest magnitude: the losses here do not cancel far below
   their terms' size.

2. **An AdamW step.** Adam moves each weight by lr·m̂/(√v̂ + eps), and in its first steps
   |m̂/√v̂| ≤ ~1 whatever the gradient's size (1 at the first step; for β = (0.9, 0.99)
   at most 1.001 at the second). So a weight whose gradient is within rounding of 0 may
   step by anything in [−lr, lr] in one computation and the opposite in the other: it
   agrees only to 2·lr a step. Where the gradient g is clear of its rounding δ, the
   normalised step changes by at most 2·δ/|g| (its slope in g is below 1/|g| at the first
   step and below 1.75/|g| at the second; an earlier step's δ enters through m and v the
   same way). :func:`adam_step_atol` is that bound, per element: tight where gradients are
   clear, 2·lr where they are not, and the weight's own rounding (ε·|w|) on top. A real
   bug changes gradients by a fraction of their size: it fails the gradient bound, and it
   flips the steps of weights whose gradients are clear, which fail the weight bound.

3. **A log-probability.** A logit is the end of the same chain as a gradient (item 1); the
   log-softmax subtracts a log-sum-exp of the same size, so a logprob computed two ways is
   within 2·γ_n·(1 + |logprob|) (:func:`logprob_atol`).

Every assertion goes through :func:`assert_within`, which names the largest gap, its bound
and where it is when a bound is broken.

Not derived here: two whole runs' final weights (``WEIGHT_ATOL`` in test_reproducible.py,
compared after several steps with no gradients to read). There the samples, rewards and
evaluations are compared exactly, and the weights only as a second look.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

F32_EPS = torch.finfo(torch.float32).eps
"""ε: the spacing of float32 at 1 (2⁻²³); the unit roundoff is ε/2, and γ_n below uses ε."""


def gamma(n: int, eps: float = F32_EPS) -> float:
    """γ_n = n·ε / (1 − n·ε): a sum of n terms in any order is within γ_n·Σ|terms| of exact."""
    if n * eps >= 1:
        raise ValueError(f"{n} accumulations exceed what ε={eps:g} bounds (n·ε ≥ 1)")
    return n * eps / (1 - n * eps)


def chain_terms(config, tokens: int) -> int:
    """The longest chain of accumulations behind one logit or one gradient element of a
    decoder ``config`` (a transformers config) on ``tokens`` positions: the tokens summed
    into a weight's gradient, and per layer five reductions in a row (q/k/v projection,
    attention over the positions, its output projection, the MLP's two), plus the LM head,
    each at most as long as the widest of hidden size, MLP width, vocabulary and sequence."""
    width = max(config.hidden_size, config.intermediate_size, config.vocab_size, tokens)
    return tokens + (5 * config.num_hidden_layers + 1) * width


def two_way_atol(n: int, scale: float) -> float:
    """Two float32 sums of the same n terms of total size ``scale``, in two orders."""
    return 2 * gamma(n) * scale


def grad_atol(reference: torch.Tensor, n: int) -> float:
    """A gradient computed two ways, through a chain of n accumulations (item 1)."""
    return two_way_atol(n, float(reference.detach().abs().max()))


def logprob_atol(reference: torch.Tensor, n: int) -> torch.Tensor:
    """Per-token bound on logprobs computed two ways through a chain of n accumulations
    (item 3): 2·γ_n·(1 + |logprob|)."""
    return 2 * gamma(n) * (1 + reference.detach().double().abs())


def adam_step_atol(lr: float, steps: Sequence[tuple[torch.Tensor, float]], weight: torch.Tensor) -> torch.Tensor:
    """Per-element bound on weights after AdamW steps taken from the same weights by two
    computations whose gradients agree within rounding (item 2). ``steps``: each step's
    reference gradient with its bound δ (:func:`grad_atol`), oldest first, since the
    weights were last equal; ``lr``: the step's largest learning rate."""
    ratio = sum(2 * delta / g.detach().double().abs() for g, delta in steps)  # |g| = 0 gives inf: capped below
    normalised = torch.clamp(torch.as_tensor(ratio, dtype=torch.float64), max=2.0 * 1.001)
    return lr * normalised + F32_EPS * weight.detach().double().abs()


def assert_within(actual: torch.Tensor, expected: torch.Tensor, atol: float | torch.Tensor, what: str) -> None:
    """``actual`` within ``atol`` (a number, or a bound per element) of ``expected``; else an
    AssertionError naming ``what``, the worst gap against its bound, where, and how many
    elements broke their bound."""
    actual, expected = torch.as_tensor(actual).detach().double(), torch.as_tensor(expected).detach().double()
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} against {tuple(expected.shape)}")
    gap = (actual - expected).abs()
    gap = torch.where(torch.isnan(gap) & ~(torch.isnan(actual) & torch.isnan(expected)), torch.inf, gap.nan_to_num(0.0))
    bound = torch.as_tensor(atol, dtype=torch.float64).expand_as(gap)
    over = gap > bound
    if over.any():
        excess = torch.where(over, gap / bound.clamp_min(torch.finfo(torch.float64).tiny), 0.0).flatten()
        i = int(excess.argmax())
        where = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), gap.shape)) if gap.dim() else ()
        raise AssertionError(
            f"{what}: |Δ| {gap.flatten()[i]:.3g} > bound {bound.flatten()[i]:.3g} at {where} "
            f"({actual.flatten()[i]:.6g} against {expected.flatten()[i]:.6g}); {int(over.sum())} of {gap.numel()} "
            f"elements over their bound; largest |Δ| {gap.max():.3g}")


def assert_same_adam_step(actual: torch.nn.Module, expected: torch.nn.Module, lr: float, n: int,
                          earlier: Sequence[dict[str, tuple[torch.Tensor, float]]] = ()
                          ) -> dict[str, tuple[torch.Tensor, float]]:
    """Two models that took an AdamW step from the same weights: the same clipped gradients
    (``p.grad`` is kept until the next step) within :func:`grad_atol`, and the same weights
    within :func:`adam_step_atol`. ``earlier``: what this returned for the steps before,
    since the weights were last equal (their rounding is still in Adam's m and v). Returns
    this step's ``{name: (reference gradient, its bound)}``."""
    this: dict[str, tuple[torch.Tensor, float]] = {}
    for (name, x), (_, y) in zip(actual.named_parameters(), expected.named_parameters(), strict=True):
        if y.grad is None:  # frozen (a LoRA base): it must not have moved at all
            assert x.grad is None, f"{name}: a gradient in one computation only"
            assert_within(x, y, 0.0, name)
            continue
        delta = grad_atol(y.grad, n)
        assert_within(x.grad, y.grad, delta, f"{name}.grad (2·γ_n·max|g|, n={n})")
        this[name] = (y.grad.detach().clone(), delta)
        steps = [*(e[name] for e in earlier), this[name]]
        assert_within(x, y, adam_step_atol(lr, steps, y), f"{name} (lr·min(2, Σ 2δ/|g|))")
    return this


def assert_same_logprobs(actual, reference: torch.Tensor, model: torch.nn.Module, positions: int) -> None:
    """An engine's logprobs (a cached decode, in batches) against a learner's forward over
    the whole sequence of ``positions`` tokens of ``model``: within :func:`logprob_atol`."""
    reference = torch.as_tensor(reference)
    n = chain_terms(model.config, positions)
    assert_within(torch.as_tensor(actual), reference, logprob_atol(reference, n), f"logprobs (2·γ_n·(1 + |lp|), n={n})")
