"""The client-side checks that make a malicious server's model manipulation visible: the digest of the
received model inside the secure aggregate (model consistency) and the replay of the public record
(model provenance), against the real active attacks of the package (Robbing the Fed, LOKI)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_gp.attacks import LOKI, RobbingTheFed, parameter_gradients
from lightning_gp.federated.model_integrity import (
    DIGEST_BITS,
    ModelProvenance,
    ModelRejected,
    consistent_digest_sum,
    digest_bits,
    model_digest,
)
from lightning_gp.models import LeNetZhu

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return LeNetZhu()


def _aggregate(model: nn.Module, clients: int, seed: int) -> dict[str, torch.Tensor]:
    """The mean of ``clients`` FedSGD gradients of random batches of 2 (the round's secure aggregate)."""
    generator = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(clients):
        images = torch.randn(2, 1, 28, 28, generator=generator)
        labels = torch.randint(0, 10, (2,), generator=generator)
        grads.append(parameter_gradients(model, nn.CrossEntropyLoss(), images, labels, create_graph=False))
    return {name: torch.stack([g[name] for g in grads]).mean(0) for name in grads[0]}


# ----------------------------------------------------------------------------------------- digest
def test_the_digest_is_a_function_of_the_state_and_any_change_flips_about_half_its_bits() -> None:
    model = _model()
    bits = digest_bits(model)
    assert bits.shape == (DIGEST_BITS,) and bits.dtype == torch.float32
    assert set(bits.unique().tolist()) <= {0.0, 1.0}
    assert model_digest(model) == model_digest(_model()) == model_digest(model.state_dict())
    nudged = _model()
    with torch.no_grad():
        weight = next(nudged.parameters())
        weight.view(-1)[0] = torch.nextafter(weight.view(-1)[0], torch.tensor(2.0))  # one ulp
    flipped = int((digest_bits(nudged) != bits).sum())
    # SHA-256: the count of flipped bits is Binomial(256, 1/2); below 64 has probability under 1e-15
    assert 64 <= flipped <= 192
    renamed = {f"x.{name}": tensor for name, tensor in model.state_dict().items()}
    assert model_digest(renamed) != model_digest(model)


def test_the_digest_sum_is_consistent_only_when_every_client_received_the_same_model() -> None:
    model = _model()
    same = [digest_bits(model) for _ in range(5)]
    assert consistent_digest_sum(torch.stack(same).sum(0), 5, same[0])
    # LOKI sends each client its own model (one slice of imprint units alive): every client sees it
    loki = LOKI(num_bins=4, seed=0).client_models(model, 3, (1, 28, 28))
    bits = [digest_bits(client_model) for client_model, _ in loki]
    total = torch.stack(bits).sum(0)
    assert not any(consistent_digest_sum(total, 3, own) for own in bits)
    # one client of five with another model: the four honest ones detect it too
    odd = torch.stack([*same[:4], digest_bits(_model(seed=1))]).sum(0)
    assert not consistent_digest_sum(odd, 5, same[0])


@pytest.mark.parametrize(
    ("digest_sum", "clients", "own", "error", "name"),
    [
        (torch.zeros(DIGEST_BITS), 0, torch.zeros(DIGEST_BITS), ValueError, "clients"),
        (torch.zeros(8), 1, torch.zeros(DIGEST_BITS), ValueError, "digest_sum"),
        (torch.zeros(DIGEST_BITS), 1, torch.full((DIGEST_BITS,), 2.0), ValueError, "own"),
        (torch.full((DIGEST_BITS,), float("nan")), 1, torch.zeros(DIGEST_BITS), ValueError, "digest_sum"),
    ],
)
def test_bad_digest_arguments_are_refused_naming_them(digest_sum, clients, own, error, name) -> None:
    with pytest.raises(error, match=name):
        consistent_digest_sum(digest_sum, clients, own)


def test_model_digest_refuses_what_is_not_a_model() -> None:
    with pytest.raises(TypeError, match="model"):
        model_digest([torch.zeros(1)])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- provenance
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_honest_server_s_models_pass_the_replay_round_after_round(momentum: float) -> None:
    """The server steps its optimizer (SGD at 0.1, with or without momentum) on each round's mean
    gradient; the client replays the same public rule on the same public aggregates: equal to the bit."""
    server = _model()
    make = lambda params: torch.optim.SGD(params, lr=0.1, momentum=momentum)  # noqa: E731
    optimizer = make(server.parameters())
    client = ModelProvenance(_model(), make)
    client.check(server)  # round 0: the public initial model
    for round_ in range(3):
        aggregate = _aggregate(server, clients=4, seed=round_)
        for name, param in server.named_parameters():
            param.grad = aggregate[name].clone()
        optimizer.step()
        client.advance(aggregate)
        client.check(server)
    assert client.rounds == 3


def test_imprint_blocks_and_rewritten_weights_are_refused() -> None:
    """Robbing the Fed's imprinted model and LOKI's per-client models have another architecture; a model
    with one weight changed (as Fishing rewrites the last layer) is another model: each is refused."""
    public = _model()
    client = ModelProvenance(public, lambda params: torch.optim.SGD(params, lr=0.1))
    imprinted, _ = RobbingTheFed(num_bins=8, seed=0).modify_model(public, (1, 28, 28))
    with pytest.raises(ModelRejected, match="architecture"):
        client.check(imprinted)
    for loki_model, _ in LOKI(num_bins=4, seed=0).client_models(public, 2, (1, 28, 28)):
        with pytest.raises(ModelRejected, match="architecture"):
            client.check(loki_model)
    fished = _model()
    with torch.no_grad():
        fished.fc.bias[3] += 5.0
    with pytest.raises(ModelRejected, match=r"fc\.bias: 1 entries differ"):
        client.check(fished)
    # a server that skips the public step (or sends a stale model) is refused after the client advanced
    client.advance(_aggregate(public, clients=2, seed=0))
    with pytest.raises(ModelRejected, match="1 round"):
        client.check(public)


def test_buffers_the_server_sets_come_with_the_public_record() -> None:
    """BatchNorm's running statistics are set by the server (FedAvg averages them), not stepped: the
    client takes them from the round's public record; a model whose statistics differ is refused."""
    public = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    server = copy.deepcopy(public)
    client = ModelProvenance(public, lambda params: torch.optim.SGD(params, lr=0.1))
    aggregate = {name: torch.ones_like(p) for name, p in server.named_parameters()}
    buffers = {"1.running_mean": torch.full((4,), 0.5), "1.running_var": torch.full((4,), 2.0)}
    with torch.no_grad():
        for name, param in server.named_parameters():
            param.sub_(0.1 * aggregate[name])
        server[1].running_mean.copy_(buffers["1.running_mean"])
        server[1].running_var.copy_(buffers["1.running_var"])
    client.advance(aggregate, buffers)
    client.check(server)
    with torch.no_grad():
        server[1].running_mean.add_(1.0)
    with pytest.raises(ModelRejected, match="running_mean"):
        client.check(server)
    with pytest.raises(ValueError, match=r"buffers\['1.running_var'\]"):
        client.advance(aggregate, {"1.running_var": torch.zeros(3)})


def test_atol_admits_float_noise_and_nothing_coarser() -> None:
    public = _model()
    noisy = _model()
    with torch.no_grad():
        for param in noisy.parameters():
            param.add_(1e-8)
    ModelProvenance(public, atol=1e-7).check(noisy)
    with pytest.raises(ModelRejected):
        ModelProvenance(public).check(noisy)
    with torch.no_grad():
        noisy.fc.weight[0, 0] += 1e-3
    with pytest.raises(ModelRejected, match=r"fc\.weight"):
        ModelProvenance(public, atol=1e-7).check(noisy)


def test_bad_provenance_arguments_are_refused_naming_them() -> None:
    with pytest.raises(TypeError, match="initial"):
        ModelProvenance(_model().state_dict())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="atol"):
        ModelProvenance(_model(), atol=-1.0)
    with pytest.raises(TypeError, match="server_optimizer"):
        ModelProvenance(_model(), lambda params: None)  # type: ignore[arg-type,return-value]
    client = ModelProvenance(_model())
    aggregate = _aggregate(_model(), clients=1, seed=0)
    with pytest.raises(ValueError, match="aggregate must hold"):
        client.advance({k: v for k, v in aggregate.items() if k != "fc.bias"})
    with pytest.raises(ValueError, match=r"aggregate\['fc.bias'\] holds NaN"):
        client.advance({**aggregate, "fc.bias": torch.full_like(aggregate["fc.bias"], float("nan"))})
    with pytest.raises(ValueError, match="shape"):
        client.advance({**aggregate, "fc.bias": torch.zeros(3)})
    assert client.rounds == 0  # nothing was applied by a refused aggregate
    with pytest.raises(TypeError, match="received"):
        client.check([1, 2])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ in the audit
