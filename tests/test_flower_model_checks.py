"""The clients' model checks as a Flower client mod (``ModelChecksMod``), called on Flower messages as the
ClientApp calls it: a model of another architecture is refused before the client trains on it, the
received model's digest joins the reply, and the next round's averaged digest is checked against it.
The same mod runs inside SecAgg+ on Flower's simulation engine in ``tests/test_flower_secagg.py``."""

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("flwr", reason="the Flower integration is optional: pip install 'lightning-gp[flower]'")

from flwr.app import Array, ArrayRecord, Context, Message, RecordDict

from lightning_gp.federated import DIGEST_BITS, ModelRejected, consistent_digest_mean, digest_bits
from lightning_gp.flower import ModelChecksMod, ModelInconsistency, RefusalLog, secaggplus_workflow

SIZE = 5

pytestmark = pytest.mark.usefixtures("flower_process")


class Public(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(SIZE))
        self.bias = nn.Parameter(torch.zeros(2))


def _context(client: int = 0) -> Context:
    return Context(
        run_id=1, node_id=10 + client, node_config={"partition-id": client}, state=RecordDict(), run_config={}
    )


def _train(arrays: list[np.ndarray], server_round: int) -> Message:
    record = ArrayRecord({str(i): Array(a) for i, a in enumerate(arrays)})  # the legacy API's positional arrays
    return Message(
        RecordDict({"fitins.parameters": record}), dst_node_id=10, message_type="train", group_id=str(server_round)
    )


def _model(shift: float = 0.0) -> list[np.ndarray]:
    return [np.full(SIZE, shift, dtype=np.float32), np.zeros(2, dtype=np.float32)]


def _named(arrays: list[np.ndarray]) -> dict[str, torch.Tensor]:
    return {"weight": torch.from_numpy(arrays[0]), "bias": torch.from_numpy(arrays[1])}


class _ClientApp:
    """The inner app: records the arrays it is handed, replies with them moved by one step."""

    def __init__(self) -> None:
        self.seen: list[list[np.ndarray]] = []

    def __call__(self, msg: Message, context: Context) -> Message:
        record = next(iter(msg.content.array_records.values()))
        arrays = [a.numpy() for a in record.values()]
        self.seen.append(arrays)
        out = ArrayRecord({str(i): Array(a - 0.1) for i, a in enumerate(arrays)})
        return Message(RecordDict({"fitres.parameters": out}), reply_to=msg)


def _reply_arrays(reply: Message) -> list[np.ndarray]:
    return [a.numpy() for a in next(iter(reply.content.array_records.values())).values()]


def test_the_reply_carries_the_received_models_digest_and_the_client_app_never_sees_it() -> None:
    mod, app, context = ModelChecksMod(Public()), _ClientApp(), _context()
    first = _model()
    reply = mod(_train(first, 1), context, app)
    arrays = _reply_arrays(reply)
    assert len(arrays) == 3 and len(app.seen[0]) == 2  # the app got the model only; the reply gained the digest
    np.testing.assert_array_equal(arrays[2], digest_bits(_named(first)).numpy())
    # next round: the server's average of round 1's digests comes back as the model's last array
    second = _model(0.5)
    mod(_train([*second, arrays[2]], 2), context, app)
    assert len(app.seen[1]) == 2 and np.array_equal(app.seen[1][0], second[0])


def test_a_model_of_another_architecture_is_refused_before_the_client_trains() -> None:
    mod, app = ModelChecksMod(Public()), _ClientApp()
    imprinted = [np.zeros(SIZE + 3, dtype=np.float32), np.zeros(2, dtype=np.float32)]  # a widened first layer
    with pytest.raises(ModelRejected, match="weight"):
        mod(_train(imprinted, 1), _context(), app)
    extra_block = [*_model(), np.zeros((4, SIZE), dtype=np.float32), np.zeros(4, dtype=np.float32)]
    with pytest.raises(ModelRejected, match="architecture is not the public one"):
        mod(_train(extra_block, 1), _context(), app)
    not_a_digest = [*_model(), np.zeros(7, dtype=np.float32)]  # one extra entry, not a digest's shape
    with pytest.raises(ModelRejected, match="not the"):
        mod(_train(not_a_digest, 1), _context(), app)
    assert app.seen == []


