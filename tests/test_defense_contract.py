"""The ``Defense`` base contract: validation, non-finite policy, per-client state, checkpoints, seeding.

Uses ``MagnitudePruning`` (a real, stateful defense) and small test-local subclasses: ``AddNoise``
draws from the per-client generator it is given, so it exposes seeding and generator-state
persistence.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from lightning_gp import defenses
from lightning_gp.defenses import Defense, MagnitudePruning, NonFiniteGradientError


class AddNoise(Defense):
    """Adds N(0, scale^2) noise drawn from the client's generator; stateless."""

    def __init__(self, scale: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.scale = scale

    def config(self):
        return {"scale": self.scale}

    def transform(self, gradients, state, call):
        shared = {
            n: g + self.scale * torch.randn(g.shape, generator=call.generator, dtype=g.dtype, device=g.device)
            for n, g in gradients.items()
        }
        return shared, {}


class CountCalls(Defense):
    """Keeps a per-client counter in its state (a float tensor) and returns the gradient unchanged."""

    def init_client_state(self, gradients):
        return {"calls": torch.zeros(())}

    def transform(self, gradients, state, call):
        return {n: g.clone() for n, g in gradients.items()}, {"calls": state["calls"] + 1}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def grads(seed: int = 0, shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = shapes or {"conv.weight": (2, 1, 3, 3), "fc.weight": (3, 4), "fc.bias": (3,)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[n], b[n]) for n in a)


# ------------------------------------------------------------------ argument validation


@pytest.mark.parametrize("rate", [-0.1, 1.0001, 2, float("nan"), float("inf"), -float("inf")])
def test_rate_outside_unit_interval_or_nonfinite_is_a_value_error_naming_rate(rate):
    with pytest.raises(ValueError, match="rate"):
        MagnitudePruning(rate)


@pytest.mark.parametrize("rate", [True, False, "0.5", None, [0.5]])
def test_rate_of_wrong_type_is_a_type_error_naming_rate(rate):
    with pytest.raises(TypeError, match="rate"):
        MagnitudePruning(rate)


@pytest.mark.parametrize("rate", [0, 1, 0.0, 1.0, 0.3])
def test_rate_at_and_inside_the_bounds_is_accepted_as_float(rate):
    d = MagnitudePruning(rate)
    assert d.rate == float(rate) and isinstance(d.rate, float)


@pytest.mark.parametrize("seed", [-1, 1.5, True, "3"])
def test_bad_seed_is_a_value_error(seed):
    with pytest.raises(ValueError, match="seed"):
        MagnitudePruning(0.5, seed=seed)


@pytest.mark.parametrize("policy", ["ignore", "ERROR", "", None])
def test_unknown_nonfinite_policy_is_a_value_error(policy):
    with pytest.raises(ValueError, match="nonfinite"):
        MagnitudePruning(0.5, nonfinite=policy)


def test_empty_gradients_are_rejected():
    with pytest.raises(ValueError, match="empty"):
        MagnitudePruning(0.5)({})


def test_gradients_that_are_not_a_mapping_are_rejected():
    with pytest.raises(TypeError, match="mapping"):
        MagnitudePruning(0.5)([torch.ones(3)])


def test_non_string_layer_names_are_rejected_naming_the_key():
    with pytest.raises(TypeError, match="7"):
        MagnitudePruning(0.5)({"fc.weight": torch.ones(2), 7: torch.ones(2)})


def test_non_tensor_gradient_is_rejected_naming_the_layer():
    with pytest.raises(TypeError, match=r"gradients\['fc.bias'\]"):
        MagnitudePruning(0.5)({"fc.weight": torch.ones(2), "fc.bias": [1.0, 2.0]})


def test_integer_gradient_is_rejected_naming_the_layer_and_dtype():
    with pytest.raises(TypeError, match=r"gradients\['fc.bias'\].*int64"):
        MagnitudePruning(0.5)({"fc.weight": torch.ones(2), "fc.bias": torch.ones(2, dtype=torch.int64)})


def test_sparse_gradient_is_rejected_naming_the_layer():
    sparse = torch.tensor([0.0, 1.0, 0.0, 2.0]).to_sparse()
    with pytest.raises(ValueError, match=r"gradients\['emb.weight'\].*dense"):
        MagnitudePruning(0.5)({"fc.weight": torch.ones(2), "emb.weight": sparse})


@pytest.mark.parametrize(
    "defense", [defenses.LocalGaussianMechanism(seed=0), defenses.TopKPruning(0.8), defenses.GaussianNoise(0.1)]
)
def test_a_gradient_still_in_an_autograd_graph_is_rejected_naming_the_layer(defense):
    # Before: the Gaussian mechanism and Top-k failed deep in torch ("A view was created in no_grad
    # mode ...", "mul(): functions with out=... arguments don't support automatic differentiation")
    weight = torch.randn(3, 2, requires_grad=True)
    graph = {"fc.weight": weight * 2, "fc.bias": torch.ones(3)}
    with pytest.raises(ValueError, match=r"gradients\['fc.weight'\] requires grad.*detach"):
        defense(graph)
    shared = defense({n: g.detach() for n, g in graph.items()})
    assert not any(g.requires_grad for g in shared.values())
    with torch.no_grad():
        assert defense(graph).keys() == graph.keys()


@pytest.mark.parametrize("client_id", [-1, -100])
def test_negative_client_id_is_a_value_error(client_id):
    with pytest.raises(ValueError, match="client_id"):
        MagnitudePruning(0.5)(grads(), client_id=client_id)


@pytest.mark.parametrize("client_id", [1.0, "0", True, None])
def test_non_int_client_id_is_a_type_error(client_id):
    with pytest.raises(TypeError, match="client_id"):
        MagnitudePruning(0.5)(grads(), client_id=client_id)


def test_scalar_tensor_client_id_is_accepted_as_that_int():
    d = MagnitudePruning(0.5, error_feedback=True)
    d(grads(), client_id=torch.tensor(3))
    assert d.clients == [3]
    assert isinstance(d.clients[0], int)


def test_client_id_beyond_declared_num_clients_is_an_unknown_client_key_error():
    d = MagnitudePruning(0.5)
    d.set_num_clients(4)
    d(grads(), client_id=3)  # the last valid id
    with pytest.raises(KeyError, match="unknown client_id"):
        d(grads(), client_id=4)
    with pytest.raises(KeyError, match="unknown client_id"):
        d.client_state(4)


@pytest.mark.parametrize("n", [0, -2, 1.5, "3"])
def test_set_num_clients_rejects_non_positive_or_non_int(n):
    with pytest.raises(ValueError, match="num_clients"):
        MagnitudePruning(0.5).set_num_clients(n)


# ------------------------------------------------------------------ non-finite gradients


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_raises_by_default_naming_layer_and_client(bad):
    d = MagnitudePruning(0.5, error_feedback=True)
    g = grads()
    g["fc.bias"] = torch.tensor([1.0, bad, 2.0])
    with pytest.raises(NonFiniteGradientError) as info:
        d(g, client_id=2)
    message = str(info.value)
    assert "fc.bias" in message and "client 2" in message
    assert "fc.weight" not in message and "conv.weight" not in message  # only the bad layer is named
    assert isinstance(info.value, ValueError)
    with pytest.raises(KeyError):  # the failed call created no state
        d.client_state(2)


def test_nonfinite_zero_policy_warns_and_zeros_exactly_the_nonfinite_entries():
    d = MagnitudePruning(0.0, nonfinite="zero")  # rate 0 keeps every entry, so the output shows the policy
    g = grads()
    g["fc.weight"][0, 1] = float("nan")
    g["fc.weight"][2, 3] = float("inf")
    g["fc.bias"][0] = -float("inf")
    original = {n: t.clone() for n, t in g.items()}
    with pytest.warns(RuntimeWarning, match="client 1.*fc.bias|client 1.*fc.weight"):
        out = d(g, client_id=1)
    for n, t in out.items():
        assert torch.isfinite(t).all(), n
        finite = torch.isfinite(original[n])
        assert torch.equal(t[finite], original[n][finite]), n
        assert (t[~finite] == 0).all(), n
    assert (~torch.isfinite(original["fc.weight"])).sum() == 2  # the test really had non-finite entries


def test_nonfinite_zero_policy_keeps_error_feedback_residual_finite():
    d = MagnitudePruning(0.5, error_feedback=True, nonfinite="zero")
    g = {"w": torch.tensor([float("nan"), 1.0, -4.0, 0.5])}
    with pytest.warns(RuntimeWarning):
        out = d(g)
    assert torch.equal(out["w"], torch.tensor([0.0, 1.0, -4.0, 0.0]))
    assert torch.equal(d.client_state(0)["w"], torch.tensor([0.0, 0.0, 0.0, 0.5]))


def test_a_huge_but_finite_gradient_is_not_called_non_finite():
    # entries of 1e20 overflow the float32 squares of the finite check's L2 norm: the exact check clears them
    d = MagnitudePruning(0.0)  # keeps every entry
    g = {"w": torch.tensor([1e20, -3e20, 2.0]), "b": torch.tensor([1.0])}
    out = d(g)
    assert torch.equal(out["w"], g["w"]) and torch.equal(out["b"], g["b"])


def test_a_float16_gradient_whose_norm_passes_float16_range_is_clipped_by_its_true_norm():
    # a norm of 1e5 is past float16's largest value (65504): taken in float16 it would read inf and clip to 0
    g = {"w": torch.full((100,), 1e4, dtype=torch.float16)}
    shared = defenses.LocalGaussianMechanism(0.0, 1.0, seed=0)(g)
    assert shared["w"].dtype == torch.float16
    assert float(shared["w"].float().norm()) == pytest.approx(1.0, rel=1e-2)  # float16 rounding


class _NormRecorder(Defense):
    """Identity that keeps the whole-gradient norm each call handed its transform."""

    def __init__(self, nonfinite: str = "error") -> None:
        super().__init__(seed=0, nonfinite=nonfinite)
        self.norms: list[float | None] = []

    def transform(self, gradients, state, call):
        self.norms.append(call.update_norm)
        return dict(gradients), state


def test_a_transform_gets_the_norm_the_finite_check_computed_and_none_once_a_layer_was_zeroed():
    g = grads()
    d = _NormRecorder(nonfinite="zero")
    d(g)
    assert d.norms[0] == pytest.approx(defenses.update_norm(g), rel=1e-12)
    g["fc.bias"][0] = float("nan")
    with pytest.warns(RuntimeWarning):
        d(g)
    assert d.norms[1] is None  # the zeroed gradient's norm is not the checked one


# ------------------------------------------------------------------ per-client state


def test_client_state_is_created_lazily_on_first_call():
    d = MagnitudePruning(0.5, error_feedback=True)
    assert d.clients == []
    with pytest.raises(KeyError, match="client 0"):
        d.client_state(0)
    d(grads())
    assert d.clients == [0]
    assert set(d.client_state(0)) == set(grads())


def test_error_feedback_residuals_are_kept_per_client_and_do_not_mix():
    d = MagnitudePruning(0.5, error_feedback=True)
    g0 = {"w": torch.tensor([4.0, 3.0, 2.0, 1.0])}
    g1 = {"w": torch.tensor([-1.0, -2.0, -3.0, -4.0])}
    d(g0, client_id=0)
    d(g1, client_id=5)
    assert d.clients == [0, 5]
    assert torch.equal(d.client_state(0)["w"], torch.tensor([0.0, 0.0, 2.0, 1.0]))
    assert torch.equal(d.client_state(5)["w"], torch.tensor([-1.0, -2.0, 0.0, 0.0]))
    # client 0's second round adds its own residual, not client 5's
    out = d({"w": torch.zeros(4)}, client_id=0)
    assert torch.equal(out["w"], torch.tensor([0.0, 0.0, 2.0, 1.0]))
    assert torch.equal(d.client_state(5)["w"], torch.tensor([-1.0, -2.0, 0.0, 0.0]))


def test_clients_lists_every_seen_id_sorted():
    d = CountCalls()
    for c in [7, 2, 7, 0]:
        d(grads(), client_id=c)
    assert d.clients == [0, 2, 7]
    assert d.client_state(7)["calls"].item() == 2
    assert d.client_state(2)["calls"].item() == 1


def test_reset_forgets_states_generators_and_layer_shapes():
    d = AddNoise(seed=1)
    first = d(grads())
    d.reset()
    assert d.clients == []
    assert_same(d(grads()), first)  # generator restarted from (seed, client)
    d.reset()
    d({"other": torch.ones(2)})  # shapes forgotten too: another model is fine after reset


# ------------------------------------------------------------------ state_dict / load_state_dict


def test_state_dict_round_trip_reproduces_error_feedback_outputs():
    a = MagnitudePruning(0.5, error_feedback=True, seed=3)
    for r in range(3):
        for c in (0, 1):
            a(grads(10 * r + c), client_id=c)
    b = MagnitudePruning(0.5, error_feedback=True, seed=3)
    b.load_state_dict(a.state_dict())
    assert b.clients == [0, 1]
    for c in (0, 1):
        assert_same(b(grads(99 + c), client_id=c), a(grads(99 + c), client_id=c))
    fresh = MagnitudePruning(0.5, error_feedback=True, seed=3)
    assert differs(fresh(grads(99), client_id=0), a(grads(99), client_id=0))  # the residual matters


def test_state_dict_round_trip_restores_each_clients_generator_state():
    a = AddNoise(seed=11)
    for _ in range(3):
        a(grads(), client_id=0)
    a(grads(), client_id=1)
    b = AddNoise(seed=11)
    b.load_state_dict(a.state_dict())
    fresh = AddNoise(seed=11)
    for _ in range(2):
        for c in (0, 1):
            expected = a(grads(), client_id=c)
            assert_same(b(grads(), client_id=c), expected)
            assert differs(fresh(grads(), client_id=c), expected)


def test_state_dict_survives_torch_save_and_weights_only_load():
    a = AddNoise(seed=5)
    a.set_num_clients(3)
    a(grads(), client_id=2)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b = AddNoise(seed=5)
    b.load_state_dict(torch.load(buffer, weights_only=True))
    assert b.num_clients == 3
    assert_same(b(grads(), client_id=2), a(grads(), client_id=2))


def test_loaded_state_is_independent_of_the_source_defense():
    a = AddNoise(seed=2)
    a(grads(), client_id=0)
    state = a.state_dict()
    b = AddNoise(seed=2)
    b.load_state_dict(state)
    c = AddNoise(seed=2)
    c.load_state_dict(state)
    for _ in range(3):
        a(grads(), client_id=0)  # advancing a must not advance b or c
    assert_same(b(grads(), client_id=0), c(grads(), client_id=0))


def test_load_restores_saved_seed_for_clients_not_yet_seen():
    a = AddNoise(seed=21)
    a(grads(), client_id=0)
    b = AddNoise(seed=99)
    b.load_state_dict(a.state_dict())
    assert b.seed == 21
    assert_same(b(grads(), client_id=4), a(grads(), client_id=4))


def test_loading_into_other_rate_is_a_value_error_naming_both_configs():
    a = MagnitudePruning(0.5, error_feedback=True)
    a(grads())
    b = MagnitudePruning(0.25, error_feedback=True)
    with pytest.raises(ValueError) as info:
        b.load_state_dict(a.state_dict())
    assert "rate=0.5" in str(info.value) and "rate=0.25" in str(info.value)


def test_loading_into_other_class_is_a_value_error_naming_both_classes():
    a = AddNoise(seed=0)
    a(grads())
    with pytest.raises(ValueError) as info:
        MagnitudePruning(0.5).load_state_dict(a.state_dict())
    assert "AddNoise" in str(info.value) and "MagnitudePruning" in str(info.value)


def test_failed_load_leaves_existing_state_untouched():
    b = MagnitudePruning(0.25, error_feedback=True)
    b(grads(1), client_id=1)
    before = {n: t.clone() for n, t in b.client_state(1).items()}
    a = MagnitudePruning(0.5, error_feedback=True)
    a(grads(2), client_id=0)
    with pytest.raises(ValueError):
        b.load_state_dict(a.state_dict())
    assert b.clients == [1]
    assert_same(b.client_state(1), before)


def test_load_state_dict_missing_keys_is_a_value_error():
    state = MagnitudePruning(0.5).state_dict()
    del state["generator_states"]
    with pytest.raises(ValueError, match="generator_states"):
        MagnitudePruning(0.5).load_state_dict(state)


def test_loading_state_of_a_10_client_run_into_a_4_client_run_is_a_value_error():
    a = MagnitudePruning(0.5, error_feedback=True)
    a.set_num_clients(10)
    a(grads(), client_id=7)
    b = MagnitudePruning(0.5, error_feedback=True)
    b.set_num_clients(4)
    with pytest.raises(ValueError, match=r"10 clients.*has 4|10.*4"):
        b.load_state_dict(a.state_dict())


def test_loading_adopts_the_saved_num_clients_when_none_was_declared():
    a = MagnitudePruning(0.5)
    a.set_num_clients(3)
    a(grads(), client_id=1)
    b = MagnitudePruning(0.5)
    b.load_state_dict(a.state_dict())
    assert b.num_clients == 3
    with pytest.raises(KeyError, match="unknown client_id"):
        b(grads(), client_id=3)


def test_loading_state_for_client_5_into_a_declared_4_client_run_is_a_value_error():
    a = MagnitudePruning(0.5, error_feedback=True)  # never told the number of clients
    a(grads(), client_id=5)
    b = MagnitudePruning(0.5, error_feedback=True)
    b.set_num_clients(4)
    with pytest.raises(ValueError, match="5"):
        b.load_state_dict(a.state_dict())


def test_set_num_clients_below_a_client_with_state_is_a_value_error():
    d = MagnitudePruning(0.5, error_feedback=True)
    d(grads(), client_id=5)
    with pytest.raises(ValueError, match=r"\[5\]"):
        d.set_num_clients(2)
    assert d.num_clients is None  # unchanged
    d.set_num_clients(6)  # 5 < 6 is fine
    assert d.num_clients == 6


def test_changed_layer_shape_is_a_value_error_naming_the_layer():
    d = MagnitudePruning(0.5, error_feedback=True)
    d({"fc.weight": torch.ones(3, 4), "fc.bias": torch.ones(3)}, client_id=0)
    with pytest.raises(ValueError, match=r"fc.weight: \(3, 4\) -> \(5, 4\)"):
        d({"fc.weight": torch.ones(5, 4), "fc.bias": torch.ones(3)}, client_id=0)
    # the shapes are those of the model, not of one client: another client is checked too
    with pytest.raises(ValueError, match=r"fc.weight"):
        d({"fc.weight": torch.ones(5, 4), "fc.bias": torch.ones(3)}, client_id=1)


def test_changed_layer_names_are_a_value_error_naming_missing_and_unexpected_layers():
    d = MagnitudePruning(0.5)
    d({"fc.weight": torch.ones(3, 4), "fc.bias": torch.ones(3)})
    with pytest.raises(ValueError) as info:
        d({"fc.weight": torch.ones(3, 4), "head.bias": torch.ones(3)})
    message = str(info.value)
    assert "missing: ['fc.bias']" in message and "unexpected: ['head.bias']" in message


def test_check_layer_shapes_against_a_model_with_other_shapes_is_a_value_error():
    d = MagnitudePruning(0.5, error_feedback=True)
    small = nn.Linear(4, 3)
    d({n: torch.randn_like(p) for n, p in small.named_parameters()})
    d.check_layer_shapes({n: p.shape for n, p in small.named_parameters()})  # same model: fine
    big = nn.Linear(4, 5)
    with pytest.raises(ValueError, match="weight: \\(3, 4\\) -> \\(5, 4\\)"):
        d.check_layer_shapes({n: p.shape for n, p in big.named_parameters()})


def test_check_layer_shapes_after_resume_catches_a_checkpoint_from_another_model():
    a = MagnitudePruning(0.5, error_feedback=True)
    a({"fc.weight": torch.ones(3, 4)})
    b = MagnitudePruning(0.5, error_feedback=True)
    b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match=r"fc.weight"):
        b.check_layer_shapes({"fc.weight": (2, 4)})
    b.check_layer_shapes({"fc.weight": [3, 4]})


