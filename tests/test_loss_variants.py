"""Policy objectives, KL estimators, masks and the entropy terms: hand-worked values (1e-6 or tighter), gradient
checks where a variant defines its gradient, naive-loop oracles, and micro-batch split invariance."""

import math

import pytest
import torch

from grpokit.algorithms import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_OBJECTIVES,
    LossBatch,
    LossSettings,
    entropy_quantile_threshold,
    off_policy_mask,
    policy_loss,
    resolve_loss_type,
)

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


def run(logp, old, adv, mask, *, objective="clip", aggregation="bnpo", **kw):
    """Loss and d loss / d logp."""
    logp = logp.clone().requires_grad_(True)
    batch_kw = {k: kw.pop(k) for k in list(kw) if k in LossBatch.__dataclass_fields__}
    batch = LossBatch(logp, adv, mask, old_logp=old, **batch_kw)
    loss, metrics = policy_loss(batch, LossSettings(policy_objective=objective, loss_aggregation=aggregation, **kw))
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad, metrics


ONE = torch.ones(1, 1, dtype=F64)
ZERO = torch.zeros(1, 1, dtype=F64)


# --------------------------------------------------------------------------- CISPO
def test_cispo_clips_the_weight_and_stops_its_gradient():
    # w = 1.5 > epsilon_high = 1.2: P = -sg[1.2] * A * logp, dP/dlogp = -1.2 * A
    logp = t([[math.log(1.5)]])
    loss, grad, _ = run(logp, ZERO, t([2.0]), ONE, objective="cispo", epsilon_high=1.2)
    assert loss == pytest.approx(-1.2 * 2.0 * math.log(1.5), abs=1e-12)
    assert grad.item() == pytest.approx(-2.4, abs=1e-12)
    # w = 0.5 is below the cap and is not clipped below (CISPO has no lower clip): dP/dlogp = -0.5 * A
    loss, grad, _ = run(t([[math.log(0.5)]]), ZERO, t([-1.0]), ONE, objective="cispo", epsilon_high=1.2)
    assert loss == pytest.approx(0.5 * math.log(0.5), abs=1e-12)
    assert grad.item() == pytest.approx(0.5, abs=1e-12)


def test_cispo_keeps_a_gradient_where_ppo_clip_has_none():
    logp = t([[math.log(1.5)]])
    _, clip_grad, _ = run(logp, ZERO, t([1.0]), ONE, objective="clip")  # above 1 + 0.2 with A > 0: clipped
    _, cispo_grad, _ = run(logp, ZERO, t([1.0]), ONE, objective="cispo", epsilon_high=5.0)
    assert clip_grad.item() == 0.0
    assert cispo_grad.item() == pytest.approx(-1.5, abs=1e-12)


# --------------------------------------------------------------------------- SAPO
def sigmoid(x):
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("adv, tau", [(1.0, 1.0), (-1.0, 1.05)])
def test_sapo_soft_gate(adv, tau):
    w = 1.5
    loss, grad, _ = run(t([[math.log(w)]]), ZERO, t([adv]), ONE, objective="sapo",
                        sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)
    assert loss == pytest.approx(-(4 / tau) * sigmoid(tau * (w - 1)) * adv, abs=1e-12)
    # d/dlogp = -(4 / tau) * sigma'(tau (w - 1)) * tau * w * A
    s = sigmoid(tau * (w - 1))
    assert grad.item() == pytest.approx(-4 * s * (1 - s) * w * adv, abs=1e-12)


def test_sapo_gradient_on_policy_is_the_policy_gradient():
    # at w = 1: sigma'(0) * 4 = 1, so dP/dlogp = -A, as for PPO-clip
    _, grad, _ = run(t([[-0.7]]), None, t([0.3]), ONE, objective="sapo")
    assert grad.item() == pytest.approx(-0.3, abs=1e-12)