def test_an_averaged_digest_that_another_model_entered_is_detected_next_round() -> None:
    mod, app, context = ModelChecksMod(Public()), _ClientApp(), _context()
    own = digest_bits(_named(_model()))
    mod(_train(_model(), 1), context, app)
    other = digest_bits(_named(_model(1e-3)))  # one client of three got another model
    mean = ((2 * own + other) / 3).numpy()
    with pytest.raises(ModelInconsistency, match="not every client received the same model"):
        mod(_train([*_model(0.5), mean], 2), context, app)
    assert len(app.seen) == 1


def test_a_server_that_drops_the_averaged_digest_is_detected() -> None:
    mod, app, context = ModelChecksMod(Public()), _ClientApp(), _context()
    mod(_train(_model(), 1), context, app)
    with pytest.raises(ModelInconsistency, match="dropped it"):
        mod(_train(_model(0.5), 2), context, app)


def test_a_client_that_sat_out_the_previous_round_does_not_judge_its_average() -> None:
    mod, app, context = ModelChecksMod(Public()), _ClientApp(), _context()
    mod(_train(_model(), 1), context, app)
    others = np.zeros(DIGEST_BITS, dtype=np.float32)  # round 2's average, of clients other than this one
    mod(_train([*_model(0.5), others], 3), context, app)  # it took part in round 1, not round 2
    assert len(app.seen) == 2


def test_the_digest_tolerance_separates_one_client_in_a_thousand_from_secaggplus_rounding() -> None:
    own = digest_bits(_named(_model()))
    rounding = torch.full((DIGEST_BITS,), 4e-6)  # SecAgg+'s quantisation step at Flower's defaults
    assert consistent_digest_mean(own + rounding * (1 - 2 * own), own)
    one_in_a_thousand = (999 * own + digest_bits(_named(_model(1.0)))) / 1000
    assert not consistent_digest_mean(one_in_a_thousand, own)
    with pytest.raises(ValueError, match="digest_mean"):
        consistent_digest_mean(own[:-1], own)
    with pytest.raises(ValueError, match="atol"):
        consistent_digest_mean(own, own, atol=-1.0)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="public_model"):
        ModelChecksMod({"weight": torch.zeros(3)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no state"):
        ModelChecksMod(nn.ReLU())
    with pytest.raises(ValueError, match="atol"):
        ModelChecksMod(Public(), atol=float("nan"))


def test_the_refusal_log_writes_each_refusal_down_and_lets_it_propagate(tmp_path) -> None:
    log, mod, app = RefusalLog(tmp_path), ModelChecksMod(Public()), _ClientApp()
    imprinted = [*_model(), np.zeros((4, SIZE), dtype=np.float32), np.zeros(4, dtype=np.float32)]
    with pytest.raises(ModelRejected):
        log(_train(imprinted, 7), _context(client=2), lambda msg, context: mod(msg, context, app))
    log(_train(_model(), 7), _context(client=1), lambda msg, context: mod(msg, context, app))  # accepted
    assert list(log.refusals(7)) == [2] and log.refusals(7)[2].startswith("ModelRejected: the model's architecture")
    assert log.refusals(8) == {}


def test_the_secaggplus_workflow_has_an_odd_share_count_a_majority_threshold_and_the_given_max_weight() -> None:
    for clients, shares in ((3, 3), (4, 3), (5, 5), (1000, 5)):
        workflow = secaggplus_workflow(clients, max_weight=8.0)
        assert (workflow.num_shares, workflow.reconstruction_threshold) == (shares, shares // 2 + 1)
        assert workflow.max_weight == 8.0
    with pytest.raises(ValueError, match="clients"):
        secaggplus_workflow(2, max_weight=1.0)
    with pytest.raises(ValueError, match="max_weight"):
        secaggplus_workflow(3, max_weight=0.0)