# ------------------------------------------------------------------ seeding


def test_same_seed_gives_each_client_the_same_noise_regardless_of_call_order():
    forward, backward = AddNoise(seed=7), AddNoise(seed=7)
    f0 = forward(grads(), client_id=0)
    f1 = forward(grads(), client_id=1)
    b1 = backward(grads(), client_id=1)
    b0 = backward(grads(), client_id=0)
    assert_same(f0, b0)
    assert_same(f1, b1)


def test_different_clients_draw_from_different_streams():
    d = AddNoise(seed=7)
    assert differs(d(grads(), client_id=0), d(grads(), client_id=1))


def test_different_seeds_give_different_noise():
    assert differs(AddNoise(seed=1)(grads()), AddNoise(seed=2)(grads()))


def test_consecutive_calls_of_one_client_draw_fresh_noise():
    d = AddNoise(seed=7)
    assert differs(d(grads()), d(grads()))


def test_seed_none_is_fixed_by_torch_manual_seed_before_construction():
    torch.manual_seed(123)
    a = AddNoise()
    torch.manual_seed(123)
    b = AddNoise()
    torch.manual_seed(124)
    c = AddNoise()
    assert isinstance(a.seed, int) and a.seed >= 0
    assert a.seed == b.seed != c.seed
    assert_same(a(grads(), client_id=3), b(grads(), client_id=3))
    assert differs(a(grads(), client_id=3), c(grads(), client_id=3))


