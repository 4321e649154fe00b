import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import their helpers module
warnings.filterwarnings("ignore", message=".*LeafSpec.*")

if "PYTEST_XDIST_WORKER" in os.environ:
    # `make test` runs one pytest-xdist worker per core: one torch thread each (and in the processes
    # they start) keeps the workers from oversubscribing the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run as fast on one thread as on two, and one thread is immune to CPU
    oversubscription (two spinning OpenMP threads slow down many-fold when cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def data():
    """The built-in Fashion-MNIST sample, set up for fitting."""
    from lightning_gp.data import FashionMNISTSampleDataModule

    datamodule = FashionMNISTSampleDataModule()
    datamodule.setup("fit")
    return datamodule


@pytest.fixture(scope="session")
def sample_tests(data):
    """The audit's recognisable-image tests of the built-in sample (the shipped semantic test and the
    identification test on its public split), as an audit of that data scores with them."""
    from lightning_gp.audit.recognition import datamodule_recognition_tests

    return datamodule_recognition_tests(data, log=lambda _: None)


@pytest.fixture(scope="module")
def crops():
    """Small RGB 3x32x32 photo crops (16 training and 48 public images a class), set up."""
    from lightning_gp.data.photo_crops import PhotoCropsDataModule

    datamodule = PhotoCropsDataModule(per_class_train=16, per_class_test=48)
    datamodule.setup("fit")
    return datamodule


@pytest.fixture(scope="module")
def crop_tests(crops):
    """The identification test on the crops' public split; the semantic test left out, named as missing."""
    from lightning_gp.audit.rounds import public_examples
    from lightning_gp.metrics import IdentificationTest
    from lightning_gp.metrics.recognition import RecognitionTests
    from lightning_gp.normalization import denormalize

    public, labels = public_examples(crops)
    identification = IdentificationTest(denormalize(public, crops.mean, crops.std), labels)
    return RecognitionTests(None, identification, {"semantic": "not under test here"})


@pytest.fixture
def flower_process(monkeypatch):
    """Flower builds messages inside a process that knows its run and node; a test that calls the apps
    and mods directly plays that process."""
    from flwr.supercore.task_identity import TaskIdentity

    for attribute, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attribute, value)
