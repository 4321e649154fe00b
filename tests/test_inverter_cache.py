"""The learned inverter's disk cache holds tensors and plain data only and never runs code on load
(issue 44: a pickled inverter loaded with ``weights_only=False`` let whoever could write into the
cache directory run code in the audit), and no module of the package unpickles code."""

from __future__ import annotations

import ast
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_gp
from lightning_gp.attacks import InverterCache, InverterConfig, LearnedInversion, ServerView, parameter_gradients
from lightning_gp.audit import DefenseSetting, setting_simulator
from lightning_gp.audit.rounds import public_batch
from lightning_gp.models import LeNetZhu

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = InverterConfig(feature_dim=256, hidden=32, max_epochs=1, batch=32)


def test_no_module_of_the_package_loads_a_pickle_that_can_run_code() -> None:
    """Every ``torch.load`` of the package passes ``weights_only=True``, and none says ``False``."""
    package = Path(lightning_gp.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        if "weights_only=False" in source:
            offenders.append(f"{path.relative_to(package)}: weights_only=False")
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"):
                continue
            if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                continue
            safe = any(
                k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords
            )
            if not safe:
                offenders.append(f"{path.relative_to(package)}:{node.lineno}: torch.load without weights_only=True")
    assert not offenders, offenders


def _attack(data, cache: InverterCache) -> LearnedInversion:
    data.setup("test")
    images = public_batch(data, 200)
    labels = torch.as_tensor([int(data.test_dataset[i][1]) for i in range(images.shape[0])])
    simulate = setting_simulator(DefenseSetting("undefended"))
    return LearnedInversion(simulate, images, labels, defense_key="undefended", config=CONFIG, cache=cache, seed=0)


def _view(data) -> ServerView:
    torch.manual_seed(0)
    model = LeNetZhu()
    image, label = data.train_dataset[0]
    gradients = parameter_gradients(model, nn.CrossEntropyLoss(), image[None], torch.as_tensor([label]))
    return ServerView(model, gradients, 1, tuple(image.shape), 10, mean=tuple(data.mean), std=tuple(data.std))


def test_an_inverter_reloads_from_plain_tensors_with_the_same_pixels(data, tmp_path: Path) -> None:
    view = _view(data)
    first = _attack(data, InverterCache(tmp_path))
    expected = first.reconstruct(view).images
    files = list(tmp_path.glob("*.pt"))
    assert len(files) == 1
    payload = torch.load(files[0], weights_only=True)  # readable without unpickling any object
    assert payload["key"] == repr(first.key(view)) and payload["cost"]["epochs"] == 1
    later = InverterCache(tmp_path)
    again = _attack(data, later)
    torch.testing.assert_close(again.reconstruct(view).images, expected, rtol=0, atol=0)
    assert later.trainings == 0
    loaded, trained = again.inverter(view), first.inverter(view)
    assert loaded.cost == trained.cost
    for name, tensor in trained.sketch.state_dict().items():
        assert torch.equal(loaded.sketch.state_dict()[name], tensor)


class _RunsCodeWhenUnpickled:
    """What an attacker could write into the cache directory: unpickling it calls ``exec``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"with open({str(self.marker)!r}, 'w') as f: f.write('ran')",))


def test_a_pickled_object_in_the_cache_is_never_run_and_the_inverter_is_retrained(data, tmp_path: Path) -> None:
    view = _view(data)
    cache = InverterCache(tmp_path / "cache")
    attack = _attack(data, cache)
    key = attack.key(view)
    marker = tmp_path / "code_ran"
    path = cache._path(key)
    path.parent.mkdir(parents=True)
    torch.save({"key": repr(key), "inverter": _RunsCodeWhenUnpickled(marker)}, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attack.reconstruct(view)
    assert not marker.exists(), "loading the cache ran the file's code"
    assert any("InverterCache: ignoring" in str(w.message) for w in caught)
    assert cache.trainings == 1  # retrained, and the file overwritten with the safe layout
    assert torch.load(path, weights_only=True)["key"] == repr(key)


def test_a_cache_file_of_another_key_is_ignored_with_a_warning(data, tmp_path: Path) -> None:
    view = _view(data)
    first = _attack(data, InverterCache(tmp_path / "a"))
    first.reconstruct(view)
    other = InverterCache(tmp_path / "b")
    attack = LearnedInversion(
        first.simulate, first.public_images, first.public_labels, defense_key="another", config=CONFIG, cache=other
    )
    other._path(attack.key(view)).parent.mkdir(parents=True)
    shutil.copy(first.cache._path(first.key(view)), other._path(attack.key(view)))  # a valid file, wrong key
    with pytest.warns(UserWarning, match="another inverter key"):
        attack.reconstruct(view)
    assert other.trainings == 1