# --------------------------------------------------------------------------- VESPO
def test_vespo_gamma_weight_hand_worked():
    logp = t([[-1.0, -2.0]])
    old = logp - t([[0.1, 0.2]])  # log W = 0.3
    mask = torch.ones(1, 2, dtype=F64)
    for adv, k, lam in ((1.0, 2.0, 3.0), (-1.0, 3.0, 2.0)):
        phi = math.exp(lam + k * 0.3 - lam * math.exp(0.3))
        loss, grad, _ = run(logp, old, t([adv]), mask, objective="vespo", aggregation="dapo")
        assert loss == pytest.approx(-phi * adv * (-3.0) / 2, abs=1e-12)
        assert torch.allclose(grad, t([[-phi * adv / 2] * 2]), atol=1e-12)  # phi is a constant


def test_vespo_weight_is_one_on_policy_and_folds_mismatch_weights_in():
    logp = t([[-1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=F64)
    _, grad, _ = run(logp, None, t([1.0]), mask, objective="vespo", aggregation="dapo")
    assert torch.allclose(grad, t([[-0.5, -0.5]]), atol=1e-12)  # phi(1) = 1
    # token mismatch weights (0.8, 1.25): log rho = 0 -> phi = 1, and they are not applied a second time
    weights = t([[0.8, 1.25]])
    _, grad, _ = run(logp, None, t([1.0]), mask, objective="vespo", aggregation="dapo", sampling_weights=weights)
    assert torch.allclose(grad, t([[-0.5, -0.5]]), atol=1e-12)
    # one sequence weight 2.0 broadcast over its tokens counts once: log W = log 2
    phi = math.exp(3.0 + 2.0 * math.log(2.0) - 3.0 * 2.0)
    _, grad, _ = run(logp, None, t([1.0]), mask, objective="vespo", aggregation="dapo",
                     sampling_weights=t([[2.0, 2.0]]), sampling_weights_per_sequence=True)
    assert torch.allclose(grad, t([[-phi / 2] * 2]), atol=1e-12)


# --------------------------------------------------------------------------- GMPO
def test_gmpo_geometric_mean_with_sign_aware_log_clipping():
    logp = t([[0.5, -0.1]])  # log-ratios against old = 0
    mask = torch.ones(1, 2, dtype=F64)
    # A > 0: clip from above at 0.4 -> mean(0.4, -0.1) = 0.15; token 0 is clipped, no gradient
    loss, grad, _ = run(logp, torch.zeros(1, 2, dtype=F64), t([1.0]), mask, objective="gmpo", aggregation="grpo",
                        epsilon_low=0.4, epsilon_high=0.4)
    assert loss == pytest.approx(-math.exp(0.15), abs=1e-12)
    assert torch.allclose(grad, t([[0.0, -math.exp(0.15) / 2]]), atol=1e-12)
    # A < 0: only the lower side is clipped, so 0.5 stays -> mean 0.2, both tokens carry gradient
    loss, grad, _ = run(logp, torch.zeros(1, 2, dtype=F64), t([-1.0]), mask, objective="gmpo", aggregation="grpo",
                        epsilon_low=0.4, epsilon_high=0.4)
    assert loss == pytest.approx(math.exp(0.2), abs=1e-12)
    assert torch.allclose(grad, t([[math.exp(0.2) / 2] * 2]), atol=1e-12)


# --------------------------------------------------------------------------- GSPO, GSPO-token, LUSPO
def test_gspo_token_has_the_sequence_value_and_a_per_token_gradient():
    logp = t([[-1.0, -2.0, -0.5], [-0.3, -0.2, 0.0]])
    old = logp - t([[0.05, -0.02, 0.03], [0.01, 0.02, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv = t([1.0, -0.5])
    seq_loss, seq_grad, _ = run(logp, old, adv, mask, aggregation="grpo", importance_sampling_level="sequence")
    tok_loss, tok_grad, _ = run(logp, old, adv, mask, aggregation="grpo", importance_sampling_level="sequence_token")
    assert tok_loss == pytest.approx(seq_loss, abs=1e-12)
    w = [math.exp(0.06 / 3), math.exp(0.03 / 2)]  # inside [0.8, 1.2]: unclipped
    # GSPO-token: d/dlogp_t of mean_t(-w_t A) / B with dw_t/dlogp_t = w (own token only)
    expected = t([[-w[0] * 1.0 / 3 / 2] * 3, [0.5 * w[1] / 2 / 2] * 2 + [0.0]])
    assert torch.allclose(tok_grad, expected, atol=1e-12)
    # GSPO: dw/dlogp_t = w / |o| for every token; summed over |o| equal advantages it is the same gradient
    assert torch.allclose(seq_grad, expected, atol=1e-12)
    # with per-token advantages (step rewards) they differ: GSPO-token keeps A_t on its own token
    adv_t = t([[1.0, 0.0, 2.0], [-0.5, 0.5, 0.0]])
    _, tok_grad, _ = run(logp, old, adv_t, mask, aggregation="grpo", importance_sampling_level="sequence_token")
    _, seq_grad, _ = run(logp, old, adv_t, mask, aggregation="grpo", importance_sampling_level="sequence")
    assert torch.allclose(tok_grad, t([[-w[0] * a / 3 / 2 for a in (1.0, 0.0, 2.0)],
                                       [-w[1] * -0.5 / 2 / 2, -w[1] * 0.5 / 2 / 2, 0.0]]), atol=1e-12)
    assert torch.allclose(seq_grad, t([[-w[0] * 3.0 / 3 / 3 / 2] * 3, [0.0, 0.0, 0.0]]), atol=1e-12)


def test_luspo_scales_each_sequence_loss_by_its_length():
    logp = t([[-1.0, -2.0, -0.5], [-0.3, -0.2, 0.0]])
    old = logp - t([[0.05, -0.02, 0.03], [0.01, 0.02, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv = t([1.0, -0.5])
    loss, _, _ = run(logp, old, adv, mask, objective="luspo", aggregation="sequence_sum",
                     importance_sampling_level="sequence")
    w = [math.exp(0.06 / 3), math.exp(0.03 / 2)]
    assert loss == pytest.approx((3 * -w[0] * 1.0 + 2 * w[1] * 0.5) / 2, abs=1e-12)
    assert resolve_loss_type("luspo", None) == ("luspo", "sequence_sum")


# --------------------------------------------------------------------------- masks
def test_off_policy_mask_drops_negative_far_sequences_only():
    logp = torch.zeros(3, 2, dtype=F64)
    behaviour = t([[0.6, 0.6], [0.6, 0.6], [0.4, 0.4]])  # mean log pi_behaviour - log pi_theta
    adv = t([[-1.0], [1.0], [-1.0]])
    kept = off_policy_mask(adv, logp, behaviour, torch.ones(3, 2, dtype=F64), 0.5)
    assert kept.squeeze(-1).tolist() == [0.0, 1.0, 1.0]
    # in the loss: the dropped sequence contributes neither value nor gradient
    loss, grad, m = run(logp, behaviour, t([-1.0, 1.0, -1.0]), torch.ones(3, 2, dtype=F64), objective="cispo",
                        aggregation="dapo", epsilon_high=5.0, off_policy_mask_threshold=0.5)
    assert grad[0].abs().sum().item() == 0.0 and grad[1].abs().sum().item() > 0
    assert m["off_policy_mask_fraction"].item() == pytest.approx(2 / 3, abs=1e-12)


def test_off_policy_mask_prefers_the_sampler_log_probs():
    logp = torch.zeros(1, 2, dtype=F64)
    _, grad, _ = run(logp, None, t([-1.0]), torch.ones(1, 2, dtype=F64), off_policy_mask_threshold=0.5,
                     sampling_logp=t([[1.0, 1.0]]))
    assert grad.abs().sum().item() == 0.0  # sampler 1.0 above the policy: dropped, though pi_old = pi_theta


def test_entropy_quantile_threshold_and_mask():
    entropies = t([0.1, 0.5, 0.9, 0.3])
    assert entropy_quantile_threshold(entropies, 0.5).item() == pytest.approx(0.4, abs=1e-12)  # the median
    assert entropy_quantile_threshold(entropies, 0.0).item() == pytest.approx(0.9, abs=1e-12)  # the top token
    assert entropy_quantile_threshold(entropies, 1.0).item() == pytest.approx(0.1, abs=1e-12)  # every token
    logp = torch.zeros(1, 4, dtype=F64)
    entropy = entropies.reshape(1, 4)
    _, grad, m = run(logp, None, t([1.0]), torch.ones(1, 4, dtype=F64), entropy=entropy, entropy_threshold=0.4)
    # bnpo: -A / 4 tokens on the two tokens at or above the threshold, 0 elsewhere
    assert grad.tolist() == [[0.0, -0.25, -0.25, 0.0]]
    assert m["entropy_mask_fraction"].item() == pytest.approx(0.5)


def test_entropy_bonus_is_the_mean_entropy_of_the_policy_tokens():
    logp = torch.zeros(1, 4, dtype=F64)
    entropy = t([[0.1, 0.5, 0.9, 0.3]]).requires_grad_(True)
    batch = LossBatch(logp, t([0.0]), torch.ones(1, 4, dtype=F64), entropy=entropy, entropy_threshold=0.4,
                      num_micro_batches=2)
    loss, _ = policy_loss(batch, LossSettings(loss_aggregation="bnpo", entropy_coef=0.1))
    assert loss.item() == pytest.approx(-0.1 * (0.5 + 0.9) / 2 / 2, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, entropy)
    assert torch.allclose(grad, t([[0.0, -0.025, -0.025, 0.0]]), atol=1e-12)


# --------------------------------------------------------------------------- KL
def test_kl_estimators_in_the_loss_and_k3_plus_gradient():
    logp, ref = t([[-1.0]]), t([[-1.2]])
    k3 = math.exp(-0.2) + 0.2 - 1
    for name, value, gradient in (
        ("k1", 0.2, 1.0),
        ("k2", 0.02, 0.2),
        ("k3", k3, 1 - math.exp(-0.2)),
        ("k3+", k3, 0.2),  # k3's value, k2's gradient (log pi_theta - log pi_ref)
    ):
        loss, grad, m = run(logp, None, t([0.0]), ONE, beta=0.5, kl_estimator=name, ref_logp=ref)
        assert loss == pytest.approx(0.5 * value, abs=1e-12), name
        assert grad.item() == pytest.approx(0.5 * gradient, abs=1e-12), name
        assert m["kl"].item() == pytest.approx(value, abs=1e-12)


def test_bias_corrected_kl_adds_k_times_grad_log_ratio():
    logp, ref = t([[-1.0]]), t([[-1.2]])
    k3 = math.exp(-0.2) + 0.2 - 1
    loss, grad, _ = run(logp, None, t([0.0]), ONE, beta=0.5, use_bias_correction_kl=True, ref_logp=ref)
    assert loss == pytest.approx(0.5 * k3, abs=1e-12)  # w = 1 in value on a fresh batch
    assert grad.item() == pytest.approx(0.5 * (1 - math.exp(-0.2) + k3), abs=1e-12)
    # off-policy: the KL is weighted by w = exp(logp - old) in value too
    loss, _, _ = run(logp, logp - 0.1, t([0.0]), ONE, beta=0.5, use_bias_correction_kl=True, ref_logp=ref)
    assert loss == pytest.approx(0.5 * k3 * math.exp(0.1), abs=1e-12)


def test_k3_plus_is_the_unbiased_kl_gradient_on_policy():
    """E_{y~p}[(log p - log q) grad log p] = grad KL(p||q) for a softmax p(theta): check exactly on 5 tokens."""
    theta = torch.tensor([0.2, -0.4, 1.0, 0.0, 0.3], dtype=F64, requires_grad=True)
    q = torch.log_softmax(torch.tensor([0.5, 0.1, -0.2, 0.3, 0.0], dtype=F64), 0)
    logp = torch.log_softmax(theta, 0)
    p = logp.exp().detach()
    surrogate = (p * KL_ESTIMATORS["k3+"](logp, q)).sum()  # expectation of the estimator's gradient
    (estimated,) = torch.autograd.grad(surrogate, theta)
    logp = torch.log_softmax(theta, 0)
    exact_kl = (logp.exp() * (logp - q)).sum()
    (exact,) = torch.autograd.grad(exact_kl, theta)
    assert torch.allclose(estimated, exact, atol=1e-12)


# --------------------------------------------------------------------------- oracles and invariance
def _random_batch(seed, b=6, t_=5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t_, generator=g, dtype=F64) * 2
    old = logp + 0.3 * torch.randn(b, t_, generator=g, dtype=F64)
    ref = logp + 0.2 * torch.randn(b, t_, generator=g, dtype=F64)
    adv = torch.randn(b, generator=g, dtype=F64)
    lengths = torch.randint(1, t_ + 1, (b,), generator=g)
    mask = (torch.arange(t_) < lengths.unsqueeze(-1)).to(F64)
    return logp, old, ref, adv, mask


def _naive_per_token(objective, logp, old, adv, mask, s):
    """Python loops over tokens: per-token P of each objective (the formulas in losses.py)."""
    b, n = len(logp), len(logp[0])
    out = [[0.0] * n for _ in range(b)]
    for i in range(b):
        a = adv[i]
        count = max(sum(mask[i]), 1)
        if objective == "gmpo":
            kept = []
            for j in range(n):
                lr = logp[i][j] - old[i][j]
                c = min(max(lr, -s["epsilon_low"]), s["epsilon_high"])
                kept.append((min(lr, c) if a > 0 else max(lr, c) if a < 0 else 0.0) * mask[i][j])
            value = -a * math.exp(sum(kept) / count)
            out[i] = [value] * n
            continue
        if objective == "vespo":
            log_w = max(min(sum((logp[i][j] - old[i][j]) * mask[i][j] for j in range(n)), 20), math.log(1e-8))
            k, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
            out[i] = [-phi * a * logp[i][j] for j in range(n)]
            continue
        for j in range(n):
            w = math.exp(logp[i][j] - old[i][j])
            if objective == "cispo":
                out[i][j] = -min(w, s["epsilon_high"]) * a * logp[i][j]
            elif objective == "sapo":
                tau = 1.0 if a > 0 else 1.05
                out[i][j] = -(4 / tau) * sigmoid(tau * (w - 1)) * a
            else:
                c = min(max(w, 1 - s["epsilon_low"]), 1 + s["epsilon_high"])
                out[i][j] = -min(w * a, c * a)
    return out


@pytest.mark.parametrize("objective", ["clip", "cispo", "sapo", "vespo", "gmpo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_objectives_match_a_naive_loop(objective, seed):
    logp, old, _, adv, mask = _random_batch(seed)
    s = {"epsilon_low": 0.2, "epsilon_high": 0.28 if objective != "cispo" else 1.3}
    loss, _, _ = run(logp, old, adv, mask, objective=objective, aggregation="bnpo", **s)
    per = _naive_per_token(objective, logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), s)
    m = mask.tolist()
    expected = sum(per[i][j] * m[i][j] for i in range(len(per)) for j in range(len(per[0]))) / sum(map(sum, m))
    assert loss == pytest.approx(expected, abs=1e-12)


SPLIT_INVARIANT = ["grpo", "dr_grpo", "dapo", "sequence_sum"]


def _split_grad(objective, aggregation, splits, **kw):
    logp, old, ref, adv, mask = _random_batch(7, b=8)
    logp = logp.clone().requires_grad_(True)
    total = torch.zeros_like(logp)
    for idx in torch.arange(8).chunk(splits):
        batch = LossBatch(logp[idx], adv[idx], mask[idx], old_logp=old[idx], ref_logp=ref[idx],
                          num_micro_batches=splits, token_normalizer=mask.sum())
        settings = LossSettings(policy_objective=objective, loss_aggregation=aggregation, beta=0.1,
                                max_completion_length=5, **kw)
        loss, _ = policy_loss(batch, settings)
        total += torch.autograd.grad(loss, logp)[0]
    return total


@pytest.mark.parametrize("objective", sorted(POLICY_OBJECTIVES))
@pytest.mark.parametrize("aggregation", SPLIT_INVARIANT)
def test_gradient_invariant_to_the_micro_batch_split(objective, aggregation):
    """Every built-in objective is a function of each completion's own tokens, so with an aggregation whose
    normaliser does not depend on the split, four micro-batches give the gradient of one."""
    assert torch.allclose(_split_grad(objective, aggregation, 1), _split_grad(objective, aggregation, 4), atol=1e-12)


def test_every_aggregation_is_registered_once():
    assert sorted(LOSS_AGGREGATIONS) == ["bnpo", "dapo", "dr_grpo", "grpo", "sequence_sum"]
    assert sorted(POLICY_OBJECTIVES) == ["cispo", "clip", "gmpo", "luspo", "sapo", "vespo"]


# --------------------------------------------------------------------------- user registration
def test_a_user_objective_registered_by_decorator_and_by_import_path(tmp_path, monkeypatch):
    module = tmp_path / "my_losses.py"
    module.write_text(
        "from grpokit.algorithms import POLICY_OBJECTIVES\n"
        "@POLICY_OBJECTIVES.register('plain_pg', aggregation='grpo')\n"
        "def plain_pg(ratios, batch, settings):\n"
        "    return -ratios.advantages * batch.logp * settings.extra.get('scale', 1.0)\n"
        "def bare(ratios, batch, settings):\n"
        "    return -ratios.advantages * ratios.weight\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        _user_objectives()
    finally:
        POLICY_OBJECTIVES._entries.pop("plain_pg", None)  # registered by the module's decorator


def _user_objectives():
    from grpokit.config import ConfigError, GRPOConfig

    c = GRPOConfig(loss_type="my_losses:plain_pg", loss_kwargs={"scale": 2.0})
    assert c.resolved_loss == ("my_losses:plain_pg", "grpo")  # the decorator's aggregation is kept
    _, grad, _ = run(t([[-1.0, -2.0]]), None, t([0.5]), torch.ones(1, 2, dtype=F64), objective="my_losses:plain_pg",
                     aggregation="grpo", extra={"scale": 2.0})
    assert torch.allclose(grad, t([[-0.5, -0.5]]), atol=1e-12)  # -A * 2 / 2 tokens
    assert GRPOConfig(loss_type="grpo", policy_objective="my_losses:bare").resolved_loss == ("my_losses:bare", "grpo")
    with pytest.raises(ConfigError, match="'my_losses' has no attribute 'missing'; callables there: .*'plain_pg'"):
        GRPOConfig(loss_type="my_losses:missing")
    with pytest.raises(ConfigError, match="names a str, not a callable; point it at a function with the signature"):
        GRPOConfig(loss_type="os:sep")
    with pytest.raises(ConfigError, match="could not import module 'no_such_module'"):
        GRPOConfig(policy_objective="no_such_module:f")


def test_an_objective_returning_the_wrong_shape_is_named():
    POLICY_OBJECTIVES.register("broken_shape", lambda ratios, batch, settings: batch.logp.sum())
    try:
        with pytest.raises(ValueError, match="'broken_shape' returned \\(\\); it must return a tensor of shape"):
            run(t([[-1.0, -2.0]]), None, t([1.0]), torch.ones(1, 2, dtype=F64), objective="broken_shape")
    finally:
        POLICY_OBJECTIVES._entries.pop("broken_shape")