def test_with_model_checks_the_audit_refuses_the_imprints_and_the_active_views_rest_on_what_passes() -> None:
    """Undefended, Robbing the Fed and LOKI leak every image to the malicious server; with the clients'
    model checks both are refused (n/a cells naming the check), and each active view leaks exactly the
    images its passive view leaks."""
    import lightning as L

    from lightning_gp.audit import AttackBudget, audit_setting, defense_catalog, published_attacks
    from lightning_gp.data import FashionMNISTSampleDataModule

    data = FashionMNISTSampleDataModule(batch_size=500)
    budget = AttackBudget(ig_iterations=5, lbfgs_iterations=3, rtf_bins=16)
    plain = defense_catalog(["undefended"])[0].build(0, 1)
    checked = plain.with_model_checks()
    assert (
        checked.model_checks and checked.name == "undefended +model checks" and checked.with_model_checks() is checked
    )
    audits = {}
    for setting in (plain, checked):
        L.seed_everything(0, verbose=False)
        audits[setting.model_checks] = audit_setting(
            setting, LeNetZhu(), data, indices=[[0, 1], [2, 3]], published=published_attacks(budget, ["IG", "RtF", "LOKI"]),
            budget=budget, aggregate=True, log=lambda line: None,
        )  # fmt: skip
    before, after = audits[False], audits[True]
    assert before.cell("RtF").status == "ok" and before.active.leak_fraction == 1.0
    assert before.aggregate_active is not None and before.aggregate_active.leak_fraction == 1.0
    refused = after.cell("RtF")
    assert refused.status == "n/a" and "refuse" in refused.note and "architecture" in refused.note
    (loki,) = [c for c in after.aggregate_cells if c.attack == "LOKI"]
    assert loki.status == "n/a" and "refuse" in loki.note
    for passive, active in ((after.passive, after.active), (after.aggregate, after.aggregate_active)):
        assert passive is not None and active is not None
        assert [r.leaks for r in active.rows] == [r.leaks for r in passive.rows]
        assert active.verdict == passive.verdict