def test_noise_does_not_consume_torch_global_generator():
    d = AddNoise(seed=0)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    d(grads())
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------------------ inputs are not modified


@pytest.mark.parametrize(
    "make",
    [
        lambda: MagnitudePruning(0.5),
        lambda: MagnitudePruning(0.5, error_feedback=True),
        lambda: MagnitudePruning(0.0),
        lambda: MagnitudePruning(1.0, error_feedback=True),
        lambda: AddNoise(seed=0),
    ],
)
def test_calling_a_defense_does_not_modify_its_input_tensors(make):
    d = make()
    for r in range(3):
        g = grads(r)
        before = {n: t.clone() for n, t in g.items()}
        out = d(g)
        assert_same(g, before)
        # mutating the output must not reach the caller's tensors either
        for t in out.values():
            t.add_(1.0)
        assert_same(g, before)


def test_nonfinite_zero_policy_does_not_modify_the_input():
    d = MagnitudePruning(0.5, nonfinite="zero", error_feedback=True)
    g = {"w": torch.tensor([float("nan"), 1.0, float("inf"), -2.0])}
    with pytest.warns(RuntimeWarning):
        d(g)
    assert math.isnan(g["w"][0].item()) and math.isinf(g["w"][2].item())


def test_stored_state_is_not_aliased_to_the_returned_gradients():
    d = MagnitudePruning(0.5, error_feedback=True)
    out = d({"w": torch.tensor([4.0, 3.0, 2.0, 1.0])})
    residual = d.client_state(0)["w"].clone()
    out["w"].mul_(100)
    assert torch.equal(d.client_state(0)["w"], residual)


