"""LOKI's model inconsistency (Zhao et al., S&P 2024): each client sent its own slice of an imprint
block, the secure aggregate separates by slice and gives back every client's images; one model for
every client (Robbing the Fed) gets mixtures from the same aggregate."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_gp.attacks import LOKI, AttackNotApplicable, RobbingTheFed, ServerView
from lightning_gp.attacks.gradient_matching import parameter_gradients
from lightning_gp.audit import AttackBudget, DefenseSetting, audit_setting, published_attacks
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.metrics import psnr
from lightning_gp.models import LeNetZhu

CLIENTS, PER_CLIENT, BINS = 4, 4, 64
SHAPE = (1, 28, 28)


@pytest.fixture(scope="module")
def data() -> FashionMNISTSampleDataModule:
    datamodule = FashionMNISTSampleDataModule(batch_size=500)
    datamodule.setup("fit")
    datamodule.setup("test")
    return datamodule


def batches(data: FashionMNISTSampleDataModule) -> list[tuple[torch.Tensor, torch.Tensor]]:
    order = torch.randperm(len(data.train_dataset), generator=torch.Generator().manual_seed(0))
    pairs = [data.train_dataset[int(i)] for i in order[: CLIENTS * PER_CLIENT]]
    x, y = torch.stack([p[0] for p in pairs]), torch.tensor([int(p[1]) for p in pairs])
    return [
        (x[c * PER_CLIENT : (c + 1) * PER_CLIENT], y[c * PER_CLIENT : (c + 1) * PER_CLIENT]) for c in range(CLIENTS)
    ]


def aggregate_view(models: list[nn.Module], secrets: dict, parts, data) -> ServerView:
    """The mean of each client's gradient on its own model (what secure aggregation releases)."""
    grads = [
        parameter_gradients(m, nn.CrossEntropyLoss(), x, y, create_graph=False) for m, (x, y) in zip(models, parts)
    ]
    mean = {name: torch.stack([g[name] for g in grads]).mean(0) for name in grads[0]}
    return ServerView(
        model=models[0], gradients=mean, batch_size=CLIENTS * PER_CLIENT, input_shape=SHAPE, num_classes=10,
        mean=data.mean, std=data.std, server_secrets=secrets,
    )  # fmt: skip


def exact(recovered: torch.Tensor, originals: torch.Tensor, data) -> int:
    """Originals some recovered image reproduces to within float rounding (PSNR > 60 dB in pixels)."""
    mean, std = torch.tensor(data.mean).view(1, -1, 1, 1), torch.tensor(data.std).view(1, -1, 1, 1)
    a, b = (recovered * std + mean).clamp(0, 1), (originals * std + mean).clamp(0, 1)
    return sum(bool((psnr(a, b[i].expand_as(a)) > 60).any()) for i in range(b.shape[0]))


def test_the_aggregate_of_inconsistent_models_gives_back_every_client_s_images(data) -> None:
    """With K = 64 equal-mass bins per client, an image is alone in its client's slice with probability
    (1 - 1/64)^3 = 0.95, so about 15 of the 16 come back exact; Robbing the Fed's single model puts the 16
    images of 4 clients in one set of 64 bins and reads the same aggregate's bins as sums over clients."""
    parts = batches(data)
    public = torch.stack([data.test_dataset[i][0] for i in range(1000)])
    torch.manual_seed(0)
    model = LeNetZhu()
    loki = LOKI(num_bins=BINS)
    sent = loki.client_models(model, CLIENTS, SHAPE, data.mean, data.std, public_data=public)
    assert all(s == sent[0][1] for _, s in sent)  # one set of secrets; the models differ
    view = aggregate_view([m for m, _ in sent], sent[0][1], parts, data)
    recovered = loki.reconstruct(view).images
    originals = torch.cat([x for x, _ in parts])
    assert recovered.shape == originals.shape
    found = exact(recovered, originals, data)
    assert found >= 12

    rtf = RobbingTheFed(num_bins=BINS)
    consistent, secrets = rtf.modify_model(model, SHAPE, data.mean, data.std, public_data=public)
    view = aggregate_view([consistent] * CLIENTS, secrets, parts, data)
    assert exact(rtf.reconstruct(view).images, originals, data) < found


def test_one_model_for_every_client_is_refused_naming_robbing_the_fed(data) -> None:
    with pytest.raises(AttackNotApplicable, match="Robbing the Fed"):
        LOKI().modify_model(LeNetZhu(), SHAPE, data.mean, data.std)
    with pytest.raises(ValueError, match="clients"):
        LOKI().client_models(LeNetZhu(), 0, SHAPE)


def test_the_secure_aggregation_view_has_a_verdict_for_the_malicious_server(data) -> None:
    """audit_setting(aggregate=True): the honest-but-curious server's aggregate view is iDLG's on the
    mean of 4 clients, the malicious server's also LOKI's, which leaks the undefended clients' images;
    in the per-client views LOKI does not apply (one model for all is Robbing the Fed)."""
    budget = AttackBudget(ig_iterations=2, lbfgs_iterations=2, rtf_bins=BINS)
    L.seed_everything(0, verbose=False)
    order = torch.randperm(len(data.train_dataset), generator=torch.Generator().manual_seed(1))
    indices = order[: CLIENTS * 2].view(CLIENTS, 2).tolist()
    audit = audit_setting(
        DefenseSetting("undefended"), LeNetZhu(), data, indices=indices,
        published=published_attacks(budget, ["iDLG", "LOKI"]), budget=budget, num_clients=CLIENTS, seed=0,
        log=lambda line: None, aggregate=True,
    )  # fmt: skip
    assert audit.cell("LOKI").status == "n/a"
    kinds = {c.attack: (c.threat, c.sok_class) for c in audit.aggregate_cells}
    assert kinds == {"iDLG": ("passive", "A"), "LOKI": ("active", "G")}
    assert audit.aggregate_active is not None and audit.aggregate_active.verdict == "leaks"
    assert audit.aggregate_active.leak_fraction >= 0.5
    assert audit.verdict("aggregate_active") == "leaks"
    assert audit.aggregate is not None
