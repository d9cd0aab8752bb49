"""Broadcasts through the proxies with real ranks: bit-exact for every dtype and value (NaN
payloads, signalling NaNs, -0.0, infinities), root != 0, in place and out of place, async handles,
the same bytes as Horovod's; broadcast_parameters / broadcast_optimizer_state / broadcast_object on
the proxies; Horovod's errors unchanged, and ranks that disagree fail cleanly instead of hanging."""
import pytest

from tests.multiproc.harness import REPO, run_job

pytestmark = [pytest.mark.multiproc]
WORKER = REPO / "tests" / "workers" / "broadcast_worker.py"
ENV = {"FASTHOROVOD_NUM_PROXIES": "2", "FASTHOROVOD_TIMEOUT_SECONDS": "30"}


@pytest.mark.parametrize("np_", [2, 3])
def test_broadcasts_are_bit_exact_through_the_proxies(np_):
    result = run_job(np_, "exact", worker=WORKER, env=ENV, timeout=300)
    assert result.stdout.count("exact ok") == np_, result.stdout[-3000:]


def test_broadcast_functions_and_gradient_match_horovod():
    result = run_job(3, "functions", worker=WORKER, env=ENV, timeout=300)
    assert result.stdout.count("functions ok") == 3, result.stdout[-3000:]


def test_broadcast_errors_are_horovods_and_disagreements_fail_cleanly():
    result = run_job(2, "errors", worker=WORKER, env=ENV, timeout=300)
    assert result.stdout.count("errors ok") == 2, result.stdout[-3000:]