# ------------------------------------------------------------------ out=: writing into given tensors

BIG = {"conv.weight": (8, 4, 3, 3), "fc.weight": (40, 160), "fc.bias": (40,)}  # a layer past the histogram path


def sensitivity_of(g: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.abs() + 0.5 for n, t in g.items()}


OUT_CASES = {
    "magnitude": (lambda: MagnitudePruning(0.5), None),
    "magnitude+ef": (lambda: MagnitudePruning(0.5, error_feedback=True), None),
    "topk": (lambda: defenses.TopKPruning(rate=0.9, seed=0), None),
    "dgp": (lambda: defenses.DualGradientPruning(seed=0), None),
    "adgp": (lambda: defenses.AlignedDualGradientPruning(seed=0), None),
    "random": (lambda: defenses.RandomPruning(0.5, seed=0, error_feedback=True), None),
    "gaussian": (lambda: defenses.GaussianNoise(0.1, seed=0), None),
    "quantization": (lambda: defenses.GradientQuantization(seed=0), None),
    "optimal-pruning": (lambda: defenses.OptimalGradientPruning(0.5, seed=0), sensitivity_of),
    "optimal-noise": (lambda: defenses.OptimalGradientNoise(0.1, seed=0), sensitivity_of),
    "test-local": (lambda: AddNoise(seed=0), None),
}


@pytest.mark.parametrize("in_place", [False, True], ids=["into-other", "in-place"])
@pytest.mark.parametrize("case", list(OUT_CASES))
def test_out_receives_exactly_what_a_fresh_call_returns_and_the_state_evolves_alike(case, in_place):
    make, extra = OUT_CASES[case]
    fresh, into = make(), make()
    for r in range(3):
        g = grads(r, BIG)
        kwargs = {"sensitivity": extra(g)} if extra else {}
        expected = fresh({n: t.clone() for n, t in g.items()}, **kwargs)
        out = g if in_place else {n: torch.full_like(t, float("nan")) for n, t in g.items()}
        targets = dict(out)
        got = into(g, out=out, **kwargs)
        assert all(got[n] is targets[n] for n in g), "the shared gradient is returned in the out tensors"
        assert_same(got, expected)
        for client in fresh.clients:
            assert_same(fresh.client_state(client), into.client_state(client))


def test_out_defends_in_place_without_touching_the_other_tensors_of_the_caller():
    d, g = MagnitudePruning(0.5, error_feedback=True), grads(0, BIG)
    kept = {n: t.clone() for n, t in g.items()}
    d(kept, out={n: torch.empty_like(t) for n, t in kept.items()})
    assert_same(kept, g)  # out elsewhere: the input is read only


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda g: list(g.values()), "out must be a mapping"),
        (lambda g: {n: t for n, t in g.items() if n != "fc.bias"}, r"missing \['fc.bias'\]"),
        (lambda g: {**g, "extra": torch.zeros(1)}, r"unexpected \['extra'\]"),
        (lambda g: {**g, "fc.bias": torch.zeros(4)}, r"out\['fc.bias'\] must be a tensor of the gradient's shape"),
        (lambda g: {**g, "fc.bias": g["fc.bias"].double()}, "dtype"),
        (lambda g: {**g, "fc.bias": 0.0}, "float"),
    ],
)
def test_out_that_does_not_match_the_gradient_is_refused_before_anything_is_written(bad, match):
    d, g = MagnitudePruning(0.5, error_feedback=True), grads()
    out = bad({n: t.clone() for n, t in g.items()})
    with pytest.raises((TypeError, ValueError), match=match):
        d(g, out=out)
    assert d.clients == []  # no state created
